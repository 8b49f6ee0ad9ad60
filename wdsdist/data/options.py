"""The loader's typed config: everything that shapes one rank's loader, as plain values."""

from __future__ import annotations

from dataclasses import dataclass

from wdsdist.data import httpopen, shardspec
from wdsdist.errors import UserError

MODES = ("repeat", "epoch", "resampled")


@dataclass
class LoaderConfig:
    """Everything that shapes one rank's loader. Plain values only: it travels to workers."""

    batch_size: int
    workers: int = 2
    mode: str = "repeat"  # repeat (epochless) | epoch | resampled
    train: bool = True  # train: RandomResizedCrop + flip; eval: resize + center crop
    image_size: int = 224
    crop_scale: tuple[float, float] = (0.08, 1.0)
    image_key: str = "jpg;jpeg;png"
    label_key: str = "cls"
    seed: int = 0
    shuffle_buffer: int = 1000  # raw samples, inside each worker; 0: off
    cross_shuffle: int = 0  # samples, across workers in the rank's loader; 0: no re-batching
    partial: bool = False
    nbatches: int | str | None = None  # epoch mode: cut every rank to N, or "auto"
    dsrepeat: int = 1
    prefetch: int = 2
    pin_memory: bool = False
    reuse_buffers: bool = True  # workers stack batches into shared buffers they reuse (sharedbatches)
    decode_region: bool = True  # train: decode only the crop's region of a JPEG (jpegcrop)
    decode_downscale: bool = True  # ... at 1/2, 1/4 or 1/8 of its size where the crop is that much larger
    with_keys: bool = False  # carry sample keys in batches (simdist's coverage check)
    trace: bool = False  # print every shard open and close (simdist --showopen)
    strict: bool = False  # a bad shard or sample is an error (default: skipped, warned and counted)
    allow_pipe: bool = False  # accept pipe: URLs (they run a shell command)
    trust_index: bool = False  # an index may name shards outside its own place (shardspec.Access)
    max_pixels: int = 89_478_485  # larger images (width x height x frames) are corrupt (decompression bombs)
    max_member_bytes: int = 64 << 20  # larger tar members are corrupt samples, skipped unread
    num_classes: int | None = None  # labels outside [0, num_classes) are corrupt samples; None: unchecked
    http_timeout: float = 60.0  # seconds without data before an http(s) shard counts as failed
    http_min_rate: int = httpopen.DEFAULT_MIN_RATE  # bytes/s per http_timeout of waiting (httpopen); 0: off

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"loader.mode={self.mode!r}: must be one of {', '.join(MODES)}")
        for name in ("batch_size", "dsrepeat", "image_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("workers", "shuffle_buffer", "cross_shuffle"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.nbatches is not None and self.nbatches != "auto":
            try:
                self.nbatches = int(self.nbatches)
            except ValueError:
                raise UserError(f"nbatches={self.nbatches!r}: must be an integer or auto") from None
            if self.nbatches < 1:
                raise UserError(f"nbatches={self.nbatches}: must be >= 1 or auto")

    @property
    def access(self) -> shardspec.Access:
        return shardspec.Access(self.allow_pipe, self.trust_index, self.http_timeout, self.http_min_rate)

    @property
    def rebatch(self) -> bool:
        return self.cross_shuffle > 0

    @property
    def wanted_suffixes(self) -> frozenset[str]:
        """The members a sample is read for; others are skipped unread."""
        return frozenset(k.lower() for k in f"{self.image_key};{self.label_key}".split(";") if k)
