"""Where users run it: two torchrun nodes on loopback, and shards over HTTP."""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_script, write_tiny_shards
from tests.helpers.training import free_port, overrides
from wdsdist.data.sources.index import write_index

pytestmark = pytest.mark.slow  # real training processes

TRAIN_COUNTS = [24] * 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    write_tiny_shards(root / "train", TRAIN_COUNTS, "train", size=32)
    val = write_tiny_shards(root / "val", [10, 7, 5], "val", size=32)
    return {"root": root, "train_dir": root / "train", "val": str(val)}


def test_two_nodes_on_loopback_agree_and_each_rank_reads_only_its_shards(shards, tmp_path):
    # Each shard URL records which rank opened it ($RANK is set by torchrun in every worker).
    opens = tmp_path / "opens.log"
    urls = [
        (f'pipe:echo "$RANK {i}" >> {opens} && exec cat {shards["train_dir"]}/train-{i:06d}.tar', n)
        for i, n in enumerate(TRAIN_COUNTS)
    ]
    index = tmp_path / "logged.index.json"
    write_index(str(index), urls, name="logged")
    run = tmp_path / "run"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).parent / "torchrun"
    node = [
        str(torchrun),
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=loopback-test",
        "train.py",
        *overrides(
            {"train": str(index), "val": shards["val"]},
            run,
            "trainer.steps=8",
            "trainer.workers=1",
            "trainer.ckpt_every=4",
            "data.allow_pipe=true",  # the index is this test's own: its pipe: entries log each open
            "data.trust_index=true",
        ),
    ]
    agents = [
        subprocess.Popen(node, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)

    summary = json.loads((run / "summary.json").read_text())
    assert summary["world"] == 2 and summary["rank_steps"] == [8, 8]
    assert summary["rank_params"][0] == summary["rank_params"][1]
    assert summary["val_samples"] == 22
    opened: dict[int, set[int]] = {}
    for line in opens.read_text().split("\n"):
        if line:
            rank, shard = map(int, line.split())
            opened.setdefault(rank, set()).add(shard)
    assert opened == {0: {0, 2}, 1: {1, 3}}  # shards[rank::world], and both read all of theirs


class _Logged(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, fmt, *args):
        self.requests.append(self.path)


@pytest.fixture
def http_server(shards):
    _Logged.requests = []
    handler = functools.partial(_Logged, directory=str(shards["root"]))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Logged.requests
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("kind", ["http", "pipe-curl", "http-index"])
def test_training_from_shards_over_http(shards, http_server, tmp_path, kind):
    base, requests = http_server
    last = len(TRAIN_COUNTS) - 1
    if kind == "http":
        spec = f"{base}/train/train-{{000000..{last:06d}}}.tar"
    elif kind == "pipe-curl":
        spec = f"pipe:curl -s -f {base}/train/train-{{000000..{last:06d}}}.tar"
    else:  # an index served over HTTP: its relative URLs resolve against the index's URL
        spec = f"{base}/train/train.index.json"
    run = tmp_path / "run"
    proc = run_script(
        "train.py",
        *overrides(
            {"train": f'"{spec}"', "val": shards["val"]},
            run,
            "trainer.steps=6",
            "trainer.workers=1",
            f"data.allow_pipe={str(kind == 'pipe-curl').lower()}",
        ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rank_steps"] == [6]
    fetched = {r for r in requests if r.endswith(".tar")}
    assert fetched and fetched <= {f"/train/train-{i:06d}.tar" for i in range(len(TRAIN_COUNTS))}
    if kind == "http-index":
        assert "/train/train.index.json" in requests
