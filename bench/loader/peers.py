"""The peer loaders of ``bench.py --peers``, each in the setup its own documentation gives.

Run only inside .bench-venv (bench/requirements-peers.txt), one contender per process, by
bench.py. Every one does the same work per sample as ours: decode, RandomResizedCrop(224) (scale
0.08-1, ratio 3/4-4/3), horizontal flip half the time, uint8 batches of 64, drop the last partial
batch, 2 workers (DataLoader worker processes, or DALI's, FFCV's and SPDL's own threads). Each peer's
own format is converted once from the bench's images (``convert``), outside the timed part, and
cached under the data set's folder (peers/NAME/); wids and SPDL read the shards as they are.
"""

# A long module: one setup per peer loader, each as its own documentation writes it, side by side
# so that a reader compares them in one place.

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

# torch.frombuffer over read-only bytes: only read here (decode_jpeg), so its warning says nothing.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

PEERS = ("streaming", "litdata", "dali", "ffcv", "wids", "spdl")
CHUNK_BYTES = 64 << 20  # MDS and LitData chunk size: their documented defaults are 64 MB ("64mb")


def tree_samples(info: dict) -> list[tuple[str, int]]:
    """The data set's images (path, class), in a fixed order; the same bytes as its shards."""
    tree = Path(info["tree"])
    return [(str(p), int(p.parent.name[5:])) for p in sorted(tree.glob("class*/*.jpg"))]


def shard_paths(info: dict) -> list[str]:
    """The tar files that the data set's index names (wids index: urls relative to the index)."""
    index = json.loads(Path(info["index"]).read_text())
    base = Path(info["index"]).parent
    return [str(base / s["url"]) for s in index["shardlist"]]


def torch_transform():
    """Ours, exactly (wdsdist.data.decode.sample.make_transform): v2 on uint8 CHW tensors."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])


def policy(augment: str):
    """The policy as torchvision's classification reference builds it (bilinear), for PIL images;
    None for ``none``. RandAugment as our data.augment=randaugment: 2 ops at magnitude 9."""
    from torchvision import transforms as T

    bilinear = T.InterpolationMode.BILINEAR
    if augment == "trivialaugment":
        return T.TrivialAugmentWide(interpolation=bilinear)
    if augment == "randaugment":
        return T.RandAugment(num_ops=2, magnitude=9, interpolation=bilinear)
    return None


def with_policy(transform, augment: str):
    """``transform`` (to a uint8 CHW crop) then the policy on the crop as a PIL image, as users of
    a loader with a Python transform write it; ``transform`` itself for ``none``."""
    chosen = policy(augment)
    if chosen is None:
        return transform

    def crop_then_policy(image):
        from torchvision.transforms import functional as F

        return F.pil_to_tensor(chosen(F.to_pil_image(transform(image))))

    return crop_then_policy


def decode_crop(jpg: bytes, transform):
    """torchvision's tensor path: libjpeg-turbo decode to uint8 CHW, then the transform."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    return transform(decode_jpeg(torch.frombuffer(jpg, dtype=torch.uint8), mode=ImageReadMode.RGB))


def folder_of(name: str, info: dict) -> Path:
    return Path(info["tree"]).parent / "peers" / name


# ---------------------------------------------------------------- conversion, once per data set


# Each peer's conversion is a few lines of its own documented writer, side by side, so a reader
# compares them in one place; FFCV's, which needs a data set class, is _write_ffcv below (the
# issue's limit: no function over 60 lines).
def convert(name: str, info: dict) -> dict:
    """Write the peer's format from the data set once; returns what it took (seconds, MB)."""
    import time

    folder = folder_of(name, info)
    done = folder / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    if folder.exists():
        shutil.rmtree(folder)  # an earlier conversion that did not finish
    folder.mkdir(parents=True)
    start = time.perf_counter()
    out = folder / "data"
    if name == "streaming":
        from streaming import MDSWriter

        # MDS's "bytes" column keeps the JPEG as it is; decoding is the reader's (torchvision's).
        with MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"}, size_limit=CHUNK_BYTES) as writer:
            for path, label in tree_samples(info):
                writer.write({"jpg": Path(path).read_bytes(), "cls": label})
    elif name == "litdata":
        import litdata as ld

        # LitData's documented image path: return PIL images from the function; a JPEG file opened
        # by PIL is stored as its own bytes and decoded on read by torchvision's decode_jpeg.
        ld.optimize(
            fn=_litdata_sample, inputs=tree_samples(info), output_dir=str(out), chunk_bytes=CHUNK_BYTES, num_workers=2
        )
    elif name == "dali":
        # DALI's own index format for its webdataset reader, made by its wds2idx tool.
        out.mkdir()
        for tar in shard_paths(info):
            idx = out / (Path(tar).stem + ".idx")
            subprocess.run(
                [str(Path(sys.executable).parent / "wds2idx"), tar, str(idx)], check=True, capture_output=True
            )
    elif name == "ffcv":
        _write_ffcv(out, info)
    elif name in ("wids", "spdl"):
        pass  # read our shards as they are
    else:
        raise ValueError(name)
    result = {"convert_s": round(time.perf_counter() - start, 1), "mb": round(_size(folder) / 2**20, 1)}
    done.write_text(json.dumps(result))
    return result


def _write_ffcv(out: Path, info: dict) -> None:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from PIL import Image

    class Images:
        def __init__(self, samples):
            self.samples = samples

        def __len__(self):
            return len(self.samples)

        def __getitem__(self, i):
            path, label = self.samples[i]
            return Image.open(path).convert("RGB"), label

    # FFCV stores JPEG fields by encoding them itself (write_mode="jpg", at jpeg_quality), so
    # its images are re-encodings of ours at quality 90, not the same bytes.
    fields = {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}
    DatasetWriter(str(out) + ".beton", fields, num_workers=2).from_indexed_dataset(Images(tree_samples(info)))


def _litdata_sample(item: tuple[str, int]) -> dict:
    from PIL import Image

    path, label = item
    return {"image": Image.open(path), "cls": label}


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# ---------------------------------------------------------------- loaders


def loader_for(name: str, info: dict, workers: int, batch: int, augment: str = "none"):
    """An iterable over uint8 image batches, used epoch after epoch (``iter`` per epoch); with
    ``augment`` (not FFCV's: it has no such policy), the policy after the crop and flip."""
    folder = folder_of(name, info)
    if name == "streaming":
        return _streaming(folder / "data", workers, batch, augment=augment)
    if name == "litdata":
        return _litdata(str(folder / "data"), workers, batch, augment=augment)
    if name == "dali":
        return _dali(info, folder / "data", workers, batch, augment)
    if name == "ffcv" and augment == "none":
        return _ffcv(str(folder / "data") + ".beton", workers, batch)
    if name == "wids":
        return _wids(info, workers, batch, augment)
    if name == "spdl":
        return SpdlEpochs(shard_paths(info), workers, batch, augment)
    raise ValueError(f"{name} with augment={augment}")


def remote_loader(name: str, remote: str, cache: str, workers: int, batch: int):
    """As ``loader_for``, for the peers that read an object store (bench/data/remote.py): the peer's
    converted data read from ``remote`` (s3://, the endpoint from the environment) into its own
    cache in the folder ``cache``."""
    if name == "streaming":
        return _streaming(Path(cache), workers, batch, remote)
    if name == "litdata":
        from litdata.streaming import downloader

        # LitData gets chunks through obstore, whose client refuses plain http unless allowed,
        # and LitData allows only what its module-wide client options say (https stores): the
        # bench's S3 API server speaks plain http, as the shards' store does, so it is allowed
        # here (the DataLoader's forked workers inherit it).
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
        return _litdata(remote, workers, batch, cache)
    raise ValueError(name)


def _streaming(local: Path, workers: int, batch: int, remote: str | None = None, augment: str = "none"):
    from streaming import StreamingDataLoader, StreamingDataset

    class Images(StreamingDataset):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.transform = with_policy(torch_transform(), augment)

        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return decode_crop(sample["jpg"], self.transform), sample["cls"]

    # Its own shuffle (shuffle_algo's default, py1e); batch_size tells it how batches will be cut.
    # With a remote, local is its cache: shards are downloaded there whole and kept.
    ds = Images(remote=remote, local=str(local), shuffle=True, batch_size=batch)
    return StreamingDataLoader(ds, batch_size=batch, num_workers=workers, drop_last=True, persistent_workers=True)


def _litdata(input_dir: str, workers: int, batch: int, cache: str | None = None, augment: str = "none"):
    import litdata as ld

    transform = with_policy(torch_transform(), augment)

    class Images(ld.StreamingDataset):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return transform(sample["image"]), sample["cls"]

    # A remote input_dir's chunks are downloaded whole into cache_dir (max_cache_size: its default).
    ds = Images(input_dir, cache_dir=cache, shuffle=True, drop_last=True)
    return ld.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, drop_last=True)


def _dali(info: dict, idx_folder: Path, workers: int, batch: int, augment: str = "none"):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import rand_augment, trivial_augment
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    tars = shard_paths(info)
    idx = [str(idx_folder / (Path(t).stem + ".idx")) for t in tars]

    # CPU only: device_id=None; num_threads are DALI's workers. auto_aug's policies branch per
    # sample, which DALI's conditionals do (its docs' way to run them).
    @pipeline_def(batch_size=batch, num_threads=workers, device_id=None, enable_conditionals=augment != "none")
    def pipe():
        jpg, cls = fn.readers.webdataset(
            paths=tars,
            index_paths=idx,
            ext=["jpg", "cls"],
            random_shuffle=True,
            initial_fill=1000,
            missing_component_behavior="error",
            name="reader",
        )
        img = fn.decoders.image_random_crop(jpg, device="cpu", output_type=types.RGB)  # area 0.08-1, ratio 3/4-4/3
        img = fn.resize(img, resize_x=224, resize_y=224)
        img = fn.flip(img, horizontal=fn.random.coin_flip())
        if augment == "trivialaugment":  # DALI's own policies (nvidia.dali.auto_aug), on the CPU here
            img = trivial_augment.trivial_augment_wide(img)
        elif augment == "randaugment":
            img = rand_augment.rand_augment(img, n=2, m=9)
        return img, cls

    p = pipe()
    p.build()
    return DALIGenericIterator(
        p, ["image", "cls"], reader_name="reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
    )


def _ffcv(path: str, workers: int, batch: int):
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    pipelines = {
        "image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(), ToTorchImage()],
        "label": [IntDecoder(), ToTensor()],
    }
    # As FFCV's ImageNet example when the data set fits in memory: os_cache=True with RANDOM order.
    return Loader(
        path,
        batch_size=batch,
        num_workers=workers,
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=True,
        pipelines=pipelines,
    )


def _wids(info: dict, workers: int, batch: int, augment: str = "none"):
    import torch
    import wids

    transform = with_policy(torch_transform(), augment)

    def make_sample(sample: dict):
        # wids hands each member over as an io.BytesIO (over its mapped tar)
        return decode_crop(sample[".jpg"].getvalue(), transform), int(sample[".cls"].getvalue())

    # Raw bytes from the shards (no PIL decode), torchvision's tensor path as for the others.
    ds = wids.ShardListDataset(info["index"], transformations=[make_sample])
    sampler = wids.DistributedChunkedSampler(ds, chunksize=1000, shuffle=True)
    return torch.utils.data.DataLoader(
        ds, batch_size=batch, sampler=sampler, num_workers=workers, drop_last=True, persistent_workers=True
    )


def crop_params(width: int, height: int, rng) -> tuple[int, int, int, int]:
    """RandomResizedCrop's draw (scale 0.08-1, ratio 3/4-4/3, 10 tries, then the centre crop within
    the ratio), as torchvision's get_params, with ``rng`` (a random.Random): (x, y, w, h)."""
    import math

    area, log_ratio = width * height, (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif ratio > 4 / 3:
        w, h = int(round(height * 4 / 3)), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class SpdlEpochs:
    """SPDL (facebookresearch/spdl) as its documentation builds a data loader: a PipelineBuilder
    whose source yields the samples (each tar read with spdl.io.iter_tarfile, shards in a new order
    each epoch, a shuffle buffer of 1,000 as ours), a decode stage on ``workers`` threads (demux_image
    + decode_packets with the crop, the resize and the flip as FFmpeg filters, native code that
    releases the GIL), batches of ``batch`` (drop_last), and a collate stage into one uint8 tensor.
    Threads in one process, not worker processes: SPDL's design."""

    def __init__(self, tars: list[str], workers: int, batch: int, augment: str = "none"):
        import random

        self.tars, self.workers, self.batch, self.rng = tars, workers, batch, random.Random(0)
        self.policy = policy(augment)  # on the decoded crop as a PIL image, in the decode stage

    def _samples(self):
        import spdl.io

        order = list(self.tars)
        self.rng.shuffle(order)
        buffer: list = []
        for tar in order:
            with open(tar, "rb") as f:
                members = dict(spdl.io.iter_tarfile(f.read()))
            for name, data in members.items():
                if name.endswith(".jpg"):
                    buffer.append((data, int(bytes(members[name[:-4] + ".cls"]))))
                    if len(buffer) >= 1000:
                        yield buffer.pop(self.rng.randrange(len(buffer)))
        self.rng.shuffle(buffer)
        yield from buffer

    def __iter__(self):
        import random
        import threading

        import numpy as np
        import spdl.io
        import torch
        from PIL import Image
        from spdl.pipeline import PipelineBuilder

        local = threading.local()

        def decode(item):
            data, label = item
            if not hasattr(local, "rng"):  # one generator per decode thread
                local.rng = random.Random()
            rng = local.rng
            packets = spdl.io.demux_image(data)
            x, y, w, h = crop_params(packets.width, packets.height, rng)
            flip = ",hflip" if rng.random() < 0.5 else ""
            desc = f"crop={w}:{h}:{x}:{y},scale=224:224:flags=bilinear{flip},format=rgb24"
            frames = spdl.io.decode_packets(packets, filter_desc=desc)
            image = spdl.io.to_numpy(spdl.io.convert_frames(frames))
            if self.policy is not None:
                image = np.asarray(self.policy(Image.fromarray(image)))
            return image, label

        def collate(items):
            images = torch.from_numpy(np.stack([image for image, _ in items])).permute(0, 3, 1, 2)
            return images, torch.tensor([label for _, label in items])

        pipeline = (
            PipelineBuilder()
            .add_source(self._samples())
            .pipe(decode, concurrency=self.workers)
            .aggregate(self.batch, drop_last=True)
            .pipe(collate)
            .add_sink(3)
            .build(num_threads=self.workers)
        )
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()
