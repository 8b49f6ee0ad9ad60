"""The package layout draws the architecture: data/ is the loader; tools/, model/, train/, predict/ and
simdist/ use it; train/ and predict/ share cluster/ and model/ and never import each other; inside
data/, the subpackages import one another only along the arrows below, and no module of the
package takes part in an import circle or reaches for another module's private name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from wdsdist.data.decode import jpegcrop

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


# What each part of wdsdist/data may import of wdsdist/data (besides itself). The reading of shards
# (sources) sits on the tar parser, which knows no URLs; decoding sits on the parser's members;
# planning is pure arithmetic on counts and seeds; delivery runs it all; loader.py is the public face.
DATA_ARROWS = {
    "tar": set(),
    "sources": {"tar"},
    "decode": {"tar", "options", "autos"},
    "plan": {"options", "rules"},
    "delivery": {"sources", "tar", "decode", "plan", "options", "rules", "cores", "autos"},
    "options": {"sources", "cores", "autos", "rules"},
    "rules": {"cores"},
    "cores": set(),
    "autos": {"cores"},
    "loader": {"sources", "plan", "delivery", "options", "autos"},
}
DATA_FILES = sorted((PACKAGE / "data").rglob("*.py"))


def data_part(path: Path) -> str:
    """A file's part of wdsdist/data: its subpackage, or its module's name at the top."""
    rel = path.relative_to(PACKAGE / "data")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", DATA_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_data_imports_nothing_of_wdsdist_but_itself_and_errors(path: Path) -> None:
    wrong = sorted(
        n
        for n in imported_modules(path)
        if n.startswith("wdsdist.") and not n.startswith(("wdsdist.data", "wdsdist.errors"))
    )
    assert wrong == [], f"{path.relative_to(ROOT)} imports {wrong}: data/ depends on nothing else of wdsdist"


# What each package of wdsdist may import of the others: the loader stands alone; the shard
# writer and synthetic set (tools) use its readers; cluster (torchrun's environment, faults) stands
# on errors alone; the model a run leaves (model) uses the loader's and tools' readers; training
# (train) and prediction (predict) each use all of those, and never each other; nothing imports
# the trainer, prediction, simdist or the Lightning module.
PACKAGE_ARROWS = {
    "errors": set(),
    "data": {"errors"},
    "tools": {"data", "errors"},
    "simdist": {"data", "errors", "tools"},
    "cluster": {"errors"},
    "model": {"data", "errors", "tools"},
    "train": {"cluster", "data", "errors", "model", "tools"},
    "predict": {"cluster", "data", "errors", "model", "tools"},
    "lightning": {"data", "errors"},
    "preload": set(),
}


def package_of(path: Path) -> str:
    """A file's package of wdsdist: its subpackage, or its module's name at the top."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "__init__.py"],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_packages_import_along_the_arrows(path: Path) -> None:
    part = package_of(path)
    assert part in PACKAGE_ARROWS, f"{path.relative_to(ROOT)}: new package: give it PACKAGE_ARROWS"
    used = {n.split(".")[1] for n in imported_modules(path) if n.startswith("wdsdist.")}
    wrong = sorted(used - PACKAGE_ARROWS[part] - {part})
    assert wrong == [], f"{path.relative_to(ROOT)} ({part}) imports {wrong}"


def test_the_package_arrows_have_no_circle() -> None:
    assert not _circles(PACKAGE_ARROWS)


def test_training_and_prediction_meet_only_in_the_shared_packages() -> None:
    """Neither application imports the other, directly or through a package they share."""

    def reach(part: str) -> set[str]:
        seen, todo = set(), [part]
        while todo:
            for nxt in PACKAGE_ARROWS[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert "predict" not in reach("train") and "train" not in reach("predict")
    assert reach("train") & reach("predict") >= {"cluster", "model"}


@pytest.mark.parametrize(
    "path",
    [p for p in DATA_FILES if p.name != "__init__.py" or p.parent.name != "data"],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_data_parts_import_along_the_arrows(path: Path) -> None:
    part = data_part(path)
    allowed = DATA_ARROWS[part] | {part}
    used = {
        n.removeprefix("wdsdist.data.").split(".")[0] for n in imported_modules(path) if n.startswith("wdsdist.data.")
    }
    assert "wdsdist.data" not in imported_modules(path), f"{path.relative_to(ROOT)} imports the public API from inside"
    assert sorted(used - allowed) == [], f"{path.relative_to(ROOT)} ({part}) imports {sorted(used - allowed)}"


def test_every_data_part_has_its_arrows() -> None:
    """A new subpackage or top module must say what it may import (and the arrows stay acyclic)."""
    assert {data_part(p) for p in DATA_FILES if p.parent != PACKAGE / "data" or p.name != "__init__.py"} == set(
        DATA_ARROWS
    )
    assert not _circles({part: arrows for part, arrows in DATA_ARROWS.items()})


IO_MODULES = ("os", "io", "socket", "urllib", "http", "tarfile", "subprocess", "shutil", "boto3", "torch.utils.data")


@pytest.mark.parametrize("path", sorted((PACKAGE / "data" / "plan").glob("*.py")), ids=lambda p: p.name)
def test_planning_does_no_io(path: Path) -> None:
    found = sorted(n for n in imported_modules(path) if n.split(".")[0] in IO_MODULES or n.startswith(IO_MODULES))
    assert found == [], f"{path.relative_to(ROOT)} imports {found}: planning is arithmetic on counts and seeds"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan), or a node that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circles_in_the_package() -> None:
    """Every import counts, also one inside a function or under TYPE_CHECKING: each hides a circle
    rather than removing it. A package's __init__ is left out as a target, since `from pkg import
    mod` names the package only to reach the module."""
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    packages = {module_name(p) for p in files if p.name == "__init__.py"}
    graph = {
        module_name(p): {n for n in imported_modules(p) if n in modules and n not in packages} - {module_name(p)}
        for p in files
    }
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def private_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Names starting with one underscore that a file takes from another wdsdist module: by
    ``from wdsdist.x import _name``, or as ``mod._name`` of a module or name it imported."""
    tree = ast.parse(path.read_text(), str(path))
    found, bound = [], set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("wdsdist")
            or (isinstance(node, ast.ImportFrom) and node.level)
        ):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.module}.{alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("wdsdist"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return sorted(set(found))


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_uses_another_modules_private_names(path: Path) -> None:
    assert private_uses(path) == [], f"{path.relative_to(ROOT)} uses private names of other modules"


def test_the_private_name_check_sees_both_forms(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from wdsdist.data.sources.httpopen import _Meter\nfrom wdsdist.data.sources import s3open\ns3open._client()\n"
    )
    assert private_uses(probe, tmp_path) == ["s3open._client", "wdsdist.data.sources.httpopen._Meter"]


@pytest.mark.parametrize(
    "path",
    [p for part in ("train", "predict", "model", "cluster") for p in sorted((PACKAGE / part).rglob("*.py"))],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_train_uses_only_the_loaders_public_api(path: Path) -> None:
    """The trainer and prediction are users of the loader like any other: only names in
    wdsdist.data.__all__."""
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
    others = sorted(n for n in imported_modules(path) if re.fullmatch(r"tests\.(\w+\.)*test_\w+", n))
    assert others == [], f"{path.relative_to(ROOT)} imports test modules {others}: move what it needs to tests/helpers/"


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The test above would pass vacuously if it missed an import form."""
    probe = tmp_path / "wdsdist" / "data" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..train import config\nfrom . import splits\ndef f():\n    import wdsdist.tools.shards\n")
    found = imported_modules(probe, tmp_path)
    assert {"wdsdist.train.config", "wdsdist.data.splits", "wdsdist.tools.shards"} <= found


def test_only_errors_stays_at_the_top() -> None:
    """And the Lightning DataModule, which nothing in the package imports: it is imported only
    where it is used, so the loader never pulls Lightning in; and preload.py, which the package's
    own import runs before anything imports torchvision."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "errors.py", "lightning.py", "preload.py"]
    users = sorted(
        str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "wdsdist.lightning" in imported_modules(p)
    )
    assert users == []


LIBRARY_FILES = sorted((PACKAGE / "data").rglob("*.py")) + [PACKAGE / "lightning.py"]


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_library_logs_and_never_prints(path: Path) -> None:
    """A program that uses the loader routes its messages (logging.getLogger(__name__)); only the
    trainer and the tools choose a format (wdsdist.errors.console_logging)."""

    def prints(call: ast.Call) -> bool:
        if isinstance(call.func, ast.Name):
            return call.func.id == "print"
        return isinstance(call.func, ast.Attribute) and call.func.attr == "write" and "std" in ast.unparse(call.func)

    tree = ast.parse(path.read_text())
    calls = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and prints(node)]
    assert calls == [], f"{path.relative_to(ROOT)} prints at lines {calls}: log instead (logging.getLogger(__name__))"


def test_jpegcrop_builds_into_the_repository_build_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library moved one folder deeper; its default build place stays <repo>/.build."""
    monkeypatch.delenv("WDSDIST_BUILD", raising=False)
    assert jpegcrop.build_dir() == ROOT / ".build"
    assert jpegcrop.SOURCE.exists()


def test_the_node_cache_stays_split_by_concern() -> None:
    """The cache's on-disk protocol (cachefiles.py, whose docstring alone describes the format),
    its counts (cachecounts.py) and one process's use of a folder (cache.py): each short enough
    to read in one sitting."""
    sources = PACKAGE / "data" / "sources"
    for name in ("cache.py", "cachefiles.py", "cachecounts.py"):
        assert len((sources / name).read_text().splitlines()) <= 400, name
    assert "on-disk protocol" in ast.get_docstring(ast.parse((sources / "cachefiles.py").read_text()))
    for name in ("cache.py", "cachecounts.py"):  # they point to it; they do not describe the format again
        assert ".part-" not in (sources / name).read_text().split('"""')[1], name


def test_the_bench_is_in_folders_that_say_what_they_measure() -> None:
    """bench/ holds folders by purpose, each opening with what it measures; no file's name is
    another's with a suffix (gpucheck_train.py beside gpucheck.py): such a family is a folder."""
    bench = ROOT / "bench"
    assert sorted(p.name for p in bench.glob("*.py")) == ["__init__.py"]
    folders = sorted(p for p in bench.iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert len(folders) >= 5
    for folder in folders:
        opening = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert opening, f"{folder.relative_to(ROOT)}/__init__.py: say what the folder measures"
        stems = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
        family = sorted(s for s in stems for t in stems if s != t and s.startswith(t + "_"))
        assert family == [], f"{folder.relative_to(ROOT)}: {family} are a folder in disguise"
