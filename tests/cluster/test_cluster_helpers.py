"""The cluster's pieces that need no namespaces: ./run chaos's table and its one line where
namespaces cannot be made, the process-tree kill a lost node is made with, and the reading of a
run's trace over its starts (tests/helpers/cluster.py, chaos.py, trace.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import chaos, cluster
from tests.helpers.servers import http_server
from tests.helpers.trace import Delivery, delivery, kept


def test_chaos_says_in_one_line_why_it_cannot_run(monkeypatch, capsys):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert cluster.unavailable() == "needs root to create network namespaces (ip netns add): run as root"
    assert chaos.main([]) == 2
    assert capsys.readouterr().err == (
        "error: ./run chaos needs root to create network namespaces (ip netns add): run as root\n"
    )


def test_the_chaos_table_shows_each_scenario_or_its_failure():
    rows = [{"test": "test_a", "scenario": "node lost", "outcome": "re-formed", "recover_s": 7.94,
             "missing": 0, "duplicated": 4, "padding": 4, "note": ""}]  # fmt: skip
    results = [("test_a", "passed", ""), ("test_b", "failed", "Failed: start 2 of the job training: not within 120s")]
    lines = chaos.table(rows, results).splitlines()
    assert lines[0].split(" | ")[:3] == ["scenario ", "outcome  ", "missing"]
    assert [c.strip() for c in lines[2].split("|")] == ["node lost", "re-formed", "0", "4 (4)", "7.9", ""]
    assert [c.strip() for c in lines[3].split("|")][:2] == ["test_b", "FAILED"] and "not within 120s" in lines[3]


def test_kill_tree_ends_descendants_in_sessions_of_their_own():
    """As torchrun's workers are: setsid, so a process group kill would miss them."""
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert child in cluster.tree(parent.pid)
    cluster.kill_tree(parent.pid)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while not cluster.ended(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.ended(child)


def test_the_trace_keeps_of_each_start_what_the_next_resumed_from(tmp_path: Path):
    """Start 1 trained steps 1-6 but the job resumed at 4 (start 2's first step is 5): its
    steps 5 and 6 are not part of what the run delivered."""
    (tmp_path / "start-1").mkdir()
    (tmp_path / "start-2").mkdir()
    (tmp_path / "start-1" / "rank-0.txt").write_text("".join(f"{s} 0 {2 * s - 2},{2 * s - 1}\n" for s in range(1, 7)))
    (tmp_path / "start-2" / "rank-0.txt").write_text("5 0 8,9\n6 0 10,11\n7 1 0,1\n")
    epochs = kept(tmp_path)
    assert epochs == {0: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 1: [0, 1]}
    assert delivery(epochs[0], 11).exact and delivery(epochs[0], 11).padding == 1
    assert delivery([0, 1, 1], 3) == Delivery(missing=1, duplicated=1, padding=0)  # 2 lost, 1 twice: not exact
    assert not delivery([0, 1, 1], 3).exact


def test_the_delay_relay_passes_every_byte_both_ways_in_order(tmp_path: Path):
    """The relay a far store's latency goes through (Cluster.delay) changes nothing it carries."""
    import functools
    import http.server
    import threading
    import urllib.request

    body = bytes(range(256)) * 4096  # 1 MiB: many chunks
    (tmp_path / "shard.tar").write_bytes(body)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    port: list[int] = []
    ready = threading.Event()

    def announce(p: int) -> None:
        port.append(p)
        ready.set()

    with http_server(handler) as url:
        target = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        relay = threading.Thread(target=cluster.delay_proxy, args=("127.0.0.1", 0, target, 0.01, announce), daemon=True)
        relay.start()
        assert ready.wait(30)
        for _ in range(2):  # two requests, each its own connection
            with urllib.request.urlopen(f"http://127.0.0.1:{port[0]}/shard.tar", timeout=30) as response:
                assert response.read() == body
