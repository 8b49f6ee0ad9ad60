"""simdist --shard-bytes: what the store sends each node per epoch, with and without a
node cache, for loader.shard_order global and node; the arithmetic (simdist.node_egress) on
small layouts worked out by hand, then a layout too big to run, through simdist.main."""

from __future__ import annotations

import re

import pytest

from tests.helpers.simdist import run_main
from wdsdist import simdist
from wdsdist.data.plan.order import shard_order
from wdsdist.errors import UserError
from wdsdist.simdist import cli as simdist_cli


def egress(counts, shard_bytes=100, **kw):
    base = dict(world=2, node_ranks=1, batch_size=5, nepochs=3, seed=0, split="samples", remainder="pad")
    return simdist.node_egress(counts, [shard_bytes] * len(counts), **(base | kw))


def test_the_node_order_fetches_each_shard_once_and_the_global_order_what_each_node_had_not_read():
    node = egress([10] * 4, shard_order="node", cache_bytes=1000)
    assert node.direct == ((200, 200),) * 3  # without a cache: what the ranks read, every epoch
    assert node.cached == ((200, 200), (0, 0), (0, 0))  # each node's two shards, once
    world = egress([10] * 4, shard_order="global", cache_bytes=1000)
    seen = [set(), set()]
    for epoch, row in enumerate(world.cached):
        order = shard_order(range(4), 0, epoch, 1)  # node n reads slots 2n and 2n+1 (20 samples each)
        for n in range(2):
            new = set(order[2 * n : 2 * n + 2]) - seen[n]
            assert row[n] == 100 * len(new)
            seen[n] |= new
    assert sum(map(sum, world.cached)) > sum(map(sum, node.cached)) == node.dataset == 400


def test_a_partial_shard_costs_its_share_with_a_cache_or_without():
    e = egress([10, 10, 10], shard_order="node", cache_bytes=1000, nepochs=2)
    # 30 samples, 2 nodes of 15: each keeps one whole shard and half of the third, which its
    # cache fetches as a span of half the shard's bytes (a ranged read), never whole.
    assert e.direct == ((150, 150),) * 2
    assert e.cached == ((150, 150), (0, 0))
    priced = egress([10, 10, 10], shard_order="node", cache_bytes=1000, nepochs=1, part_bytes=lambda i, a, b: 77)
    assert priced.cached == ((177, 177),)  # the part priced as the loader's ranged read of it


def test_the_padding_is_read_again_and_an_entry_over_the_cache_goes_to_the_store_each_time():
    e = egress([10] * 5, shard_order="node", batch_size=4, cache_bytes=50, nepochs=2)
    # 50 samples padded to 56 (2 ranks x 7 batches of 4), 28 per node. Each node keeps 25: two
    # shards and half of the fifth; it reads its 25 and the padding, its own first 3 again.
    assert e.direct == ((280, 280),) * 2
    # The shards (100 B > 50 B) go to the store every epoch; the half shard (50 B) is kept.
    assert e.cached == ((250, 250), (200, 200))


def test_a_small_cache_refetches_what_it_evicted():
    e = egress([10] * 4, shard_order="node", cache_bytes=100)  # room for one of a node's two shards
    assert e.cached[0] == (200, 200)
    assert all(100 <= c <= 200 for row in e.cached[1:] for c in row)


def test_whole_shards_per_rank_are_the_same_every_epoch():
    e = egress([10] * 6, split="shards", dsrepeat=2, cache_bytes=10_000, node_ranks=1)
    assert e.direct == ((600, 600),) * 3  # rank r reads shards r::2 twice per epoch
    assert e.cached == ((300, 300), (0, 0), (0, 0))


def test_nodes_must_be_whole():
    with pytest.raises(UserError, match="--size 3 is not whole nodes of --node-ranks 2"):
        egress([10] * 4, world=3, node_ranks=2)


def test_a_layout_too_big_to_run_shows_per_node_and_epoch_what_each_order_fetches(capsys):
    args = ["--plan", "--split", "samples", "--nshards", "1281", "--size", "256", "--node-ranks", "8"]
    args += ["--nepochs", "3", "--shard-bytes", "100MB", "--cache-size", "200GB"]
    ratios = {}
    for order in ("global", "node"):
        code, out, _ = run_main(capsys, *args, "--shard-order", order)
        assert code == 0, out
        assert f"store egress (shard-order {order}; 32 nodes of 8 ranks; data set 128 GB; a cache of 200 GB" in out
        assert re.search(r"^  node +epoch 0 +epoch 1 +epoch 2 +in all$", out, re.MULTILINE)
        assert len([line for line in out.splitlines() if re.match(r"^  \d+ ", line)]) == 6  # a summary of 32
        m = re.search(r"over 3 epochs: ([\d.]+) x the data set without a cache, ([\d.]+) x with it", out)
        ratios[order] = float(m.group(1)), float(m.group(2))
        assert f"shard-order   {order}, 8 ranks per node" in out
        whose = "each node's own" if order == "node" else "the epoch's"
        assert re.search(rf"pads \d+ \({whose} first samples again\)", out), out
    assert ratios["global"][0] == ratios["node"][0] > 3  # three epochs and the padding, either way
    assert ratios["node"][1] < 1.2 < 2.5 < ratios["global"][1]


@pytest.mark.parametrize("size, node_ranks", [(8, 2), (3, 1)])
def test_node_order_with_a_cache_fetches_uneven_shards_about_once_over_three_epochs(capsys, size, node_ranks):
    """23 shards of 60-140 samples: every node keeps its samples, so the cache serves epochs 1 and 2
    and pads from what it holds; the default order fetches a new slice every epoch."""
    args = ["--plan", "--split", "samples", "--nshards", "23", "--samples-per-shard", "100+-40", "--nepochs", "3"]
    args += ["--size", str(size), "--node-ranks", str(node_ranks), "--shard-bytes", "2.4MB", "--cache-size", "10GB"]
    args += ["--batch-size", "16", "--nworkers", "1"]
    cached = {}
    for order in ("node", "global"):
        code, out, _ = run_main(capsys, *args, "--shard-order", order)
        assert code == 0, out
        cached[order] = float(re.search(r"over 3 epochs: [\d.]+ x the data set without a cache, ([\d.]+) x", out)[1])
        rows = re.findall(r"^  \d+ .*  ([\d.]+ [kMG]?B) / ([\d.]+ [kMG]?B)$", out, re.MULTILINE)
        assert len(rows) == size // node_ranks
    assert cached["node"] <= 1.05 and cached["global"] > 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plan", "--shard-order", "node"], "--shard-order node applies to --split samples"),
        (["--plan", "--cache-size", "1GB"], "--cache-size needs --shard-bytes"),
        (["--plan", "--split", "samples", "--shard-order", "node", "--node-ranks", "2"], "3 ranks are not whole nodes"),
    ],
)
def test_what_cannot_be_simulated_is_one_line(args, message):
    with pytest.raises(UserError, match=re.escape(message)):
        simdist_cli.main(args)
