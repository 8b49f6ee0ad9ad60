"""The randomized exactness test's driver (tests/data/test_exactness.py, ./run fuzz).

A case (tests/helpers/exactness_cases.py, which draws them) is a data set (or up to three,
mixed), loader options and a chain of up to three layouts (ranks given by hand, so no process
group is needed). The driver writes real tar shards whose
labels are sample ids, runs the real ``Loader`` with real worker processes on the first layout,
takes every rank's ``state_dict()`` at a drawn step, resumes on the next layout (the same one or
another), and so on; every rank's batches are held to the model (tests/helpers/model.py):
  - each batch comes from the worker the model says, holds the positions it says (as a set per
    worker and epoch where a shuffle buffer reorders them), and each label is the sample its
    tag names;
  - each row stands for the position its seq names in its worker's stream (``positions``):
    itself where that sample is good, a stand-in where it is lost (damaged, or its shard
    unreadable: the case draws some), a good sample chosen from the loss alone, the loss
    counted once per epoch, the damaged sample named;
  - on the same layout, a resumed run is batch for batch the uninterrupted one;
  - every epoch: each position once as itself, none missing (pad) or none twice (drop), the
    padding rows exactly the stated ones, each source's count as the sequence says; no lost
    position delivered as itself, the losses counted the lost positions read as themselves;
  - epoch mode: every rank the same batches, and ``len()`` counts the epoch from its start,
    whatever is lost.
The shards, the sequence and the batches as delivered are in tests/helpers/exactness_data.py,
the checks in tests/helpers/exactness_checks.py.
"""

from __future__ import annotations

import gc
import itertools
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import model as m
from tests.helpers.exactness_cases import Case
from tests.helpers.exactness_checks import check_coverage, check_losses, check_pixels, check_steps
from tests.helpers.exactness_data import Got, RankRun, Sequence, Shards, got, write_shards
from wdsdist.data import Loader, UserError
from wdsdist.data.plan.order import shard_order, shuffled_offsets

EPOCHS = 2  # epoch mode: every run reads epochs 0 and 1


# ---------------------------------------------------------------- running the real loader


def run_rank(loader: Loader, mode: str, stop: int | None, count: int | None) -> RankRun:
    """Epoch mode: every epoch through EPOCHS - 1; repeat mode: ``count`` batches. The state is
    taken after ``stop`` batches."""
    out = RankRun([], None, {})
    if stop == 0:
        out.state = loader.state_dict()

    def taken(batch: dict) -> None:
        out.steps.append(got(batch))
        if len(out.steps) == stop:
            out.state = loader.state_dict()

    if mode == "epoch":
        while loader.epoch < EPOCHS:
            epoch, length, done = loader.epoch, len(loader), loader.batches_done
            out.lens[epoch] = (length, done)
            before = len(out.steps)
            for batch in loader:
                taken(batch)
            assert len(out.steps) - before == length - done, "an epoch's batches are not what len() said"
    else:
        for batch in itertools.islice(iter(loader), count):
            taken(batch)
    return out


def make_loader(case: Case, shards: Shards, shape: m.Shape, rank: int) -> Loader:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        return Loader(shards.spec, case.config(shape.workers), rank=rank, world=shape.world)


# ---------------------------------------------------------------- the model's side


def refused(case: Case, seq: Sequence, shape: m.Shape) -> bool:
    """Whether the loader must refuse this layout at start: a worker without a batch of epoch 0
    (split=samples), or without a shard (split=shards)."""
    if case.split == "shards":
        n = len(case.data[0].counts)
        return min(len(range(n)[r :: shape.world]) for r in range(shape.world)) < shape.nworkers
    return seq.total(0) < shape.world * shape.nworkers * case.batch


def stands(case: Case, part: m.Part, since: list[list[Got]]) -> list[tuple[int, list[int]]]:
    """Each checkpointed rank's (stand, the newest epoch each worker delivered from) on its layout."""
    out = []
    for steps in since:
        if case.mode == "epoch":
            epoch = steps[-1].epoch if steps else part.start
            done = sum(g.epoch == epoch for g in steps)
            if steps and done == part.batches(epoch):
                out.append((epoch + 1, []))  # the epoch ended: nothing in flight
                continue
            out.append((epoch, [epoch] if any(g.epoch == epoch for g in steps) else []))
            continue
        opened: dict[int, int] = {}
        for g in steps:
            opened[g.worker] = max(opened.get(g.worker, g.epoch), g.epoch)
        out.append((m.stand(opened, part.shape.nworkers, part.start), list(opened.values())))
    return out


def repeat_count(full: list[list[m.Step]], through: int) -> int | None:
    """Repeat mode: the batches every rank takes so that each has delivered all of epochs through
    ``through``; None where the model's batches (a finite start of endless streams) do not reach
    that far on every rank."""
    counts = [0]
    for steps in full:
        later = {s.worker for s in steps if min(s.epochs or (s.epoch,)) > through}
        if len(later) < len({s.worker for s in steps}):
            return None  # a worker's batches end before it is past ``through``
        counts.append(1 + max((i for i, s in enumerate(steps) if min(s.epochs or (s.epoch,)) <= through), default=-1))
    count = max(counts)
    return count if all(len(steps) >= count for steps in full) else None


# ---------------------------------------------------------------- a case, from start to end


@dataclass
class Layout_:
    """The model's part of the run on one layout (kept across same-layout resumes)."""

    shape: m.Shape
    part: m.Part | None  # split=samples
    seed: int  # the stream's seed (split=shards: reseeded on another layout)
    carried: dict[int, int]  # epoch -> batches per rank delivered in it on earlier layouts
    since: list[list[Got]]  # per rank, what this layout delivered so far (to the checkpoint)
    streams: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)  # see positions()


@dataclass
class Delivered:
    """What the run delivered, up to each checkpoint, each epoch: the positions its rows stand for
    (their tags, where nothing is lost), each row's (position, tag, losses counted), and the
    shards its batches named as failed reads."""

    positions: dict[int, list[int]] = field(default_factory=dict)
    rows: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)


def check_case(case: Case, stop_at: Callable[[int], int], root: Path) -> str:
    """Run the case's chain of layouts on the real loader against the model (the module):
    "refused" where a layout is refused at start (as the model says it must be), else "held"."""
    shards = write_shards(case, root)
    first = m.Shape(*case.layouts[0])
    mix = None
    if len(case.data) > 1:
        from wdsdist.data.delivery.mixing import mix_config, resolve_sources

        mix = resolve_sources(shards.spec, mix_config(case.config(first.workers)))[1]  # type: ignore[arg-type]
    seq = Sequence(case, shards, mix)
    delivered = Delivered()
    state, layout, previous = None, None, None
    steps_taken = 0
    for index, (world, workers) in enumerate(case.layouts):
        shape = m.Shape(world, workers)
        if refused(case, seq, shape):
            try:
                make_loader(case, shards, shape, 0)
            except UserError as exc:
                assert "\n" not in str(exc)
                return "refused"
            raise AssertionError(f"the loader took {shape}, which leaves a worker without a batch")
        layout = next_layout(case, seq, layout, shape, delivered.positions, steps_taken)
        full, groups, count, extra = [], [], None, 0
        while count is None:  # repeat mode: a worker with little data runs many epochs ahead
            extra = 2 * extra or 3
            assert extra < 5000, "the model's streams never pass the horizon on every worker"
            full, groups = expected(case, shards, layout, extra)
            count = len(full[0]) if case.mode == "epoch" else repeat_count(full, horizon(case, layout))
        count = max(0, count - len(layout.since[0]))  # what this layout delivered before is done
        last = index == len(case.layouts) - 1
        stop = None if last else stop_at(count)
        runs = run_ranks(case, shards, shape, state, stop, count)
        check_part(case, seq, shards, layout, runs, (full, groups, count))
        if previous is not None and previous[0] is layout:
            # the same layout: batch for batch the run that was not interrupted
            for rank, run in enumerate(runs):
                straight = previous[1][rank].steps[previous[2] :]
                n = min(len(straight), len(run.steps))
                assert run.steps[:n] == straight[:n], f"rank {rank}: the resumed run left the uninterrupted one"
        check_pixels(case, runs, steps_taken, seq.pixels)
        record(case, layout, runs, stop, delivered)
        if stop is not None:
            steps_taken += stop
            state = every_rank([run.state for run in runs])
        previous = (layout, runs, stop or 0)
    if case.split == "samples":
        final = range(EPOCHS) if case.mode == "epoch" else range(horizon(case, layout) + 1)
        check_coverage(case, seq, delivered.positions, final)
        check_losses(seq, shards, delivered.rows, delivered.failed)
    return "held"


def check_part(case: Case, seq: Sequence, shards: Shards, layout: Layout_, runs: list[RankRun], model: tuple) -> None:
    """Every rank's batches on a layout against the model's (``model``: every rank's batches, its
    workers' rows and the batches this part takes): the layout's batches since it began, the ones
    before a same-layout resume included."""
    full, groups, count = model
    for rank, run in enumerate(runs):
        mine = layout.since[rank] + run.steps
        meant = [positions(case, layout, rank, g) for g in mine] if case.split == "samples" else []
        check_steps(case, seq, shards, mine, meant, full[rank][: len(mine)], groups[rank])
        assert len(run.steps) == count, f"rank {rank}: {len(run.steps)} batches, the model says {count}"
        if case.mode == "epoch":
            check_lens(layout, run, full[rank])


def positions(case: Case, layout: Layout_, rank: int, g: Got) -> tuple[int, ...]:
    """split=samples: the position each row of a rank's batch stands for, its seq's in its
    worker's stream of the epoch: the worker's span of the layout's split, in the order its
    shuffle buffer gives it (order.shuffled_offsets, the shuffle taken as given)."""
    out = []
    for e, s in zip(g.epochs, g.seqs, strict=True):
        key = (rank, g.worker, e)
        if key not in layout.streams:
            span = [t for batch in layout.part.epoch(e)[1][rank, g.worker] for t in batch]  # type: ignore[union-attr]
            offsets = shuffled_offsets(case.seed, case.buffer, rank, g.worker, e, len(span))
            layout.streams[key] = [span[o] for o in offsets]
        stream = layout.streams[key]
        assert s < len(stream), f"rank {rank} worker {g.worker} epoch {e}: seq {s}, past its span of {len(stream)}"
        out.append(stream[s])
    return tuple(out)


def record(case: Case, layout: Layout_, runs: list[RankRun], stop: int | None, delivered: Delivered) -> None:
    """What each rank delivered up to the checkpoint (all of it, in the last part): into the
    layout's batches since it began, and each epoch's positions and rows."""
    for rank, run in enumerate(runs):
        layout.since[rank] += run.steps[:stop]
        for g in run.steps[:stop]:
            meant = positions(case, layout, rank, g) if case.split == "samples" else g.tags
            for e, p, t, lost in zip(g.epochs, meant, g.tags, g.lost, strict=True):
                delivered.positions.setdefault(e, []).append(p)
                delivered.rows.setdefault(e, []).append((p, t, lost))
            delivered.failed.update(g.failed)


def run_ranks(
    case: Case, shards: Shards, shape: m.Shape, state: dict | None, stop: int | None, count: int
) -> list[RankRun]:
    """Every rank's run of a part, one rank after another, each resumed from ``state`` if given."""
    runs = []
    # A full collection walks the whole heap (torch, hypothesis, pytest: ~0.2 s CPU each, over half
    # of this test's CPU); frozen, what was there before the part is left out of it. (Under pytest
    # this thaws what tests/conftest.py froze too; it freezes the heap again as the next module starts.)
    gc.freeze()
    try:
        for rank in range(shape.world):
            loader = make_loader(case, shards, shape, rank)
            if state is not None:
                loader.load_state_dict(state)
            runs.append(run_rank(loader, case.mode, stop, None if case.mode == "epoch" else count))
            del loader
            gc.collect()  # this rank's workers end before the next rank's start
    finally:
        gc.unfreeze()
    return runs


def every_rank(states: list[dict | None]) -> dict:
    """Every rank's entry in one state, as a gather over torch.distributed would make it."""
    assert all(s is not None for s in states)
    return states[0] | {"ranks": [s["ranks"][r] for r, s in enumerate(states)]}  # type: ignore[index]


def next_layout(
    case: Case, seq: Sequence, layout: Layout_ | None, shape: m.Shape, delivered: dict[int, list[int]], steps: int
) -> Layout_:
    """The model's side of the next part: the same layout goes on; another re-splits (or, with
    split=shards, starts a stream reseeded with the steps taken)."""
    fresh = [[] for _ in range(shape.world)]
    if layout is None:
        part = m.Part(seq.model(), shape, case.mode, 0, {}) if case.split == "samples" else None
        return Layout_(shape, part, case.seed, {}, fresh)
    if layout.shape == shape:
        return layout
    if case.split == "shards":
        return Layout_(shape, None, case.seed + steps, {}, fresh)
    old = layout.part
    start, resplit = m.resplit(seq.model(), delivered, stands(case, old, layout.since), old.resplit, shape)
    carried = Counter(layout.carried)
    carried.update(Counter(g.epoch for g in layout.since[0]))
    return Layout_(shape, m.Part(seq.model(), shape, case.mode, start, resplit), case.seed, dict(carried), fresh)


def horizon(case: Case, layout: Layout_) -> int:
    """The last epoch a part reads: epoch mode, EPOCHS - 1; repeat mode, at least that and at
    least the epoch it starts in."""
    if case.mode == "epoch":
        return EPOCHS - 1
    return max(EPOCHS - 1, layout.part.start if layout.part is not None else 0)


def expected(case: Case, shards: Shards, layout: Layout_, extra: int) -> tuple[list[list[m.Step]], list[Counter]]:
    """Every rank's batches from where this layout started, as the model says (repeat mode:
    through ``extra`` epochs past the horizon), and what each of its workers reads per epoch."""
    shape, out, groups = layout.shape, [], []
    through = horizon(case, layout) + (0 if case.mode == "epoch" else extra)
    for rank in range(shape.world):
        if layout.part is not None:
            out.append(layout.part.steps(rank, through))
            groups.append(layout.part.groups(rank, through))
            continue
        ids = [list(r) for r in shards.ids]
        order = lambda mine, epoch: shard_order(mine, layout.seed, epoch, 1)  # noqa: E731
        out.append(m.shard_steps(ids, order, shape, rank, case.batch, range(through + 1)))
        rows = m.shard_rows(ids, order, shape, rank, range(through + 1))
        groups.append(Counter((w, e, i) for w, worker in enumerate(rows) for e, i in worker))
    return out, groups


def check_lens(layout: Layout_, run: RankRun, full: list[m.Step]) -> None:
    """Epoch mode: len() counts the epoch from its start (the batches of other layouts included),
    batches_done what was delivered of it before."""
    for epoch, (length, done) in run.lens.items():
        whole = layout.part.batches(epoch) + layout.carried.get(epoch, 0)  # type: ignore[union-attr]
        before = layout.carried.get(epoch, 0) + sum(g.epoch == epoch for g in layout.since[0])
        assert (length, done) == (whole, before), f"epoch {epoch}: len() {length}, done {done}; model {whole}, {before}"
