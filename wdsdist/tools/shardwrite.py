"""One shard of a plan, written whole: its images read from the source (a file, a byte range of a
tar, rows of Parquet), each checked, the shard written under a temporary name, synced, renamed,
and its record made (count, bytes, hash, offsets, skipped files). A worker process runs
this for the shards it is given; nothing here depends on which process, or how many, run it.

A file that is not an image the loader reads (text, empty, a FIFO, truncated, a decoder error, too
large) is skipped with its reason, unless ``strict``. Images are stored as they are: a CMYK JPEG
and a PNG named .JPEG go in unchanged (the PNG under .png), and the loader decodes both to PIL's
RGB; --resize/--quality re-encode every image as JPEG."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass

from PIL import Image

from wdsdist.data.sources.index import create_new
from wdsdist.errors import UserError
from wdsdist.tools import planning
from wdsdist.tools.listing import NO_LABEL
from wdsdist.tools.parquetsrc import RowReader

MAX_PIXELS = 89_478_485  # the loader's max_pixels default: a larger image would be refused there
FORMATS = ("JPEG", "PNG")  # what the loader's image keys (jpg;jpeg;png) hold


@dataclass(frozen=True)
class Job:
    """What a worker needs to write any shard of the plan (picklable)."""

    plan: dict
    digest: str  # the plan's (planning.digest), in every record
    outdir: str  # where the shards are written (for a bucket: a local folder they wait in)
    strict: bool = False
    image_column: str = "image"


class _TarOut:
    """A shard as webdataset's TarWriter writes one (members KEY.EXT in sorted order, mode 0444,
    owner bigdata), with a fixed mtime, and each sample's offset noted as it is written (what
    the index's offset table needs, without reading the shard back). PAX where a name is too long
    for a plain tar header, so no member name stops a shard."""

    def __init__(self, f, mtime: int):
        self.f, self.mtime, self.offsets = f, mtime, []
        self.tar = tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT)

    def write(self, key: str, members: dict[str, bytes]) -> None:
        self.offsets.append(self.f.tell())
        for ext in sorted(members):
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(members[ext]), self.mtime, 0o444
            info.uname = info.gname = "bigdata"
            self.tar.addfile(info, io.BytesIO(members[ext]))

    def close(self) -> None:
        self.tar.close()


def shard_name(prefix: str, i: int) -> str:
    return f"{prefix}-{i:06d}.tar"


def record_name(prefix: str, i: int) -> str:
    """A finished shard's record, in a hidden folder beside it (removed once the index is written)."""
    return f".{prefix}.work/{i:06d}.json"


def sample_key(name: str) -> str:
    """A key that stays a relative path inside the shard whatever the member name says
    ('../../x.jpg' gives 'x'), with no dot (WebDataset splits a sample's files at the first one)."""
    stem = os.path.splitext(name.replace("\\", "/"))[0]
    parts = [p for p in stem.split("/") if p not in ("", ".", "..")]
    return "/".join(parts).replace(".", "_") or "_"


class _Reader:
    """The bytes of a plan's items: (data, None) or (None, why not)."""

    def __init__(self, job: Job):
        src, self.limit = job.plan["source"], job.plan["options"]["max_member"]
        self.kind, self.root = src["kind"], src["path"]
        self.fd = os.open(self.root, os.O_RDONLY) if self.kind == "tar" else None
        self.rows = RowReader(self.root, job.image_column) if self.kind == "parquet" else None
        self.cache: dict[int, bytes] = {}

    def prefetch(self, items: list[list]) -> None:
        if self.rows is not None:
            self.cache = self.rows.read([it[3] for it in items if it[2] <= self.limit])

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def read(self, item: list) -> tuple[bytes | None, str | None]:
        name, _, size, offset = item
        if size > self.limit:
            return None, f"{size} bytes, more than the limit of {self.limit} (--max-member)"
        if self.kind == "tar":
            data = os.pread(self.fd, size, offset)
            return (data, None) if len(data) == size else (None, "the tar ends inside it")
        if self.kind == "parquet":
            return self.cache.pop(offset, b""), None
        return _read_file(os.path.join(self.root, name), self.limit)


def _read_file(path: str, limit: int) -> tuple[bytes | None, str | None]:
    try:
        # Non-blocking: a FIFO named like an image must not hang the run.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None, "not a regular file"
            data = f.read(limit + 1)
    except OSError as exc:
        return None, f"cannot read it: {exc.strerror or exc}"
    if len(data) > limit:
        return None, f"more than the limit of {limit} bytes (--max-member)"
    return data, None


def check_image(data: bytes, name: str, options: dict) -> tuple[bytes | None, str, str | None]:
    """(bytes to store, extension, None) for an image the loader reads, else (None, "", why not).
    verify "full" decodes every pixel; "header" reads the header only, and so misses a truncated
    file or damaged image data (the loader then skips that sample in training)."""
    if not data:
        return None, "", "empty file"
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            fmt, (width, height) = im.format, im.size
            if width * height > MAX_PIXELS:
                return None, "", f"{width}x{height} pixels, more than the loader's max_pixels={MAX_PIXELS}"
            if options["resize"] or options["quality"]:
                return _reencode(im, options["resize"], options["quality"]), "jpg", None
            if options["verify"] == "full":
                if fmt == "JPEG":
                    # At 1/8 scale: every coefficient is still entropy-decoded (truncation and
                    # damaged data fail alike), the inverse DCT, which cannot fail, runs on 1/64 of it.
                    im.draft(im.mode, (max(1, width // 8), max(1, height // 8)))
                im.load()
    except Image.UnidentifiedImageError:
        return None, "", "not a JPEG or PNG image"
    except Exception as exc:  # noqa: BLE001 (untrusted bytes: whatever PIL raises, the file is skipped)
        return None, "", f"cannot decode it: {exc.__class__.__name__}: {exc}"
    ext = os.path.splitext(name)[1].lstrip(".").lower()
    if fmt == "PNG":
        return data, "png", None
    return data, ext if ext in ("jpg", "jpeg") else "jpg", None


def _reencode(im: Image.Image, resize: int | None, quality: int | None) -> bytes:
    """The image as RGB JPEG at ``quality`` (95 if unset), its shorter side made ``resize`` pixels
    where it is longer (the aspect ratio kept; never enlarged), as FFCV's and img2dataset's writers do."""
    rgb = im.convert("RGB")
    if resize and min(rgb.size) > resize:
        w, h = rgb.size
        scale = resize / min(w, h)
        rgb = rgb.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=quality or 95)
    return out.getvalue()


def write_shard(job: Job, shard: int, progress=None) -> dict:
    """Write shard ``shard`` of the plan whole (in ``job.outdir``); return its record. ``progress(n, nbytes)``
    is called per image read."""
    plan, options = job.plan, job.plan["options"]
    start, end = planning.shard_range(plan, shard)
    items = plan["items"][start:end]
    final = os.path.join(job.outdir, shard_name(options["prefix"], shard))
    tmp = f"{os.path.join(job.outdir, '.' + os.path.basename(final))}.tmp{os.getpid()}"
    _remove_temporaries(job.outdir, os.path.basename(final))
    reader = _Reader(job)
    skipped = []
    try:
        reader.prefetch(items)
        with create_new(tmp) as f:
            # A fixed mtime (the source's): every run, and every worker, writes the same bytes.
            out = _TarOut(f, plan["mtime"])
            for item in items:
                sample, why = _sample(reader, item, plan)
                if progress is not None:
                    progress(1, item[2])
                if why is not None:
                    if job.strict:
                        raise UserError(f"--strict: {_where(plan, item[0])}: {why}")
                    skipped.append([item[0], why])
                    continue
                out.write(*sample)
            out.close()
            f.flush()
            os.fsync(f.fileno())
        record = _finish(tmp, final, shard, out.offsets, skipped, job.digest)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    finally:
        reader.close()
    return record


def _where(plan: dict, name: str) -> str:
    """An item as the user finds it: the file's path, or TAR:MEMBER."""
    kind, root = plan["source"]["kind"], plan["source"]["path"]
    return os.path.join(root, name) if kind == "folder" else f"{root}:{name}"


def _remove_temporaries(folder: str, name: str) -> None:
    """What a killed writer of this shard left (only one process at a time writes a given shard)."""
    with os.scandir(folder) as it:
        stale = [e.path for e in it if e.name.startswith(f".{name}.tmp") and e.is_file(follow_symlinks=False)]
    for path in stale:
        os.remove(path)


def _sample(reader: _Reader, item: list, plan: dict) -> tuple[tuple[str, dict] | None, str | None]:
    name, label = item[0], item[1]
    if label == NO_LABEL:
        return None, "not named in --labels"
    data, why = reader.read(item)
    if why is not None:
        return None, why
    data, ext, why = check_image(data, name, plan["options"])
    if why is not None:
        return None, why
    cls = plan["classes"][label]
    members = {ext: data, "cls": str(label).encode(), "json": planning.sample_meta(name, cls)}
    return (sample_key(name), members), None


def _finish(tmp: str, final: str, shard: int, offsets: list[int], skipped: list, plan_digest: str) -> dict:
    digest = hashlib.sha256()
    with open(tmp, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    size = os.path.getsize(tmp)
    os.replace(tmp, final)
    return {
        "shard": shard,
        "plan": plan_digest,
        "nsamples": len(offsets),
        "bytes": size,
        "sha256": digest.hexdigest(),
        "offsets": offsets,
        "skipped": skipped,
    }
