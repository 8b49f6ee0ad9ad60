"""Run an example with its ResNet-18 swapped for a one-convolution net:

    python tests/helpers/small_model.py examples/EXAMPLE.py ARGS...

For the tests of which samples an example's ranks train on, in which order, and where a resume
goes on: the model has no bearing on that, and a ResNet-18's 11 M parameters (their all-reduce
and SGD update at every step, a 90 MB checkpoint of them and their optimiser state) were most of
such a run's CPU (bench/results/2026-11-28-examples-tests.md). The tests that the examples learn
run them as they are.
"""

import os
import runpy
import sys

import torch
import torchvision


class OneConv(torch.nn.Module):
    """As much of a ResNet as the examples touch: ``conv1`` (they set their small-image stem there)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.fc = torch.nn.Linear(64, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv1(images)).mean((2, 3)))


if __name__ == "__main__":
    torchvision.models.resnet18 = OneConv  # the examples look it up when they build their model
    script = os.path.abspath(sys.argv[1])
    sys.argv, sys.path[0] = sys.argv[1:], os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
