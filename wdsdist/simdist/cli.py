"""wds-simdist (simdist.py in a clone; python -m wdsdist.simdist): simulate size ranks x nworkers
DataLoader workers: does every rank get the same number of batches?

Real mode (default) runs the training loader for each simulated rank over real shards; --plan
gives the same report from sample counts alone. Exit status: 0 SUCCESS, 1 FAILED, 2 bad input.

  wds-simdist                                  # 10 shards x 100 samples, 3 ranks x 3 workers: FAILED
  wds-simdist --nbatches 30                    # cut every rank to 30 batches: SUCCESS
  wds-simdist --nbatches 40 --dsrepeat 2       # more batches than short ranks hold: repeat inside workers
  wds-simdist --nbatches auto --showsplits --plot outputs/simdist.png
  wds-simdist --split samples                  # equal spans of samples: SUCCESS, 20 samples padded (--remainder drop)
  wds-simdist --plan --split samples --resize-at 13 --to-size 2 --to-nworkers 1   # an elastic resume mid-epoch
  wds-simdist --shards data/shards/imagenet-train.index.json --size 16 --nworkers 8 --batch-size 256
  wds-simdist --plan --nshards 100000 --samples-per-shard 1000+-50 --size 1024 --nworkers 8 --batch-size 64
  wds-simdist --plan --split samples --nshards 1281 --size 256 --node-ranks 8 --nepochs 3 \
      --shard-bytes 100MB --cache-size 200GB --shard-order node   # what the store sends each node, per epoch
  wds-simdist --plan --mix imagenet:1281167/1281 photos:128000/128:weight=0.2 --epoch-samples 1500000 \
      --size 256 --nworkers 8 --batch-size 256 --nepochs 3      # several data sets: per source and rank
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from dataclasses import dataclass

from wdsdist import simdist
from wdsdist.data.options import parse_bytes, parse_nbatches
from wdsdist.errors import CliParser, UserError, integer, run_cli


def nbatches(text: str) -> int | str | None:
    try:
        return parse_nbatches(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # The argument groups are --help's sections, in the order they are added here; each group is
    # declared by one function (no function over 60 lines), so a group's options stay together.
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _data_options(p)
    _job_options(p)
    _store_resize_show_options(p)
    return p.parse_args(argv)


def _data_options(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("the data (default: 10 synthetic shards of 100 samples, written once to --cache)")
    data.add_argument("--shards", metavar="SPEC", help="brace pattern, glob, URLs (joined by ::) or an index JSON")
    data.add_argument("--nshards", type=integer(1), help="describe a layout: this many shards (default: 10)")
    data.add_argument(
        "--samples-per-shard", metavar="N[+-D]", help="samples per shard, or N+-D drawn uniformly (default: 100)"
    )
    data.add_argument(
        "--mix",
        nargs="+",
        type=simdist.mix_argument,
        metavar="NAME:DATA[:SETTING]",
        help="several data sets in one epoch (the loader's Source list): DATA is SAMPLES[/SHARDS] or a shard "
        "spec, SETTING repeat=R, weight=W or samples=N (none: repeat=1); e.g. photos:128000/128:weight=0.2",
    )
    data.add_argument(
        "--epoch-samples", type=integer(1), metavar="N", help="--mix: the mixed epoch's size, which weights share"
    )
    data.add_argument(
        "--mix-batches",
        choices=("sample", "stratified"),
        default="sample",
        help="--mix: loader.mix, how a batch mixes the sources (default: %(default)s)",
    )
    data.add_argument("--seed", type=int, default=0, help="seed of the spread and of the loader's shuffles")
    data.add_argument("--cache", default="data/simdist", help="where real mode writes synthetic shards (%(default)s)")
    data.add_argument("--allow-pipe", action="store_true", help="open pipe: shards (they run a shell command)")
    data.add_argument(
        "--trust-index", action="store_true", help="let the index name absolute paths, '..', other servers"
    )


def _job_options(p: argparse.ArgumentParser) -> None:
    job = p.add_argument_group("the job")
    job.add_argument("--size", type=integer(1), default=3, help="ranks (world size) (default: %(default)s)")
    job.add_argument("--nworkers", type=integer(0), default=3, help="DataLoader workers per rank (default: 3)")
    job.add_argument("--batch-size", type=integer(1), default=10, help="(default: %(default)s)")
    job.add_argument("--nbatches", type=nbatches, metavar="N|auto", help="cut every rank to N batches per epoch")
    job.add_argument("--dsrepeat", type=integer(1), default=1, help="passes over the shards inside each worker")
    job.add_argument("--repeat", type=integer(1), default=1, help="loader passes per epoch (then the cut)")
    job.add_argument("--partial", action=argparse.BooleanOptionalAction, default=False, help="keep short batches")
    job.add_argument("--nepochs", type=integer(1), default=1, help="epochs to run (real mode) (default: 1)")
    job.add_argument("--cross-shuffle", type=integer(0), default=0, help="re-batch across workers (samples)")
    job.add_argument(
        "--split",
        choices=("shards", "samples"),
        help="whole shards per rank and worker, or equal spans of the epoch's samples (default: shards; "
        "samples with --mix)",
    )
    job.add_argument(
        "--remainder",
        choices=("pad", "drop"),
        default="pad",
        help="--split samples: pad or drop (default: %(default)s)",
    )
    job.add_argument(
        "--shard-order",
        choices=("global", "node"),
        default="global",
        help="--split samples: one order of all shards each epoch, or each node's own samples (default: %(default)s)",
    )
    job.add_argument("--node-ranks", type=integer(1), default=1, help="ranks per node, which share its cache (1)")


def _store_resize_show_options(p: argparse.ArgumentParser) -> None:
    store = p.add_argument_group("what the store sends each node per epoch (with --shard-bytes)")
    store.add_argument("--shard-bytes", type=size, metavar="B", help="bytes per shard: 100MB, 64MiB or a number")
    store.add_argument("--cache-size", type=size, metavar="B", help="a node cache of whole shards, LRU: 200GB, ...")
    resize = p.add_argument_group("an elastic resume (--split samples)")
    resize.add_argument(
        "--resize-at", type=integer(0), metavar="K", help="checkpoint after K batches per rank, resume on a new layout"
    )
    resize.add_argument("--to-size", type=integer(1), metavar="S2", help="the new layout's ranks (default: --size)")
    resize.add_argument(
        "--to-nworkers", type=integer(0), metavar="W2", help="the new layout's workers (default: --nworkers)"
    )
    show = p.add_argument_group("what to show")
    show.add_argument("--plan", action="store_true", help="plan from sample counts only; read no data")
    show.add_argument("--showsplits", action="store_true", help="which shards each rank and worker got")
    show.add_argument("--showopen", action="store_true", help="each shard open and close, as it happens (stderr)")
    show.add_argument("--plot", metavar="FILE.png", help="draw ranks x workers, shards and batches per rank")
    show.add_argument("--verbose", action="store_true", help="every rank, however many")


# The options that are Settings' fields of the same name: every job's, and one data set's only.
_JOB = ("size", "nworkers", "batch_size", "nepochs", "cross_shuffle", "seed", "remainder")
_ONE_DATA_SET = ("partial", "nbatches", "dsrepeat", "repeat", "shard_order", "node_ranks")


@dataclass(frozen=True, kw_only=True)
class SimdistOptions:
    """simdist's command line, typed and checked once (``parse``): what main and everything
    below it read. A combination that cannot run is refused here in one line naming its option,
    in the order simdist has always checked them (the settings' own checks among them)."""

    shards: str | None
    nshards: int | None
    samples_per_shard: str | None
    mix: tuple[simdist.MixArg, ...]  # empty: one data set
    epoch_samples: int | None
    mix_batches: str
    seed: int
    cache: str
    allow_pipe: bool
    trust_index: bool
    size: int
    nworkers: int
    batch_size: int
    nbatches: int | str | None
    dsrepeat: int
    repeat: int
    partial: bool
    nepochs: int
    cross_shuffle: int
    split: str | None  # None: shards, or samples with --mix
    remainder: str
    shard_order: str
    node_ranks: int
    shard_bytes: int | None
    cache_size: int | None
    resize_at: int | None
    to_size: int | None
    to_nworkers: int | None
    plan: bool
    showsplits: bool
    showopen: bool
    plot: str | None
    verbose: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "mix", tuple(self.mix or ()))  # frozen: argparse's list (or None), fixed once
        if self.mix:
            self._check_mix()
            return
        if self.epoch_samples is not None or self.mix_batches != "sample":
            raise UserError("--epoch-samples and --mix-batches describe several data sets: give --mix too")
        self.settings()  # its own checks, refused before the others as they always were
        if self.cache_size is not None and self.shard_bytes is None:
            raise UserError("--cache-size needs --shard-bytes (the bytes each shard costs to fetch)")
        if self.plot and not self.plot.lower().endswith(".png"):
            raise UserError(f"--plot {self.plot}: give a .png file name")
        if self.plot and importlib.util.find_spec("matplotlib") is None:
            raise UserError(f"--plot {self.plot} needs matplotlib: pip install 'wds-distributed[plot]'")
        # Two more stay in main and layout, after main's note on --showopen with --plan, so a refused
        # command says what it always said: --to-size without --resize-at, --shards with --nshards.

    def _check_mix(self) -> None:
        given = {
            "--shards": self.shards,
            "--nshards": self.nshards,
            "--samples-per-shard": self.samples_per_shard,
            "--nbatches": self.nbatches,
            "--dsrepeat": self.dsrepeat != 1,
            "--repeat": self.repeat != 1,
            "--partial": self.partial,
            "--resize-at": self.resize_at is not None,
            "--shard-bytes": self.shard_bytes is not None,
            "--showsplits": self.showsplits,
            "--plot": self.plot,
        }
        other = [name for name, value in given.items() if value]
        if other:
            raise UserError(f"--mix takes its data and epochs from its sources; it does not combine with {other[0]}")

    def settings(self) -> simdist.Settings:
        """The simulated job: the options of Settings' names (--mix: the sources' windows make the
        epoch, in equal spans of samples)."""
        job = {name: getattr(self, name) for name in _JOB}
        if self.mix:
            return simdist.Settings(**job, split="samples")
        cut = {name: getattr(self, name) for name in _ONE_DATA_SET}
        return simdist.Settings(**job, **cut, split=self.split or "shards")

    def access(self) -> simdist.Access:
        return simdist.Access(allow_pipe=self.allow_pipe, trust_index=self.trust_index)


def parse(argv: list[str] | None = None) -> SimdistOptions:
    """The command line as the typed, checked options: the one place its Namespace is read."""
    return SimdistOptions(**vars(parse_args(argv)))


def layout(options: SimdistOptions) -> simdist.Layout:
    if options.shards:
        if options.nshards or options.samples_per_shard:
            raise UserError("--shards and --nshards/--samples-per-shard describe the data twice: give one")
        return simdist.spec_layout(
            options.shards,
            count_local=True,
            count_remote=not options.plan,
            need_files=not options.plan,
            access=options.access(),
        )
    nshards = options.nshards or simdist.DEFAULT_NSHARDS
    samples = options.samples_per_shard or simdist.DEFAULT_SAMPLES
    described = simdist.described_layout(nshards, samples, options.seed)
    if options.plan:
        return described
    base, spread = simdist.parse_spread(samples)
    name = f"n{nshards}-s{base}" + (f"pm{spread}-seed{options.seed}" if spread else "")
    return simdist.synthetic_layout(described, options.cache, name)


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    if options.mix:
        return mix_main(options)
    settings = options.settings()
    if options.plan and options.showopen:
        print("note: --showopen shows shard opens in real mode only; --plan opens nothing", file=sys.stderr)
    if options.showopen:
        logging.getLogger("wdsdist").setLevel(logging.DEBUG)  # the loader's shard traces
    if options.resize_at is None and (options.to_size is not None or options.to_nworkers is not None):
        raise UserError("--to-size/--to-nworkers describe the layout after --resize-at K: give --resize-at too")
    sim = simdist.simulate_plan(layout(options), settings)
    resize = None
    if options.resize_at is not None:
        to_size = options.size if options.to_size is None else options.to_size
        to_nworkers = options.nworkers if options.to_nworkers is None else options.to_nworkers
        if options.plan:
            resize = simdist.simulate_resize(sim, options.resize_at, to_size, to_nworkers)
        else:  # the training loader itself, resumed as the trainer resumes it
            resize = simdist.simulate_resize_real(sim, options.resize_at, to_size, to_nworkers, access=options.access())
    real = None if options.plan else simdist.simulate_real(sim, showopen=options.showopen, access=options.access())
    egress = None
    if options.shard_bytes is not None:
        egress = simdist.simulate_egress(sim, options.shard_bytes, options.cache_size)
    return simdist.report(
        sim,
        real=real,
        showsplits=options.showsplits,
        verbose=options.verbose,
        plot_to=options.plot,
        resize=resize,
        egress=egress,
    )


def mix_main(options: SimdistOptions) -> int:
    """--mix: per epoch, source and rank, what the sources' windows give (simdist/mix.py)."""
    if options.split == "shards" or options.shard_order != "global":
        # The loader's own refusal, in its words (it imports torch: only when there is one to make).
        from wdsdist.data.delivery.mixing import mix_config
        from wdsdist.data.options import LoaderConfig

        mix_config(
            LoaderConfig(
                batch_size=options.batch_size, split=options.split or "samples", shard_order=options.shard_order
            )
        )
    settings = options.settings()
    layouts = simdist.mix_layouts(options.mix, plan=options.plan, cache=options.cache, access=options.access())
    mix = simdist.mix_of(options.mix, layouts, options.epoch_samples)
    epochs = [simdist.plan_mix_epoch(mix, settings, epoch) for epoch in range(settings.nepochs)]
    run = None
    if not options.plan:
        run = simdist.run_mix(
            options.mix,
            layouts,
            settings,
            epoch_samples=options.epoch_samples,
            mix_batches=options.mix_batches,
            image_size=simdist.IMAGE_SIZE,
            access=options.access(),
        )
    code, lines = simdist.mix_report(
        mix, layouts, settings, epochs, mix_batches=options.mix_batches, run=run, verbose=options.verbose
    )
    print("\n".join(lines))
    return code


def run() -> None:
    """The console script: main() with one-line errors (wdsdist.errors.run_cli)."""
    run_cli(main)


if __name__ == "__main__":
    run()
