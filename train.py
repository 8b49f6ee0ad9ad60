#!/usr/bin/env python3
"""Train an image classifier from WebDataset shards; the same command under torchrun.

./run train.py                                    # the embedded default: synthetic shards, CPU, minutes
./run train.py trainer.steps=100 model.name=resnet50
./run train.py data=shards data.num_classes=N data.train_shards=DIR/train.index.json data.val_shards=DIR/val.index.json
./run torchrun --nproc_per_node=8 train.py data=imagenet data.train_shards=... data.val_shards=...
./run train.py --cfg job                          # print the composed config (Hydra)
"""

from __future__ import annotations

import gc
import sys

try:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from wdsdist.train import config
except ImportError as exc:  # an install without the trainer's extra
    extra = "pip install 'wds-distributed[train]'"
    print(f"error: train.py needs the trainer's packages: {extra} ({exc})", file=sys.stderr)
    sys.exit(2)


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    config.run_job(config.check, cfg, overrides, same_on_every_rank=True)  # bad values fail before torch loads
    from wdsdist.train.trainer import train

    config.run_job(train, cfg)
    # The run's DDP model holds the process group through reference cycles: freed here, while the
    # interpreter is whole (examples/ddp_loop.py says what its exit did with them).
    gc.collect()


if __name__ == "__main__":
    config.register()
    config.run_hydra(main)
