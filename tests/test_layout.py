"""The package layout draws the architecture: data/ is the loader, train/ and tools/ use it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from wdsdist.data import jpegcrop

PACKAGE = ROOT / "wdsdist"


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, at its top or inside a function, relative imports resolved."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", sorted((PACKAGE / "data").rglob("*.py")), ids=lambda p: p.name)
def test_data_imports_neither_train_nor_tools(path: Path) -> None:
    wrong = sorted(n for n in imported_modules(path) if n.startswith(("wdsdist.train", "wdsdist.tools")))
    assert wrong == [], f"{path.relative_to(ROOT)} imports {wrong}: data/ must not depend on train/ or tools/"


@pytest.mark.parametrize("path", sorted((PACKAGE / "train").rglob("*.py")), ids=lambda p: p.name)
def test_train_uses_only_the_loaders_public_api(path: Path) -> None:
    """The trainer is a user of the loader like any other: only names in wdsdist.data.__all__."""
    import wdsdist.data

    used = {n.removeprefix("wdsdist.data.") for n in imported_modules(path) if n.startswith("wdsdist.data.")}
    private = sorted(used - set(wdsdist.data.__all__))
    assert private == [], f"{path.relative_to(ROOT)} reaches past wdsdist.data's public API: {private}"


def test_every_public_name_resolves() -> None:
    import wdsdist.data

    assert sorted(wdsdist.data.__all__) == wdsdist.data.__all__
    missing = [name for name in wdsdist.data.__all__ if getattr(wdsdist.data, name, None) is None]
    assert missing == []
    with pytest.raises(AttributeError):
        wdsdist.data.RankLoader  # noqa: B018 (private: not exported)


@pytest.mark.parametrize("path", sorted((ROOT / "tests").rglob("*.py")), ids=lambda p: p.name)
def test_no_test_module_imports_another(path: Path) -> None:
    """Shared helpers live in tests/helpers/ (and fixtures in conftest.py): a test module read alone
    is the whole of its subject."""
    others = sorted(n for n in imported_modules(path) if re.fullmatch(r"tests\.test_\w+", n))
    assert others == [], f"{path.relative_to(ROOT)} imports test modules {others}: move what it needs to tests/helpers/"


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The test above would pass vacuously if it missed an import form."""
    probe = tmp_path / "wdsdist" / "data" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..train import config\nfrom . import splits\ndef f():\n    import wdsdist.tools.shards\n")
    found = imported_modules(probe, tmp_path)
    assert {"wdsdist.train.config", "wdsdist.data.splits", "wdsdist.tools.shards"} <= found


def test_only_errors_stays_at_the_top() -> None:
    """And the Lightning DataModule (DESIGN.md), which nothing in the package imports: it is
    imported only where it is used, so the loader never pulls Lightning in."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "errors.py", "lightning.py"]
    users = sorted(
        str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "wdsdist.lightning" in imported_modules(p)
    )
    assert users == []


def test_jpegcrop_builds_into_the_repository_build_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library moved one folder deeper; its default build place stays <repo>/.build."""
    monkeypatch.delenv("WDSDIST_BUILD", raising=False)
    assert jpegcrop.build_dir() == ROOT / ".build"
    assert jpegcrop.SOURCE.exists()
