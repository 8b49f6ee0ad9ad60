"""PyTorch Lightning on wdsdist.data: DDP training of a ResNet-18, exact resume, exact evaluation.

    python examples/lightning_train.py data/synthetic/synthetic-train.index.json \
        --val data/synthetic/synthetic-val.index.json --devices 2 --epochs 2 --save-every 50

Lightning starts the other processes itself (it runs this script again). Run it again with
--resume CKPT_DIR/last.ckpt to go on from a checkpoint, on the same or another number of devices.
Validation runs through DDP, so every device needs a validation shard: --val needs at least
--devices shards.
"""

import argparse
import json
import math
import os
import sys
import warnings

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from pytorch_lightning.callbacks import ModelCheckpoint

from wdsdist.data import LoaderConfig, expand_shards
from wdsdist.lightning import WdsDataModule


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The launch line above the options, each option's default beside it."""


p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
p.add_argument("shards", help="training shards: a directory, an index JSON, a brace pattern or URLs")
p.add_argument("--val", help="validation shards (at least one per device)")
p.add_argument("--devices", type=int, default=1, help="processes, one per device")
p.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
p.add_argument("--mode", default="epoch", choices=["epoch", "repeat"], help="repeat: count --max-steps")
p.add_argument("--epochs", type=int, default=2, help="epochs to train")
p.add_argument("--max-steps", type=int, default=-1, help="stop at this step (with a checkpoint if --save-every)")
p.add_argument("--batch-size", type=int, default=64, help="per device")
p.add_argument("--image-size", type=int, default=32, help="side of the training crops, in pixels")
p.add_argument("--num-classes", type=int, default=10, help="classes (labels outside 0..N-1 are skipped)")
p.add_argument("--workers", default="auto", help="loader workers per device; auto: sized to this node's cores")
p.add_argument("--decode", default="cpu", choices=["cpu", "gpu"], help="gpu: decode JPEGs on the GPU (nvJPEG)")
p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256, scaled")
p.add_argument("--schedule", default="cosine", choices=["cosine", "constant"], help="cosine: 5 %% warmup, then down")
p.add_argument("--ckpt-dir", default="lightning_ckpt", help="where checkpoints go")
p.add_argument("--save-every", type=int, help="write CKPT_DIR/last.ckpt every N steps")
p.add_argument("--resume", help="a checkpoint to go on from")
p.add_argument("--trace", help="write each rank's batches (epoch, sample positions, ids) to TRACE.RANK.json")
args = p.parse_args()


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torchvision.models.resnet18(num_classes=args.num_classes)
        if args.image_size < 112:  # small images: a 3x3 stride-1 stem instead of ImageNet's 7x7 stride 2
            self.model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.model.to(memory_format=torch.channels_last)  # as the loader's images are
        # The loader gives uint8 batches: normalise on the device.
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255, persistent=False)
        self.sums = torch.zeros(2, dtype=torch.long)  # validation: correct, seen on this rank
        self.trace: list[dict] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model((images.float() - self.mean) / self.std)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch["image"]), batch["label"])
        self.log("loss", loss, prog_bar=True)  # no sync_dist: no collective per step
        if args.trace:
            loader = self.trainer.datamodule.loader
            length = len(loader) if args.mode == "epoch" else None
            entry = {"epoch": self.current_epoch, "len": length, "lightning_len": self.trainer.num_training_batches}
            self.trace.append(entry | {"pos": batch["pos"].tolist(), "id": batch["id"].tolist()})
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # Ranks get different numbers of validation batches: sum here, all-reduce once at the end.
        hits = (self(batch["image"]).argmax(1) == batch["label"]).sum()
        self.sums += torch.stack([hits, hits.new_tensor(len(batch["label"]))])

    def on_validation_epoch_start(self) -> None:
        self.sums = torch.zeros(2, dtype=torch.long, device=self.device)

    def on_validation_epoch_end(self) -> None:
        correct, seen = self.trainer.strategy.reduce(self.sums, reduce_op="sum").tolist()
        self.log("val_top1", correct / max(seen, 1), prog_bar=True)  # reduced already: the same on every rank
        self.print(f"epoch {self.current_epoch}: top-1 {correct / max(seen, 1):.3f} on {int(seen)} samples")

    def configure_optimizers(self):
        lr = args.lr * args.batch_size * args.devices / 256
        opt = torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
        if args.schedule == "constant":
            return opt
        # estimated_stepping_batches builds the train loader early: the DataModule resumes it anyway.
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = max(1, total // 20)  # 5 % of the steps, then cosine to 0

        def factor(s: int) -> float:
            return (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * min(1, (s - warmup) / total)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_end(self) -> None:
        if args.trace:
            with open(f"{args.trace}.{self.global_rank}.json", "w") as f:
                json.dump(self.trace, f)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", ".*sync_dist=True.* when logging on epoch level")  # val_top1 is reduced
    cfg = LoaderConfig(
        mode=args.mode,
        batch_size=args.batch_size,
        image_size=args.image_size,
        num_classes=args.num_classes,
        workers=args.workers,
        decode=args.decode,
        crop_scale=(0.35, 1.0),  # small images: keep most of each one
        # workers=auto sizes by these: batches for a GPU, and the processes on this node
        pin_memory=torch.cuda.is_available() and args.accelerator != "cpu",
        node_ranks=args.devices,
    )
    folders = [os.path.abspath(args.ckpt_dir)] + ([os.path.dirname(os.path.abspath(args.trace))] if args.trace else [])
    for path, folder in zip([args.ckpt_dir, args.trace], folders, strict=False):  # before training: writable?
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            sys.exit(f"error: {path}: cannot make the folder {folder}: {exc.strerror}")
        if not os.access(folder, os.W_OK):
            sys.exit(f"error: {path}: the folder {folder} is not writable")
    if args.val and len(expand_shards(args.val, cfg)) < args.devices:
        sys.exit(f"error: --val {args.val}: fewer shards than --devices {args.devices}; write more, smaller shards")
    data = WdsDataModule(args.shards, cfg, val_shards=args.val)
    checkpoints = [ModelCheckpoint(args.ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=args.save_every)]
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp",
        use_distributed_sampler=False,  # the loader splits the data over the ranks itself
        max_epochs=args.epochs if args.mode == "epoch" else -1,
        max_steps=args.max_steps,
        callbacks=checkpoints if args.save_every else [],
        enable_checkpointing=bool(args.save_every),
        logger=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Classifier(), datamodule=data, ckpt_path=args.resume)
