"""predict.py's options, typed and checked once from the command line (as the loader's
LoaderConfig and the trainer's config are): every step of a job reads this, never the parser's
namespace."""

from __future__ import annotations

from dataclasses import dataclass

from wdsdist.errors import UserError

FORMATS = ("table", "csv", "jsonl")
DECODES = ("cpu", "gpu", "auto")


@dataclass(frozen=True)
class PredictOptions:
    """What to score, with which model, where the results go; a bad value is one line naming its
    option."""

    model: str  # a run directory, a folder with model.safetensors + config.json, or a checkpoint
    inputs: tuple[str, ...] = ()  # image files, folders, or shard specs
    top_k: int = 5
    format: str = "table"  # table, csv or jsonl
    batch_size: int = 64
    device: str = "auto"  # auto (a GPU where there is one), cpu, cuda, cuda:1, ...
    export: str | None = None  # onnx: write the model instead of predicting
    out: str | None = None  # the ONNX file, or the predictions' file (None: stdout)
    # a whole data set (--out-dir), on every rank of a torchrun job
    out_dir: str | None = None
    workers: int | str = "auto"  # loader workers per rank: a number, or auto
    decode: str = "cpu"  # where JPEGs are decoded: cpu, gpu or auto
    features: bool = False  # also each sample's penultimate features (.npy)
    part_size: int = 1000  # folders: images per part
    strict: bool = False  # a missing or truncated shard stops the job
    write_shards: str | None = None  # each input shard again here, with its predictions
    cache_dir: str | None = None  # a node cache for remote shards

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if self.top_k < 1:
            raise UserError(f"--top-k={self.top_k}: must be >= 1")
        if self.batch_size < 1:
            raise UserError(f"--batch-size={self.batch_size}: must be >= 1")
        if self.part_size < 1:
            raise UserError(f"--part-size={self.part_size}: must be >= 1")
        if self.format not in FORMATS:
            raise UserError(f"--format={self.format}: one of {', '.join(FORMATS)}")
        if self.decode not in DECODES:
            raise UserError(f"--decode={self.decode}: one of {', '.join(DECODES)}")
        if self.export not in (None, "onnx"):
            raise UserError(f"--export={self.export}: onnx is the one format")
        workers = self.workers
        if isinstance(workers, str) and workers != "auto":
            if not workers.isdigit():
                raise UserError(f"--workers={workers}: a number >= 0, or auto")
            object.__setattr__(self, "workers", int(workers))

    @property
    def whole_data_set(self) -> bool:
        """--out-dir without --export: a job over a data set (job.py), not a table of a few files."""
        return self.out_dir is not None and not self.export
