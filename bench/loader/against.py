"""Two commits of the loader side by side: ``./run bench.py --against REV``.

REV is checked out into a temporary git worktree; both trees then run the same contenders of
this bench.py, (a) ours and (e) ours' own work in a loop, in the same venv, on the same data,
interleaved over rounds (the order of the two trees swaps each round, so a machine that warms up
or slows down over the run lands on both). Each contender runs in a subprocess whose ``wdsdist``
is imported from its tree (``--tree``). The table gives each figure as new / old: the median of
the rounds with its spread, and the ratio of the medians.

What it is for: a change to the loader's hot path, its workers or its imports is measured against
main before it lands (docs/development.md says when).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (row, how a round's result gives it, format, higher is better)
METRICS: tuple[tuple[str, Callable[[dict], float | None], str, bool], ...] = (
    ("samples/s", lambda r: r["ours"].get("samples_per_s"), "{:.0f}", True),
    ("own work (e), samples/s", lambda r: r["ours-work"].get("samples_per_s"), "{:.0f}", True),
    ("ours / own work", lambda r: _ratio(r), "{:.3f}", True),
    ("CPU per sample, ms", lambda r: r["ours"].get("cpu_ms_per_sample"), "{:.3f}", False),
    ("first batch, s", lambda r: r["ours"].get("first_batch_s"), "{:.2f}", False),
    ("peak RSS, MB", lambda r: r["ours"].get("peak_rss_mb"), "{:.0f}", False),
    ("PSS, MB", lambda r: r["ours"].get("pss_mb"), "{:.0f}", False),
    ("  main process", lambda r: _account(r, "pss", main=True), "{:.0f}", False),
    ("  workers, all", lambda r: _account(r, "pss", main=False), "{:.0f}", False),
    ("  anonymous", lambda r: _account(r, "anon"), "{:.0f}", False),
    ("  files (libraries)", lambda r: _account(r, "file"), "{:.0f}", False),
    ("  shared memory", lambda r: _account(r, "shmem"), "{:.0f}", False),
    ("private dirty, MB", lambda r: _account(r, "private"), "{:.0f}", False),
)


def _account(result: dict, field: str, main: bool | None = None) -> float | None:
    """A field of the PSS account (bench.py's TreeMemory.account) summed over the main process
    (``main``), its descendants (``not main``) or all."""
    rows = result["ours"].get("pss_account")
    if not rows:
        return None
    if main is not None:
        rows = rows[:1] if main else rows[1:]
    return sum(row[field] for row in rows)


def _ratio(result: dict) -> float | None:
    ours, work = result["ours"].get("samples_per_s"), result["ours-work"].get("samples_per_s")
    return ours / work if ours and work else None


def resolve(rev: str) -> str:
    """REV's commit, or SystemExit with one line naming it."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"error: --against {rev}: no such commit in {ROOT}")
    return out.stdout.strip()


@contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """``commit`` checked out (detached) in a temporary folder, removed again however the run ends."""
    base = Path(tempfile.mkdtemp(prefix="wdsdist-against-"))
    tree = base / commit[:12]
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), commit],
        check=True,
    )
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(base, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)


def prebuild(tree: Path) -> str:
    """Build the tree's jpegcrop before the clock, so no round times a compile; its note if it
    cannot be built (that tree then decodes whole images, and the table says so)."""
    # A build named as this checkout's is of the same source (the name carries its hash): reused.
    (tree / ".build").mkdir(exist_ok=True)
    for built in (ROOT / ".build").glob("jpegcrop-*.so"):
        if not (tree / ".build" / built.name).exists():
            shutil.copy2(built, tree / ".build" / built.name)
    code = "from wdsdist.data.decode import jpegcrop; lib = jpegcrop.load(); print(lib if isinstance(lib, str) else '')"
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tree))
    return out.stdout.strip() or (out.stderr.strip().splitlines() or [""])[-1]


def summary(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    spread = f" ({fmt.format(min(values))}-{fmt.format(max(values))})" if len(values) > 1 else ""
    return fmt.format(med) + spread


def table(dataset: str, rounds: dict[str, list[dict]], labels: dict[str, str]) -> tuple[str, dict]:
    """The text table of one data set, and its medians as JSON."""
    head = f"{'':26} {'new: ' + labels['new']:>26} {'old: ' + labels['old']:>26} {'new / old':>9}"
    lines = [f"\n{dataset}: median of {len(rounds['new'])} rounds (min-max)", head, "-" * len(head)]
    medians: dict = {}
    for name, get, fmt, _ in METRICS:
        got = {side: [v for r in rounds[side] if (v := _safe(get, r)) is not None] for side in ("new", "old")}
        new, old = (statistics.median(got[s]) if got[s] else None for s in ("new", "old"))
        ratio = f"{new / old:.3f}" if new is not None and old else "-"
        lines.append(f"{name:26} {summary(got['new'], fmt):>26} {summary(got['old'], fmt):>26} {ratio:>9}")
        medians[name] = {"new": new, "old": old, "new_rounds": got["new"], "old_rounds": got["old"]}
    return "\n".join(lines), medians


def _safe(get: Callable[[dict], float | None], result: dict) -> float | None:
    try:
        return get(result)
    except (KeyError, TypeError):
        return None


def run(args: argparse.Namespace, prepare: Callable[[str], dict], run_contender: Callable[..., dict]) -> int:
    """The --against run: ``prepare(dataset)`` writes a data set once, ``run_contender(name,
    dataset, args, tree)`` runs one contender of this bench.py with wdsdist from ``tree``."""
    from bench.common.machine import cpu_model

    commit = resolve(args.against)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "wdsdist"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    labels = {"new": head.stdout.strip() + ("+" if dirty else ""), "old": commit[:12]}
    datasets = ["noise", "photos"] if args.dataset == "both" else [args.dataset]
    for ds in datasets:
        prepare(ds)
    results: dict[str, dict[str, list[dict]]] = {ds: {"new": [], "old": []} for ds in datasets}
    with worktree(commit) as old:
        trees = {"new": ROOT, "old": old}
        notes = {side: prebuild(tree) for side, tree in trees.items()}
        for side, note in notes.items():
            if note:
                print(f"note: {side} ({labels[side]}): jpegcrop: {note}", file=sys.stderr)
        for k in range(args.repeat):
            order = ("new", "old") if k % 2 == 0 else ("old", "new")
            for ds in datasets:
                for side in order:
                    print(
                        f"round {k + 1}/{args.repeat}, {ds}: {side} ({labels[side]}) ...", file=sys.stderr, flush=True
                    )
                    got = {name: run_contender(name, ds, args, trees[side]) for name in ("ours", "ours-work")}
                    for name, r in got.items():
                        if "error" in r:
                            print(f"  {name} failed: {r['error']}", file=sys.stderr)
                    results[ds][side].append(got)
    print(
        f"\nnew {labels['new']} against old {labels['old']}: {cpu_model()}, {os.cpu_count()} cores, "
        f"{args.workers} workers, batch {args.batch}, {args.batches} batches timed after {args.warmup}"
    )
    report: dict = {
        "new": labels["new"],
        "old": commit,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "config": vars(args),
        "results": {},
        "rounds": results,
    }
    for ds in datasets:
        text, medians = table(ds, results[ds], labels)
        print(text)
        report["results"][ds] = medians
    out = Path(args.json).with_name("against.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {out}")
    return 0
