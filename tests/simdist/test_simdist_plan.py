"""simdist's pieces without data: spreads, the delivery order, verdicts, advice, coverage, plot, cache."""

from __future__ import annotations

import os

import pytest

from wdsdist import simdist
from wdsdist.data.plan.splits import plan
from wdsdist.errors import UserError

S = simdist.Settings


def sim_of(counts, **settings) -> simdist.Simulation:
    return simdist.simulate_plan(simdist.Layout(tuple(counts), "test"), S(**settings))


@pytest.mark.parametrize(
    "text, expected", [("1000", (1000, 0)), ("1000+-50", (1000, 50)), (" 7 +- 3 ", (7, 3)), ("12±2", (12, 2))]
)
def test_parse_spread(text, expected):
    assert simdist.parse_spread(text) == expected


@pytest.mark.parametrize("text", ["", "x", "100+-", "100-50", "-5", "1e3", "100+-5+-5"])
def test_parse_spread_rejects(text):
    with pytest.raises(UserError, match="expected N or N"):
        simdist.parse_spread(text)


def test_described_counts_are_seeded_and_in_range():
    a = simdist.described_counts(500, "1000+-50", seed=1)
    assert a == simdist.described_counts(500, "1000+-50", seed=1)
    assert a != simdist.described_counts(500, "1000+-50", seed=2)
    assert min(a) >= 950 and max(a) <= 1050 and len(set(a)) > 50
    assert simdist.described_counts(3, "100", seed=1) == [100, 100, 100]


def test_settings_reject_zero_and_negative():
    for bad in ({"size": 0}, {"batch_size": -1}, {"dsrepeat": 0}, {"repeat": 0}, {"nepochs": 0}, {"nworkers": -2}):
        with pytest.raises(UserError, match="must be >= "):
            S(**bad)
    with pytest.raises(UserError, match="--nbatches must be"):
        S(nbatches=0)


def test_classic_layout_counts_and_verdict():
    sim = sim_of([100] * 10)
    assert [r.batches for r in sim.expected] == [40, 30, 30]
    assert sim.reach == [40, 30, 30]
    ok, line = simdist.verdict([sim.expected])
    assert not ok and line == "FAILED: ranks deliver different numbers of batches: 40 (rank 0), 30 (ranks 1-2)"
    assert simdist.verdict([sim_of([100] * 10, nbatches=30).expected]) == (
        True,
        "SUCCESS: same batches in all ranks (30 per rank per epoch)",
    )
    assert [r.batches for r in sim_of([100] * 10, nbatches=40, dsrepeat=2).expected] == [40, 40, 40]
    assert [r.batches for r in sim_of([100] * 10, nbatches=40, repeat=2).expected] == [40, 40, 40]
    assert sim_of([100] * 10, nbatches="auto", repeat=2).cut == 60


def test_round_robin_places_short_batches():
    # Three workers with 17, 6 and 6 samples, batches of 5: worker batches 3+1, 1+1, 1+1.
    p = plan([17, 6, 6], 1, 3, 5, partial=True)
    full, shorts = simdist.pass_sizes(p.ranks[0], 5, True, False)
    # Order: w0 w1 w2 (round 0), w0 w1' w2' (round 1), w0, w0'
    assert full == 5 and shorts == [(4, 1), (5, 1), (7, 2)]
    assert simdist.delivered(p.ranks[0], S(size=1, batch_size=5, partial=True), cut=5).sizes == {5: 4, 1: 1}
    assert simdist.delivered(p.ranks[0], S(size=1, batch_size=5, partial=True), cut=None).sizes == {5: 5, 1: 2, 2: 1}


def test_rank_lines_format():
    assert simdist.rank_line(0, simdist.RankEpoch({10: 40})) == "rank 0: 40 batches of 10 (400 samples)"
    assert (
        simdist.rank_line(3, simdist.RankEpoch({7: 42, 2: 3}), 2)
        == "rank  3: 45 batches: 42 of 7, 3 of 2 (300 samples)"
    )
    assert simdist.rank_line(1, simdist.RankEpoch({})) == "rank 1: 0 batches"
    many = simdist.rank_lines([simdist.RankEpoch({1: i % 7 + 1}) for i in range(1000)])
    assert many[0] == "batches per rank: 1..7, 7 distinct counts over 1000 ranks"
    assert len(many) < 25 and many[-1].startswith("rank 999:")


def test_advice_not_divisible_and_cut():
    tips = simdist.advice(sim_of([100] * 10))
    assert any(
        "10 shards do not divide evenly into 3 ranks x 3 workers = 9 slots" in t and "9 or 18" in t for t in tips
    )
    assert any("--nbatches 30 (or --nbatches auto)" in t and "drops 100, 10.0%" in t for t in tips)
    assert any("--nbatches 40 --dsrepeat 2" in t for t in tips)


def test_advice_counts_one_rank_and_one_worker_in_the_singular():
    tips = simdist.advice(sim_of([100] * 3, size=2, nworkers=1))
    assert any("3 shards do not divide evenly into 2 ranks x 1 worker = 2 slots" in t for t in tips)
    assert not any("1 workers" in t or "1 ranks" in t for t in tips)


def test_advice_beyond_reach_names_the_dsrepeat_that_works():
    tips = simdist.advice(sim_of([100] * 10, nbatches=75))
    (tip,) = [t for t in tips if "--nbatches 75 is more than" in t]
    assert "ranks 0-2" in tip and "--nbatches 30 or less" in tip and "--dsrepeat 3" in tip and "--repeat 3" in tip


def test_advice_divisible_but_uneven_shards():
    tips = simdist.advice(sim_of([100, 100, 100, 120, 100, 100, 100, 100, 100]))
    assert any("divide evenly into 9 slots, but shards hold 100..120 samples" in t for t in tips)


def test_advice_worker_without_shard():
    sim = sim_of([100] * 10, nworkers=4)
    assert [r.refused for r in sim.expected][1] == "refused: worker 3 gets no shard (3 shards for 4 workers)"
    (tip,) = simdist.advice(sim)
    assert "rank 1 gets 3 shards for 4 workers" in tip and "--nworkers 3" in tip and "12 divide evenly" in tip
    assert simdist.verdict([sim.expected])[1] == (
        "FAILED: the training loader refuses ranks 1-2 (a worker with no shard)"
    )
    (tip,) = simdist.advice(sim_of([100] * 2, size=3, nworkers=1))
    assert "rank 2 gets 0 shards" in tip and "--size 2" in tip


def test_advice_zero_batches():
    sim = sim_of([100] * 9, batch_size=500)
    assert simdist.verdict([sim.expected]) == (False, "FAILED: every rank delivers 0 batches")
    (tip,) = simdist.advice(sim)
    assert "as few as 100 samples" in tip and "--batch-size 500" in tip


def test_sample_balance():
    assert simdist.sample_balance(sim_of([100] * 10, nbatches="auto")) == (900, 100, 0)
    assert simdist.sample_balance(sim_of([100] * 10, nbatches=40, dsrepeat=2)) == (1200, 0, 200)


def test_coverage_line_explains():
    sim = sim_of([100] * 10, nbatches=30)
    line = simdist.coverage_line(0, simdist.Coverage(1000, 900, 900), sim)
    assert "missing 100 (10.0%)" in line and "the cut at --nbatches" in line and "short batches" not in line
    line = simdist.coverage_line(0, simdist.Coverage(1000, 1000, 990), sim_of([100] * 10))
    assert "duplicated 10 (1.0%)" in line and "UNEXPECTED" in line
    line = simdist.coverage_line(0, simdist.Coverage(1000, 990, 990), sim_of([105] * 9, batch_size=10))
    assert "short batches are dropped" in line


def test_report_at_scale_is_a_summary(capsys):
    counts = simdist.described_counts(100_000, "1000+-50", seed=0)
    sim = simdist.simulate_plan(simdist.Layout(tuple(counts), "big"), S(size=1024, nworkers=8, batch_size=64))
    code = simdist.report(sim)
    out = capsys.readouterr().out
    assert code == 1
    assert "samples       " in out and "1024 ranks" in out
    assert "rank 1023:" in out and "ranks not shown (--verbose shows all)" in out
    assert len(out.splitlines()) < 60


def test_plot_writes_png(tmp_path):
    for name, sim in {
        "classic": sim_of([100] * 10, nbatches=40),
        "refused": sim_of([100] * 5, nworkers=3),
        "big": sim_of(simdist.described_counts(2000, "100+-20", 0), size=64, nworkers=4, nbatches="auto"),
    }.items():
        path = simdist.plot(sim, sim.expected, str(tmp_path / f"{name}.png"))
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_picture_draws_whole_shards_or_the_part_a_span_reads():
    """The classic demo (10 x 100 samples, 3 ranks x 3 workers, batch 10): a row is a worker's
    shards, or under split=samples exactly its span, the padding wrapping to shard 0."""
    from wdsdist.simdist.plot import worker_boxes

    cumulative = list(range(0, 1001, 100))
    shards = sim_of([100] * 10, nworkers=3)
    assert worker_boxes(shards, 0, 0, cumulative) == [(0, 100), (9, 100)]  # shards 0::3 of rank 0's 0, 3, 6, 9
    samples = sim_of([100] * 10, nworkers=3, split="samples")
    assert worker_boxes(samples, 0, 0, cumulative) == [(0, 100), (1, 20)]
    assert worker_boxes(samples, 2, 2, cumulative) == [(9, 90), (0, 20)]
    for rank in samples.plan.ranks:
        for w in rank.workers:
            assert sum(n for _, n in worker_boxes(samples, rank.rank, w.worker, cumulative)) == w.samples


def test_synthetic_layout_is_written_once(tmp_path):
    described = simdist.described_layout(3, "4+-2", seed=5)
    first = simdist.synthetic_layout(described, str(tmp_path), "small")
    assert [s.nsamples for s in first.shards] == list(described.counts)
    stamps = [os.stat(s.url).st_mtime_ns for s in first.shards]
    again = simdist.synthetic_layout(described, str(tmp_path), "small")
    assert again.shards == first.shards
    assert [os.stat(s.url).st_mtime_ns for s in again.shards] == stamps


def test_real_mode_refuses_huge_layouts(tmp_path):
    with pytest.raises(UserError, match="use --plan"):
        simdist.synthetic_layout(simdist.described_layout(1000, "1000", 0), str(tmp_path), "huge")
