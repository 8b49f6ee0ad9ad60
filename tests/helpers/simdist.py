"""simdist.py in-process: its main() and what its report says per rank."""

from __future__ import annotations

import re
import sys

from tests.conftest import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import simdist  # noqa: E402  (the top-level script)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    code = simdist.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def ranks(out: str) -> dict[int, int]:
    return {int(r): int(n) for r, n in re.findall(r"^rank +(\d+): (\d+) batches", out, re.M)}
