"""Every image and relative link in README.md, bench/README.md and docs/*.md points at a file of the repository (and a
heading there); no page speaks of how the project's own work is planned."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)
_CODE_SPAN = re.compile(r"(`+).+?\1", flags=re.S)
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", flags=re.M)
_HTML = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", flags=re.I)


def targets(text: str) -> list[str]:
    """Link and image targets of a Markdown text, outside code blocks and code spans."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    return [m.group(1) for pattern in (_INLINE, _REFERENCE, _HTML) for m in pattern.finditer(text)]


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", text), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_link_finder_sees_links_images_and_references_but_not_code():
    text = (
        '![plot](docs/demo.png) [a](x.md#part "title")\n[b]: ref.md\n<img src="pic.png">\n'
        "`[no](skip.md)`\n```\n[no](skip2.md)\n```\n[web](https://example.org)"
    )
    assert targets(text) == ["docs/demo.png", "x.md#part", "https://example.org", "ref.md", "pic.png"]
    assert anchors("# Set up\n## GaLore: low-rank gradient projection\n") == {
        "set-up",
        "galore-low-rank-gradient-projection",
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_resolve(page):
    broken = []
    for target in targets(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or ROOT not in file.parents:
            broken.append(f"{target}: no such file in the repository")
        elif fragment and file.suffix == ".md" and fragment.lower() not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_demo_image_is_a_small_png():
    png = ROOT / "docs" / "demo.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000


#: how the project's own work is organised, which user-facing pages do not describe: issue numbers, work sessions,
#: machines lent for a time ("issue" as in a GPU issuing instructions is fine)
_INTERNAL = re.compile(
    r"\bissues? #?\d+(?:'s|,| and\b| or\b|\)|\.)|\bissue #\d|\bissues'|"
    r"\b(?:the|this|an|open) issues?\b(?!\s+(?:budget|order|slots?|rate|width))|"
    r"\bsessions?\b|\blease\b|\blent\b|\bdevice tool\b",
    flags=re.I,
)


def test_the_internal_word_finder():
    assert _INTERNAL.search("decide issue 17's targets") and _INTERNAL.search("on a lent GPU: the lease plan")
    assert _INTERNAL.search("a GPU session puts in its closing note") and _INTERNAL.search("the issues' targets")
    assert _INTERNAL.search("issues 15, 16 and 17") and _INTERNAL.search("the 0.0385 of the issue is")
    assert _INTERNAL.search("Measured on the issue's MLP") and _INTERNAL.search("see issue #36")
    assert not _INTERNAL.search("the issue budget: an H100 SM issues 128 thread instructions; a tile issues 8 loads")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_describe_the_project_not_how_its_work_is_planned(page):
    found = [m.group(0) for m in _INTERNAL.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)} speaks of the project's own work: {found}"


#: the scripts a user runs, whose help text, docstrings, comments and printed lines speak to that user too
SCRIPTS = [ROOT / "scripts" / "gpu-check", ROOT / "scripts" / "gpu-wheels", *sorted((ROOT / "bench").glob("*.py"))]
#: in a script, "issue N" is a numbered issue whatever follows it (a printed label "issue 17: ...") ("an SM issues 4
#: warp instructions" is the GPU's)
_INTERNAL_IN_SCRIPTS = re.compile(_INTERNAL.pattern + r"|\bissue #?\d", flags=re.I)


def test_the_internal_word_finder_in_scripts():
    assert _INTERNAL_IN_SCRIPTS.search("- issue 17: lowmemopt-adamw-8bit opt.step() <= 1.0x torch-adamw-fused")
    assert _INTERNAL_IN_SCRIPTS.search("Targets (the issues', on opt.step())")
    assert _INTERNAL_IN_SCRIPTS.search("on a short GPU lease") and _INTERNAL_IN_SCRIPTS.search("the device tool: 600 s")
    assert _INTERNAL_IN_SCRIPTS.search("the lent H100/H200 image")
    assert not _INTERNAL_IN_SCRIPTS.search("issue-bound above 9 x B instructions; the issue budget; issue order")
    assert not _INTERNAL_IN_SCRIPTS.search("An H100 SM issues 4 warp instructions (128 thread instructions) per clock")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_describe_the_project_not_how_its_work_is_planned(script):
    found = [m.group(0) for m in _INTERNAL_IN_SCRIPTS.finditer(script.read_text())]
    assert not found, f"{script.relative_to(ROOT)} speaks of the project's own work: {found}"


# ---------------------------------------------------------------------------------------------------------------------
# README's CPU speed figures are bench/README.md's latest measurement, not a copy that drifts

_LATEST = "<!-- cpu-step-latest"


def _table_after_marker(text: str, page: str) -> tuple[str, list[str], dict[str, list[str]]]:
    """(the prose between the marker and the table, the header cells, {first cell: cells}) of the Markdown table that
    follows the ``cpu-step-latest`` marker; cells without ``**`` bold."""
    assert text.count(_LATEST) == 1, f"{page}: expected one {_LATEST} marker"
    lines = text[text.index(_LATEST) :].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")])
    return "\n".join(lines[:start]), rows[0], {row[0]: row for row in rows[2:]}


def _measured_on(prose: str, page: str) -> str:
    dates = re.findall(r"measured (\d{4}-\d{2}-\d{2})", prose)
    assert len(dates) == 1, f"{page}: the latest CPU table's text must say 'measured YYYY-MM-DD' once, found {dates}"
    return dates[0]


def check_readme_quotes_latest(readme: str, bench: str) -> None:
    """README's table after the marker: its columns are bench's, its rows bench's rows, cell for cell, and its text
    names the same date of measurement."""
    prose, head, rows = _table_after_marker(readme, "README.md")
    bench_prose, bench_head, bench_rows = _table_after_marker(bench, "bench/README.md")
    assert _measured_on(prose, "README.md") == _measured_on(bench_prose, "bench/README.md")
    assert rows, "README.md: the quoted table has no rows"
    missing = [h for h in head if h not in bench_head]
    assert not missing, f"README.md quotes columns bench/README.md's latest table does not have: {missing}"
    for name, row in rows.items():
        assert name in bench_rows, f"README.md quotes a row bench/README.md's latest table does not have: {name}"
        theirs = {h: bench_rows[name][bench_head.index(h)] for h in head}
        assert dict(zip(head, row)) == theirs, f"README.md's {name} row differs from bench/README.md's latest: {theirs}"


def test_readme_speed_table_is_bench_readmes_latest():
    check_readme_quotes_latest((ROOT / "README.md").read_text(), (ROOT / "bench" / "README.md").read_text())


def test_the_speed_table_check_catches_drift():
    readme, bench = (ROOT / "README.md").read_text(), (ROOT / "bench" / "README.md").read_text()
    row = next(
        line for line in readme[readme.index(_LATEST) :].splitlines() if line.startswith("| lowmemopt-adamw-8bit")
    )
    drifted = [
        readme.replace(row, row.replace("x;", "5x;", 1)),  # a ratio changed
        readme.replace("| lowmemopt-adamw-8bit", "| lowmemopt-adamw-3bit"),  # a row bench does not have
        re.sub(r"(?s)(cpu-step-latest.*?measured \d{4}-\d{2}-)\d{2}", r"\g<1>01", readme),
    ]  # another date
    for text in drifted:
        assert text != readme
        with pytest.raises(AssertionError):
            check_readme_quotes_latest(text, bench)
