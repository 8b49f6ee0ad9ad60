"""python -m wdsdist.simdist: the same as wds-simdist (wdsdist/simdist/cli.py)."""

from wdsdist.simdist.cli import run

run()
