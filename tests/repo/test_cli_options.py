"""A console script's options are typed once: only the function that parses the command line
sees an ``argparse.Namespace``; everything below it takes the typed options (or the values it
needs), so a reader follows named, checked fields instead of a bag."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

# The packages held to it; the names of the functions that parse a command line.
PACKAGES = ("wdsdist/tools", "wdsdist/simdist", "wdsdist/predict")
PARSERS = frozenset({"parse_args", "parse"})


def _names_namespace(annotation: ast.expr | None) -> bool:
    """``argparse.Namespace`` or ``Namespace`` anywhere in an annotation, quoted or not."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                if _names_namespace(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name == "Namespace":
            return True
    return False


def namespace_takers(path: Path) -> list[str]:
    """'FILE:LINE NAME(PARAM)' for each function of a module, other than a parser, with a
    parameter annotated as a Namespace."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name in PARSERS:
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p is not None)]
        found += [f"{path.name}:{node.lineno} {node.name}({p.arg})" for p in params if _names_namespace(p.annotation)]
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_but_the_parser_takes_an_argparse_namespace(package: str) -> None:
    modules = sorted((ROOT / package).glob("*.py"))
    assert modules, f"no modules under {package}"
    takers = [t for path in modules for t in namespace_takers(path)]
    assert not takers, f"take the typed options, not the parsed Namespace: {takers}"


def test_the_namespace_check_sees_every_spelling(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import argparse\nfrom argparse import Namespace\n"
        "def parse_args(argv) -> argparse.Namespace: ...\n"
        "def parse(ns: argparse.Namespace): ...\n"
        "def a(args: argparse.Namespace): ...\n"
        "def b(x, *, args: 'argparse.Namespace | None' = None): ...\n"
        "class C:\n    def c(self, ns: Namespace): ...\n"
        "def d(args: dict, options: object) -> None: ...\n"
    )
    assert namespace_takers(module) == ["m.py:5 a(args)", "m.py:6 b(args)", "m.py:8 c(ns)"]
