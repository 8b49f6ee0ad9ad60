"""The trainer's typed config: dataclasses in Hydra's ConfigStore behind the YAML in ``conf/``.

``conf/train.yaml`` lists this schema first, so every group file (``conf/data/*.yaml``,
``conf/model/*.yaml``, ``conf/optim/*.yaml``) and every command-line override is checked
against it: a misspelt key or a value of the wrong type fails before anything starts, and
``run_hydra`` turns that failure into one ``error:`` line and exit code 2.
"""
# A long module: the schema and the one-line translation of Hydra's errors stay together,
# since each message names the schema's keys; split apart, a key's rule and its message would drift.

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from wdsdist.data import LoaderMode, SampleOptions, StreamOptions, option_problems
from wdsdist.errors import DataError, JobError, UserError, console_logging, die
from wdsdist.model.build import Stem
from wdsdist.train import recipe
from wdsdist.train.argv import SHARD_KEYS, shard_argv


class OptimName(Enum):
    sgd = "sgd"
    adamw = "adamw"


class Device(Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


@dataclass
class SyntheticConfig:
    """Write the built-in synthetic shards at data.train_shards / data.val_shards if missing."""

    train_samples: int = 10000
    val_samples: int = 2000
    size: int = 64  # pixels of the drawn images
    shard_samples: int = 500
    seed: int = 0


@dataclass
class SourceConfig:
    """One data set of several (data.sources, data.val_sources): the loader's ``Source``. At most
    one of weight, repeat, samples (none: repeat=1); the loader checks them and names the source.
    In data.val_sources only name and shards count: each is evaluated whole."""

    name: str = MISSING
    shards: str = MISSING  # a shard spec, as data.train_shards
    weight: float | None = None  # a share of data.epoch_samples, beside the other weights
    repeat: float | None = None  # passes per epoch: 0.5 reads half of it (the other half next epoch), 3 thrice
    samples: int | None = None  # samples per epoch


@dataclass
class DataConfig(SampleOptions):
    """The loader's SampleOptions (their fields and defaults live there), plus the data set."""

    name: str = "custom"
    # brace pattern, glob, URLs or index JSON (see docs/data.md: Shard specs); null with data.sources
    train_shards: str | None = MISSING
    # MISSING, not None: a group's `???` merged onto a default of None would leave None, and a preset
    # that needs held-out shards would silently run without evaluation. null: no evaluation.
    val_shards: str | None = MISSING
    # The model's outputs; the loader checks labels against it. null: the training index's class count
    # (makeshards.py writes the names into it); a number that disagrees with the index stops the run.
    num_classes: int | None = None
    # Label i's name; null: the training index's (else "0", "1", ...). Kept in classes.json, every
    # checkpoint and the exported config.json.
    classes: list[str] | None = None
    # Pixels, or progressive resizing: [[from, size], ...], each size from a fraction of training on
    # (trainer.steps; trainer.epochs in epoch mode, switching at an epoch's start), e.g. [[0, 160], [0.87, 192]]
    image_size: Any = 224
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    synthetic: SyntheticConfig | None = None
    # Several data sets in one epoch, instead of train_shards (docs/several-datasets.md); with weights,
    # data.epoch_samples is the mixed epoch's size and loader.mix how a batch mixes them
    sources: list[SourceConfig] | None = None
    val_sources: list[SourceConfig] | None = None  # each evaluated on its own (beside val_shards, if given)


@dataclass
class ModelConfig:
    name: str = "resnet18"  # any torchvision classification model, or timm/NAME (the [timm] extra)
    stem: Stem = Stem.auto
    # A pretrained start: DEFAULT or a torchvision weights name, or a .safetensors/.pt file or run
    # directory (wdsdist/model/weights.py); its mean, std and image size apply unless given too.
    weights: str | None = None
    freeze_steps: int = 0  # with weights: only the new head trains for this many steps


@dataclass
class OptimConfig:
    name: OptimName = OptimName.sgd
    lr: float = 0.1  # for a global batch of 256; the run uses lr * global_batch / 256
    momentum: float = 0.9  # sgd
    nesterov: bool = True  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    weight_decay: float = 5e-5
    warmup: float = 0.05  # fraction of trainer.steps with a linear ramp, then cosine to 0
    label_smoothing: float = 0.0
    clip_grad_norm: float | None = None  # clip the gradients' total norm to this; null: no clipping
    norm_weight_decay: float | None = None  # weight decay of normalisation layers; null: weight_decay
    bias_weight_decay: float | None = None  # weight decay of biases; null: weight_decay


@dataclass
class EmaConfig:
    """An exponential moving average of the weights (wdsdist/train/ema.py)."""

    decay: float = 0.0  # per update; 0: no EMA
    every: int = 1  # steps between updates
    warmup: bool = True  # the decay grows as min(decay, (1 + n) / (10 + n)) over the first updates (timm's)


@dataclass
class TrainerConfig:
    steps: int = 1000
    epochs: int | None = None  # loader.mode=epoch only: steps = epochs x batches per epoch
    batch_size: int = 64  # per rank
    # DataLoader workers per rank; auto: sized to the cores this process may use and the ranks on
    # its node (wdsdist/data/cores.py), said in the start-up line
    workers: int | str = "auto"
    eval_every: int = 0  # steps; 0: only at the end
    ckpt_every: int = 0  # steps; 0: only at the end
    keep: int = 3  # checkpoints kept besides latest.pt
    resume: str | None = None  # auto (latest in the run directory), a checkpoint file, or a run directory
    log_every: int = 20  # steps between log lines and TensorBoard scalars
    timeout_s: float = 1800.0  # no rank makes progress for this long: the job fails naming the stalled rank
    device: Device = Device.auto
    amp: bool = True  # bf16 autocast on a GPU with bf16 units
    amp_cpu: bool = False  # bf16 autocast on the CPU too (for studies: the CPU default stays float32)
    channels_last: bool = True  # CUDA only
    accum_steps: int = 1  # micro-batches per optimizer step: a global batch of world x batch_size x accum_steps
    mixup: float = 0.0  # mixup's alpha; 0: off (with cutmix too: one of the two per batch)
    cutmix: float = 0.0  # cutmix's alpha; 0: off
    ema: EmaConfig = field(default_factory=EmaConfig)
    compile: Any = False  # torch.compile: false, true or auto (where it was measured to pay off)
    sync_bn: bool = False  # batch norm statistics over all ranks (SyncBatchNorm; CUDA only)


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loader: StreamOptions = field(default_factory=StreamOptions)  # its fields: wdsdist/data/options.py
    seed: int = 0
    outputs: str = "outputs"  # run directories go here
    run_dir: str | None = None  # default: OUTPUTS/RUN_ID under torchrun with --rdzv_id, else OUTPUTS/TIMESTAMP


def given_keys() -> set[str]:
    """The config keys typed on the command line (Hydra's overrides), where Hydra runs this job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    return {_override_key(o) for o in HydraConfig.get().overrides.task}


def register() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


# ---------------------------------------------------------------- checks Hydra cannot express


def check(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """Range checks that types cannot say; each error names its key. ``overrides``: the command
    line's (Hydra's overrides.task), for the rules about what the user typed."""

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            value = OmegaConf.select(cfg, key)
            raise UserError(f"{key}={value}: {rule}")

    check_sources(cfg)
    check_missing(cfg)
    check_own_shards(cfg, overrides)

    t, d, o, ld = cfg.trainer, cfg.data, cfg.optim, cfg.loader
    # The loader's own rules (data/options.py), named in config terms: batch_size and workers
    # are trainer keys here.
    problem = next(option_problems(batch=t, sample=recipe.Sized(d, recipe.largest(cfg)), stream=ld), None)
    if problem is not None:
        raise UserError(problem)
    recipe.check(cfg)
    for key in ("trainer.steps", "trainer.log_every", "trainer.keep"):
        need(OmegaConf.select(cfg, key) >= 1, key, "must be >= 1")
    for key in ("trainer.eval_every", "trainer.ckpt_every"):
        need(OmegaConf.select(cfg, key) >= 0, key, "must be >= 0")
    need(t.timeout_s > 0, "trainer.timeout_s", "must be > 0 (seconds)")
    need(t.epochs is None or t.epochs >= 1, "trainer.epochs", "must be >= 1")
    need(cfg.model.freeze_steps >= 0, "model.freeze_steps", "must be >= 0")
    need(
        not cfg.model.freeze_steps or bool(cfg.model.weights),
        "model.freeze_steps",
        "needs model.weights (a pretrained start)",
    )
    need(t.epochs is None or ld.mode == LoaderMode.epoch, "trainer.epochs", "needs loader.mode=epoch")
    need(len(d.mean) == 3 and len(d.std) == 3 and min(d.std) > 0, "data.mean", "mean and std need 3 values, std > 0")
    need(o.lr > 0, "optim.lr", "must be > 0")
    need(0 <= o.warmup < 1, "optim.warmup", "a fraction of trainer.steps in [0, 1)")
    need(len(o.betas) == 2, "optim.betas", "two values")
    need(0 <= o.label_smoothing < 1, "optim.label_smoothing", "must be in [0, 1)")
    need(t.resume in (None, "auto") or os.path.exists(t.resume), "trainer.resume", "no such file or directory")
    s = d.synthetic
    if s is not None:
        for key in ("train_samples", "val_samples", "shard_samples"):
            need(s[key] >= 1, f"data.synthetic.{key}", "must be >= 1")
        need(s.size >= 8, "data.synthetic.size", "must be >= 8")


def check_sources(cfg: DictConfig) -> None:
    """data.sources stands in for data.train_shards (and data.val_sources may for data.val_shards):
    a key the data group leaves to the user (``???``) becomes null beside them, and train_shards
    given as well is refused, since which of the two trains would be a guess."""
    d = cfg.data
    if d.sources is not None:
        if OmegaConf.is_missing(d, "train_shards"):
            d.train_shards = None
        elif d.train_shards is not None:
            hint = " (the data group sets it: add data.train_shards=null)" if d.synthetic is not None else ""
            raise UserError(
                f"data.train_shards={d.train_shards} and data.sources are both given: train on one of them{hint}"
            )
        if not d.sources:
            raise UserError("data.sources is empty: give at least one source, or data.sources=null")
    elif not OmegaConf.is_missing(d, "train_shards") and d.train_shards is None:
        raise UserError("data.train_shards=None: give a shard spec, or data.sources (several data sets)")
    if d.val_sources is not None and OmegaConf.is_missing(d, "val_shards"):
        d.val_shards = None
    # data.sources' names are the loader's to check; these name TensorBoard's tags, one per source
    names = [s.name for s in d.val_sources or ()]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise UserError(f"data.val_sources: two sources are named {twice!r}")


def check_missing(cfg: DictConfig) -> None:
    """Every value a group leaves to the user (``???``) named in one line, so data=shards asks
    for its shards and its classes at once, not one run at a time."""
    first = {key: i for i, key in enumerate((*SHARD_KEYS, "data.num_classes"))}
    missing = sorted(OmegaConf.missing_keys(cfg), key=lambda k: (first.get(k, len(first)), k))
    if not missing:
        return
    example = " ".join(f"{key}=..." for key in missing)
    null = " (data.val_shards=null: no evaluation)" if "data.val_shards" in missing else ""
    if len(missing) == 1:
        raise UserError(f"{missing[0]}: missing value; give it on the command line, e.g. {example}{null}")
    raise UserError(f"{', '.join(missing)}: missing values; give them on the command line, e.g. {example}{null}")


def _override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def check_own_shards(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Shards named on the command line with the default data group: the synthetic group would
    write its generated images at that path, or refuse shards of one's own, and its 10 classes
    at 32 pixels are not the user's. Point to data=shards instead of guessing num_classes."""
    keys = [_override_key(o) for o in overrides]
    if cfg.data.synthetic is None or "data" in keys:
        return
    for key in SHARD_KEYS:
        value = OmegaConf.select(cfg, key)
        if key in keys and value is not None:
            d = cfg.data
            raise UserError(
                f"{key}={value}: the default data=synthetic is its generated set ({d.num_classes} classes at "
                f"{d.image_size} pixels, written there if missing); for shards of your own add data=shards "
                f"data.num_classes=N (data=synthetic: write the synthetic set there)"
            )


# ---------------------------------------------------------------- errors as one line


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _did_you_mean(key: str, parent: str, cfg_class: type | None) -> str:
    names: list[str] = []
    if cfg_class is not None and hasattr(cfg_class, "__dataclass_fields__"):
        names = list(cfg_class.__dataclass_fields__)
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return f"; did you mean {parent + '.' if parent else ''}{close[0]}?"
    if names:
        return f" (keys: {', '.join(names)})"
    return ""


def _hydra_line(e: BaseException) -> str | None:
    """The line for a Hydra failure, from the attributes Hydra 1.3 gives its exceptions
    (OverrideParseException.override, MissingConfigException.missing_cfg_file and .options);
    a Hydra without them gets the exception's first line instead (None here)."""
    override = getattr(e, "override", None)
    if isinstance(e, OverrideParseException) and isinstance(override, str):
        hint = ""
        if any(c in override for c in "{}[],"):
            key, _, value = override.partition("=")
            hint = f"; quote a value with braces or commas: '{key}=\"{value}\"'"
        return f"cannot parse {override!r}: {_first_line(getattr(e, 'message', '') or str(e))}{hint}"
    missing = getattr(e, "missing_cfg_file", None)
    if isinstance(e, MissingConfigException) and isinstance(missing, str) and missing:
        group, name = os.path.dirname(missing), os.path.basename(missing)
        options = getattr(e, "options", None)
        available = f" (available: {', '.join(options)})" if options else ""
        return f"{group}={name}: no such option{available}" if group else _first_line(str(e))
    return None


def _omegaconf_line(e: OmegaConfBaseException) -> str | None:
    """The line for an OmegaConf failure that names its key (OmegaConf's documented full_key)."""
    key = getattr(e, "full_key", None)
    if not key:
        return None
    if isinstance(e, MissingMandatoryValue):
        return f"{key}: missing value; give it on the command line, e.g. {key}=..."
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
        parent, _, leaf = key.rpartition(".")
        return f"{key}: no such config key{_did_you_mean(leaf, parent, getattr(e, 'object_type', None))}"
    return f"{key}: {_first_line(getattr(e, 'msg', '') or str(e))}"  # a wrong type or value


def one_line(exc: BaseException) -> str:
    """A Hydra or OmegaConf failure as one line that names the key."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        line = _hydra_line(e)
        if line:
            return line
    for e in chain:
        if isinstance(e, OmegaConfBaseException):
            line = _omegaconf_line(e)
            if line:
                return line
    return _first_line(str(exc)) or exc.__class__.__name__


_full_traces = [False]  # the user asked for Hydra's full traces (HYDRA_FULL_ERROR=1)


def run_hydra(main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function; a config error becomes one line and exit 2.

    HYDRA_FULL_ERROR=1 in the caller's environment keeps Hydra's full traces for debugging.
    Under torchrun a config error is the same in every process of a node, so only local rank 0
    prints it.
    """
    debug = _full_traces[0] = os.environ.get("HYDRA_FULL_ERROR") == "1"
    console_logging()  # the loader's messages, one line each, as the trainer prints its own
    try:
        sys.argv[1:] = shard_argv(sys.argv[1:])
    except UserError as exc:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            raise SystemExit(2) from None
        die(str(exc))
    # Hydra's documented debugging switch: with it Hydra re-raises instead of printing its own
    # multi-line report, and the failure becomes one line here.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as exc:
        if debug:
            raise
        if os.environ.get("LOCAL_RANK", "0") != "0":
            raise SystemExit(2) from None
        die(one_line(exc))
    except KeyboardInterrupt:
        die("interrupted", 130)


def run_job(fn: Callable[..., Any], *args: Any, same_on_every_rank: bool = False) -> Any:
    """Inside the Hydra job: a UserError (or a bad shard in strict mode) becomes one line and exit 2
    here, since Hydra would print its own report for an exception leaving the job.

    ``same_on_every_rank``: ``fn`` fails alike in every process (a check of the config alone), so
    under torchrun only local rank 0 prints the error.
    """
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    tag = f"rank {rank}: " if world != "1" and rank != "0" else ""
    if same_on_every_rank:
        tag = ""
        if os.environ.get("LOCAL_RANK", "0") != "0":
            try:
                return fn(*args)
            except (UserError, OmegaConfBaseException):
                raise SystemExit(2) from None
    try:
        return fn(*args)
    except UserError as exc:
        die(f"{tag}{exc}")
    except JobError as exc:
        die(f"{tag}{exc}", 1)
    except OmegaConfBaseException as exc:  # e.g. a mandatory value (???) left missing
        if _full_traces[0]:
            raise
        die(f"{tag}{one_line(exc)}")
    except DataError as exc:
        # From a DataLoader worker the message carries the worker's traceback: keep its last line.
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        die(f"{tag}{last.split('DataError: ', 1)[-1]}")
