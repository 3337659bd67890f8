"""The README is an entry point: short, and every link in it and in docs/ leads to a file of this repository.

A link is a markdown `[text](target)` or a reference definition `[label]: target` outside code. Its target must be
a relative path that stays inside the repository root and names an existing file; a `#anchor` must name a heading
of that file (GitHub's slugs). URLs (`scheme://`) are refused anywhere outside code, linked or bare: the docs are
read with the repository alone.
"""

import collections
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_WORDS = 2000

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_INLINE = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, _CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces → '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text; repeated headings get GitHub's -1, -2 … suffixes."""
    seen, out = collections.Counter(), set()
    for _, line in _prose(text):
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def link_errors(text: str, where: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Every link of `text` (the page at `where`) that does not resolve to a file inside `root`, by line."""
    errors = []
    for number, line in _prose(text):
        targets = _INLINE.findall(line) + _REFERENCE.findall(line)
        for target in targets:
            error = _target_error(target, text, where, root)
            if error:
                errors.append(f"{where.name}:{number}: ({target}) {error}")
        bare = _URL.search(_INLINE.sub("", _REFERENCE.sub("", line)))
        if bare:
            errors.append(f"{where.name}:{number}: a URL ({bare.group(0)}…): the docs link inside the repository only")
    return errors


def _target_error(target: str, text: str, where: pathlib.Path, root: pathlib.Path) -> str | None:
    if not target:
        return "empty target"
    if _URL.match(target) or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target):
        return "links outside the repository: name the project in plain text instead"
    path, _, anchor = target.partition("#")
    if path.startswith("/"):
        return "absolute path: use a path relative to the page"
    if not path:  # an anchor of this page
        return None if anchor in anchors(text) else f"no heading with anchor #{anchor} on this page"
    file = (where.parent / path).resolve()
    if not file.is_relative_to(root.resolve()):
        return "leaves the repository root"
    if not file.is_file():
        return "no such file in the repository"
    if anchor:
        if file.suffix != ".md":
            return "an anchor into a file that is not markdown"
        if anchor not in anchors(file.read_text(encoding="utf-8")):
            return f"no heading with anchor #{anchor} in {file.name}"
    return None


_DOCS_REFERENCE = re.compile(r'\bdocs/([\w.-]+\.md)(?:,\s*"([^"]+)")?')
SOURCES = sorted(p for package in ("csa2", "pallas_kernels", "train", "infer", "experiments", "tests")
                 for p in (ROOT / package).rglob("*.py") if p != pathlib.Path(__file__).resolve())  # not the mutants


def reference_errors(text: str, where: str, root: pathlib.Path = ROOT) -> list[str]:
    """Every `docs/PAGE.md` (optionally followed by `, "Heading"`) that names a missing page or heading."""
    errors = []
    for m in _DOCS_REFERENCE.finditer(text):
        page, heading = root / "docs" / m.group(1), m.group(2)
        if not page.is_file():
            errors.append(f"{where}: {m.group(0)}: no such page")
        elif heading and slug(heading) not in anchors(page.read_text(encoding="utf-8")):
            errors.append(f"{where}: {m.group(0)}: no such heading in {page.name}")
    return errors


def test_code_points_at_docs_sections_that_exist():
    """Comments and docstrings cite a docs page and its heading, e.g. (docs/results.md, "The read budget")."""
    errors = [e for p in SOURCES for e in reference_errors(p.read_text(encoding="utf-8"), p.relative_to(ROOT))]
    assert errors == []


def test_the_reference_checker_reports_planted_references():
    assert reference_errors('see (docs/results.md, "The read budget") and docs/model.md', "x.py") == []
    assert len(reference_errors('see (docs/results.md, "The reading budget")', "x.py")) == 1
    assert len(reference_errors("see docs/no-such-page.md", "x.py")) == 1


def test_the_docs_exist():
    assert (ROOT / "README.md").is_file()
    assert len(PAGES) > 2, "docs/ holds the pages the README links to"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_link_resolves_inside_the_repository(page):
    assert link_errors(page.read_text(encoding="utf-8"), page) == []


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / t.partition("#")[0]).resolve() for _, line in _prose(readme) for t in _INLINE.findall(line)}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


def test_readme_is_short():
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words < README_MAX_WORDS, f"README.md has {words} words: move detail into docs/"


def test_the_checker_reports_planted_bad_links():
    """Mutants: each planted link must be reported; links that resolve, and code, must not be."""
    page = ROOT / "docs" / "planted.md"
    good = ("# Title\n\n## A section\n\n[ok](../README.md) [ok](model.md) [self](#a-section) "
            "[anchor](../README.md#the-two-commands)\n\n```\n[code](nowhere.md) https://example.org\n```\n"
            "`[span](nowhere.md)`\n")
    assert link_errors(good, page) == []
    planted = {
        "[gone](no-such-page.md)": "no such file",
        "[spec](../../shared/SPEC.md)": "leaves the repository root",
        "[web](https://github.com/x/y)": "outside the repository",
        "[abs](/etc/passwd)": "absolute path",
        "[anchor](../README.md#no-such-heading)": "no heading",
        "[self](#missing)": "no heading",
        "[dir](../csa2)": "no such file",
        "[ref]: ../../shared/DESIGN.md": "leaves the repository root",
        "see https://example.org for more": "a URL",
    }
    for line, reason in planted.items():
        errors = link_errors(good + line + "\n", page)
        assert len(errors) == 1 and reason in errors[0], (line, errors)


def test_slugs_follow_github():
    assert slug("Where each SPEC section lives") == "where-each-spec-section-lives"
    assert slug("Kernels (`pallas_kernels`)") == "kernels-pallas_kernels"
    assert slug("What 4× would take") == "what-4-would-take"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
