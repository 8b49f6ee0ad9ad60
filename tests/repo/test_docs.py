"""The manual builds without a broken link or a missing API reference, and the README's links lead
somewhere."""

from __future__ import annotations

import ast
import html
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata

from tests.conftest import ROOT

# [text](target) outside code: the target up to a closing parenthesis or a space (a title).
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")


def needs_mkdocs() -> None:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python") if not _importable(m)]
    # requirements-dev.txt pins them, so ./run's environment has them: a missing one is a broken install
    assert not missing, f"mkdocs, mkdocs-material and mkdocstrings[python] are not all in the venv (no {missing[0]})"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_the_manual_builds_strictly(tmp_path):
    """mkdocs.yml says strict, with anchors validated: a link to a missing page or heading, a page
    left out of the nav, or a ``:::`` reference that does not resolve fails the build."""
    needs_mkdocs()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("loader.Loader", "loader.EvalLoader", "options.LoaderConfig", "delivery.pipeline.expand_shards"):
        assert f'id="wdsdist.data.{name}"' in api, name  # the reference is rendered, not just a heading
    # every option of LoaderConfig is explained there, from its docstring in data/options.py
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", api)).split())
    for name, doc in option_docs().items():
        words = " ".join(doc.replace("`", "").split()[:6])
        assert words in text, f"LoaderConfig.{name}: {words!r} is not on the API page"


def option_docs() -> dict[str, str]:
    """Each field of LoaderConfig and its option groups, with the docstring that follows it."""
    tree = ast.parse((ROOT / "wdsdist" / "data" / "options.py").read_text())
    out = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if cls.name not in ("SampleOptions", "StreamOptions", "LoaderConfig"):
            continue
        body = cls.body
        for field, after in zip(body, body[1:] + [None], strict=True):
            if isinstance(field, ast.AnnAssign):
                doc = (
                    after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
                )
                assert doc, f"{cls.name}.{field.target.id} has no docstring"
                out[field.target.id] = doc
    assert len(out) > 40
    return out


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (mkdocs) and GitHub give a heading, for the headings we use."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", CODE.sub(lambda m: m.group(0)[1:-1], text)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> set[str]:
    prose = FENCE.sub("", markdown)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose, re.MULTILINE)}


def relative_links(markdown: str) -> list[str]:
    prose = CODE.sub("", FENCE.sub("", markdown))
    return [t for t in LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_relative_link_in_the_readme_names_a_file_that_exists():
    readme = (ROOT / "README.md").read_text()
    links = relative_links(readme)
    assert links, "the README links into docs/"
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve()
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
            broken.append(f"{link}: no heading with that anchor in {path}")
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_links_and_anchors():
    text = "See [a](docs/a.md#b-c) and [site](https://x.org), `[not](code.md)`.\n```\n[no](fence.md)\n```\n"
    assert relative_links(text) == ["docs/a.md#b-c"]
    assert anchors("# Title\n## Many nodes: torchrun, Slurm, Kubernetes\n## Object storage (S3, GCS, MinIO)\n") == {
        "title",
        "many-nodes-torchrun-slurm-kubernetes",
        "object-storage-s3-gcs-minio",
    }


def test_every_dated_report_is_in_the_performance_pages_list():
    page = (ROOT / "docs" / "performance.md").read_text()
    listed = page[page.index("## All reports") :]
    missing = [p.name for p in sorted((ROOT / "bench" / "results").glob("*.md")) if f"reports/{p.name}" not in listed]
    assert missing == [], f"add these to docs/performance.md's All reports: {missing}"


def test_a_page_names_its_tests_in_one_place_not_in_its_prose():
    """A test id (tests/FILE.py::NAME) on a user page sits in a table, not in a sentence."""
    inline = [
        f"{page.name}:{n}"
        for page in sorted((ROOT / "docs").glob("*.md"))
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"tests/(?:\w+/)*test_\w+\.py::\w+", line) and not line.startswith("|")
    ]
    assert inline == [], f"move these test ids into the page's table of tests: {inline}"


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def test_every_picture_a_page_shows_exists_and_each_chart_names_its_report():
    from PIL import Image

    shown = []  # (page, picture)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in IMAGE.findall(FENCE.sub("", page.read_text())):
            path = (page.parent / target).resolve()
            assert path.is_file(), f"{page.name} shows {target}, which does not exist"
            shown.append((page.name, path))
    assert any(page == "README.md" for page, _ in shown) and len({path for _, path in shown}) >= 4
    charts = sorted((ROOT / "bench" / "results").glob("*.png"))
    for chart in charts:
        source = Image.open(chart).text.get("Source")
        assert source == chart.with_suffix(".md").name, f"{chart.name} names {source!r}, not its report"
    # every report of a kind bench/common/charts.py draws has its chart: adding one means drawing it
    import importlib.util

    spec = importlib.util.spec_from_file_location("charts", ROOT / "bench" / "common" / "charts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reports = [r for r in sorted((ROOT / "bench" / "results").glob("*.md")) if module.charted(r)]
    missing = [r.name for r in reports if not module.chart_of(r).exists()]
    assert len(reports) >= 3 and missing == [], f"draw them: ./run charts.py ({missing})"


def test_every_dated_report_is_in_the_navigation():
    """A report nobody can reach from the site's menu is lost (mkdocs only notes it, even strict)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in sorted((ROOT / "bench" / "results").glob("*.md")) if f"reports/{p.name}" not in nav]
    assert missing == [], f"add these to mkdocs.yml's nav under Performance: {missing}"


TEST_REF = re.compile(r"tests/([a-z_]\w*(?:/[a-z_]\w*)*\.py)(?:::(\w+))?")  # not a placeholder (FILE.py)


def cited_tests(text: str) -> list[tuple[str, str | None]]:
    """(test file, test name or None) for each tests/FILE.py[::NAME] a page cites."""
    return [(m.group(1), m.group(2)) for m in TEST_REF.finditer(text)]


def test_every_test_a_page_cites_exists():
    """The reliability table holds each guarantee to a named test: a renamed or removed test
    must not leave a guarantee pointing at nothing."""
    wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path, name in cited_tests(page.read_text()):
            source = ROOT / "tests" / path
            if not source.is_file():
                wrong.append(f"{page.name}: tests/{path}")
            elif name is not None and not re.search(rf"^(?:async )?def {name}\(", source.read_text(), re.MULTILINE):
                wrong.append(f"{page.name}: tests/{path}::{name}")
    assert wrong == []


def test_the_citation_check_sees_files_and_names():
    text = "held by `tests/d/test_a.py::test_b`, `tests/helpers/cluster.py`, tests/test_c.py, not tests/FILE.py::NAME."
    assert cited_tests(text) == [("d/test_a.py", "test_b"), ("helpers/cluster.py", None), ("test_c.py", None)]
