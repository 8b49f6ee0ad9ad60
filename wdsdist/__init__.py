"""wds-distributed: train image classifiers from WebDataset shards on many GPUs and nodes."""

from wdsdist import preload
from wdsdist.errors import UserError

preload.nvjpeg()  # before torchvision is imported anywhere (preload.py says why)

__all__ = ["UserError"]
