"""The documentation pages stay true to the tree: README.md, CHANGELOG.md and docs/*.md.

- docs/results/ holds exactly the files the pages (and the shipped tile tables' notes) cite as `results/<file>`;
- every relative link of a page names a file that exists, and every `#anchor` one of its headings;
- the figure is what docs/plot.py draws from the results files it reads (and would change with them);
- the Python blocks of docs/*.md compile (the README's run: tests/test_readme.py), with known `needs` marks;
- the pages say what the project is and measures, never how its work was organised.
Standard library only: no kernel runs here.
"""

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest
from conftest import ROOT

ROOT = Path(ROOT)
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
CONFIGS = sorted((ROOT / "torch-ext" / "moe_dispatch" / "configs").glob("*.json"))
CITATION = re.compile(r"results/([A-Za-z0-9_.\-]+\.(?:json|md|txt|log|svg|png))")
LINK = re.compile(r"\]\(([^)\s]+)\)")
KNOWN_NEEDS = {"gpu", "2 gpus", "hub", "minutes"}
# How the work was organised, which the pages must not talk about: tracker numbers, work periods, machine paths.
ORGANISATION = [re.compile(p, re.I) for p in (r"\bissues?\s+#?\d", r"(?<![\w&/)])#\d+\b", r"\bsessions?\b",
                                               r"\bthis round\b", r"/work/", r"/tmp/")]


def _cited():
    cited = {}
    for path in PAGES + CONFIGS:
        for name in CITATION.findall(path.read_text()):
            cited.setdefault(name, path.relative_to(ROOT))
    return cited


def test_results_hold_exactly_what_the_pages_cite():
    cited = _cited()
    present = {p.name for p in RESULTS.iterdir() if p.is_file()}
    missing = {name: str(page) for name, page in cited.items() if name not in present}
    uncited = sorted(present - set(cited))
    assert not missing, f"cited but not in docs/results: {missing}"
    assert not uncited, f"in docs/results but cited by no page: {uncited} (cite them or git rm them)"


def _slug(heading):
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page):
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_name_files_and_headings_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link to {target}: {linked} does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page.name}: link to {target}: {linked.name} has no such heading"


def _plot_module():
    spec = importlib.util.spec_from_file_location("docs_plot", DOCS / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_figure_is_what_its_data_gives():
    plot = _plot_module()
    data, meta, ceilings = plot.load()
    svg = plot.render(data, meta, ceilings)
    assert plot.OUT.read_text() == svg, "the committed figure is stale: run python3 docs/plot.py"
    assert plot.main(["--check"]) == 0
    # The figure depends on the data: one cell's time moved gives another picture.
    model = plot.MODELS[0][0]
    tokens, ours, *rest = data[model]
    moved = dict(data, **{model: (tokens, [ours[0] * 1.5, *ours[1:]], *rest)})
    assert plot.render(moved, meta, ceilings) != svg
    # Every plotted point is a cell of the run: its time over its floor, for each of the four paths.
    run = json.loads(plot.PEERS.read_text())
    for model, _ in plot.MODELS:
        tokens, *series = data[model]
        assert len(tokens) == 7 and all(len(values) == 7 for values in series)
        cells = {c["T"]: c for c in run["cells"] if c["model"] == model}
        for (key, *_), values in zip(plot.SERIES, series):
            assert values == [cells[t]["results"][key]["us"] / cells[t]["floor_us"] for t in tokens], (model, key)


def test_file_map_names_every_module_of_the_package():
    """docs/internals.md's file map names each module of the package by its path below torch-ext/moe_dispatch/
    (`gemm/grouped.py`), and each file it names exists (there, or below the project root: `tests/test_moe.py`)."""
    package = ROOT / "torch-ext" / "moe_dispatch"
    text = (DOCS / "internals.md").read_text()
    section = text[text.index("## File map"):text.index("## Where shared code lives")]
    named = set(re.findall(r"`((?:[a-z_]+/)?[a-z_0-9]+\.py)`", section))
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"}
    assert "gemm/grouped.py" in modules and modules <= named, f"not in the file map: {sorted(modules - named)}"
    stale = sorted(name for name in named if not (package / name).is_file() and not (ROOT / name).is_file())
    assert not stale, f"the file map names files that do not exist: {stale}"


_BLOCK = re.compile(r"(?:^<!--\s*needs:\s*(?P<needs>[^>]*?)\s*-->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S)


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_docs_python_blocks_compile(page):
    for match in _BLOCK.finditer(page.read_text()):
        needs = {n.strip() for n in (match["needs"] or "").split(",") if n.strip()}
        assert needs <= KNOWN_NEEDS, f"{page.name}: unknown needs {sorted(needs - KNOWN_NEEDS)}"
        if match["lang"] == "python":
            line = page.read_text().count("\n", 0, match.start("code")) + 1
            ast.parse(match["code"], filename=f"{page.name}:{line}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_speak_of_the_project_not_of_how_it_was_made(page):
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for pattern in ORGANISATION:
            assert not pattern.search(line), f"{page.relative_to(ROOT)}:{number}: {pattern.pattern!r} in {line!r}"


def test_results_text_speaks_of_the_project_not_of_how_it_was_made():
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".svg", ".png"):
            continue  # colours are #rrggbb; the figure's text is checked through docs/plot.py's source below
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in ORGANISATION:
                assert not pattern.search(line), f"{path.relative_to(ROOT)}:{number}: {pattern.pattern!r}"
    source = (DOCS / "plot.py").read_text()
    assert not any(p.search(line) for p in ORGANISATION[2:] for line in source.splitlines())


def _version_key(name):
    """("v1.1") -> (1, 1): the order of the kernels' development versions."""
    return tuple(int(part) for part in name.lstrip("v").split("."))


def test_versions_page_lists_every_version_in_order():
    """docs/versions.md lists the development versions in order, in its table and in its sections alike, and every
    page that gives their range ("v0-vN") names the first and the last."""
    text = (DOCS / "versions.md").read_text()
    sections = re.findall(r"^## (v\d+(?:\.\d+)?):", text, re.M)
    rows = re.findall(r"^\| (v\d+(?:\.\d+)?) \|", text, re.M)
    assert sections == sorted(sections, key=_version_key), sections
    assert rows == sections, (rows, sections)
    span = f"{sections[0]}-{sections[-1]}"
    for page in PAGES:
        for found in re.findall(r"\bv0-v\d+\b", page.read_text()):
            assert found == span, f"{page.relative_to(ROOT)} says {found}; docs/versions.md lists {span}"


def test_the_checks_can_fail():
    """Positive controls for the patterns and the slugs the tests above rely on."""
    for text in ("see issue 12", "issues #4 and #5", "(#13)", "this session's table", "in this round",
                 "/work/main/docs", "/tmp/site/x.py"):
        assert any(p.search(text) for p in ORGANISATION), text
    for text in ("round by round", "rounding", "[usage](usage.md#loading)", "#1f5fa8", "C = 0 drops nothing",
                 "{lambda()#1}::operator()"):
        assert not any(p.search(text) for p in ORGANISATION), text
    assert _slug("Training and torch.compile") == "training-and-torchcompile"
    assert _slug("Binned routing (MegaBlocks semantics)") == "binned-routing-megablocks-semantics"
    assert CITATION.findall("see [x](results/h200-bench-v6.json) and docs/results/tuning-NVIDIA_H200.json") == [
        "h200-bench-v6.json", "tuning-NVIDIA_H200.json"]
