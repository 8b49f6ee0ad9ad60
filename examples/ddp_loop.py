"""The shortest correct DDP loop on wdsdist.data: equal batches on every rank, exact resume.

    torchrun --nproc_per_node=2 examples/ddp_loop.py data/synthetic/synthetic-train.index.json --epochs 2

Run it again with the same --ckpt to go on from where it stopped (--stop-after N stops at step N).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

from wdsdist.data import Loader, LoaderConfig

p = argparse.ArgumentParser()
p.add_argument("shards", help="a directory, an index JSON, a brace pattern or URLs")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--image-size", type=int, default=32)
p.add_argument("--num-classes", type=int, default=10)
p.add_argument("--ckpt", default="ddp_loop.pt")
p.add_argument("--stop-after", type=int, help="stop at this step, with a checkpoint")
p.add_argument("--trace", help="append each rank's sample positions per epoch to TRACE.RANK.jsonl")
args = p.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
cfg = LoaderConfig(mode="epoch", batch_size=args.batch_size, image_size=args.image_size, num_classes=args.num_classes)
loader = Loader(args.shards, cfg)  # rank and world from torch.distributed; the same len() on every rank
model = torchvision.models.resnet18(num_classes=args.num_classes).to(device, memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
step = 0
if os.path.exists(args.ckpt):  # every rank reads it: the loader state holds every rank's position
    ckpt = torch.load(args.ckpt, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    loader.load_state_dict(ckpt["loader"])
    step = ckpt["step"]
ddp = DDP(model)
mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255


def save() -> None:
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict(), "step": step}
    if dist.get_rank() == 0:  # loader.state_dict() above is a collective: every rank called it
        torch.save(state, args.ckpt + ".tmp")
        os.replace(args.ckpt + ".tmp", args.ckpt)


while loader.epoch < args.epochs and step != args.stop_after:
    epoch, batches, seen = loader.epoch, len(loader), []
    for batch in loader:  # len(loader) batches on every rank: no rank waits for another at the end
        images = (batch["image"].to(device, non_blocking=True).float() - mean) / std
        loss = F.cross_entropy(ddp(images), batch["label"].to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step, seen = step + 1, seen + batch["pos"].tolist()
        if step == args.stop_after:
            break
    save()
    if args.trace:
        with open(f"{args.trace}.{dist.get_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"epoch": epoch, "batches": batches, "pos": seen}) + "\n")
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: step {step}, loss {loss.item():.3f}", flush=True)
dist.destroy_process_group()
