"""simdist in-process: its main() (wdsdist/simdist/cli.py, what simdist.py runs) and what its
report says per rank."""

from __future__ import annotations

import re

from wdsdist.simdist import cli as simdist


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    code = simdist.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def ranks(out: str) -> dict[int, int]:
    return {int(r): int(n) for r, n in re.findall(r"^rank +(\d+): (\d+) batches", out, re.M)}
