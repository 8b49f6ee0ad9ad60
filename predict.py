#!/usr/bin/env python3
"""Classify images with a trained model (wds-predict once installed).

predict.py outputs/RUN ~/photos/new/                  # top 5 with class names, as a table
predict.py outputs/RUN a.jpg b.png --format jsonl --top-k 3
predict.py outputs/RUN 'data/val-{000000..000003}.tar' --format csv --out predictions.csv
predict.py outputs/RUN --export onnx                  # RUN/model.onnx, checked against torch
torchrun --nproc_per_node=8 predict.py outputs/RUN 'SPEC' --out-dir DIR --out all.jsonl   # a whole data set
"""

from wdsdist.predict.cli import run

if __name__ == "__main__":
    run()
