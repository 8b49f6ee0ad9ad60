"""./run chaos: every fault scenario of tests/cluster/test_cluster_faults.py on a cluster of network
namespaces, one after another (each uses both cores), then one table: scenario, outcome, samples
missing and duplicated (beyond the stated padding), seconds to recover. Arguments go to pytest
(for example -k partition). Needs root for the namespaces; says so in one line otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.conftest import ROOT
from tests.helpers import cluster


def table(rows: list[dict], results: list[tuple[str, str, str]]) -> str:
    """The table of outcomes: a recorded row per passed scenario, the failure's line otherwise."""
    by_test = {row["test"]: row for row in rows}
    head = ("scenario", "outcome", "missing", "duplicated (padding)", "recover s", "note")
    lines = [head]
    for test, outcome, message in results:
        row = by_test.get(test)
        if outcome == "passed" and row is not None:
            counts = "-" if row.get("missing") is None else str(row["missing"])
            dup = "-" if row.get("duplicated") is None else f"{row['duplicated']} ({row['padding']})"
            recover = "-" if row.get("recover_s") is None else f"{row['recover_s']:.1f}"
            lines.append((row["scenario"], row["outcome"], counts, dup, recover, row.get("note", "")))
        else:
            lines.append((test, outcome.upper(), "-", "-", "-", message[:100]))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = [" | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    out.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(out)


def junit_results(path: Path) -> list[tuple[str, str, str]]:
    """(test name, passed/failed/skipped, first line of the reason) per test case, in order."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = (found.get("message") or "").splitlines()[0] if found.get("message") else ""
                break
        results.append((case.get("name", "?"), outcome, message))
    return results


def main(argv: list[str]) -> int:
    why = cluster.unavailable()
    if why is not None:
        print(f"error: ./run chaos {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="wdsdist-chaos-") as tmp:
        rows_file, junit = Path(tmp) / "rows.jsonl", Path(tmp) / "junit.xml"
        env = {**os.environ, "WDSDIST_CHAOS": "1", "WDSDIST_CHAOS_TABLE": str(rows_file)}
        cmd = [sys.executable, "-m", "pytest", "-n", "0", "-q", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        rc = subprocess.call([*cmd, "tests/cluster/test_cluster_faults.py", *argv], cwd=ROOT, env=env)
        rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
        results = junit_results(junit) if junit.exists() else []
    print()
    print(table(rows, results))
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
