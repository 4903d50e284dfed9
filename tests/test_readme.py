"""README.md's equation table names, for each equation, the grpo.py function whose source holds it,
and tests that exist; every page under docs/ is linked from the README, and every link to a local
file points at one that exists. Needs nothing. Instant. On failure it says where the equation is.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
ROW = re.compile(r"^\| `(?P<eq>[^`]+)`.*?\| `(?P<fn>\w+)` \| (?P<tests>.+) \|$")


def table_rows():
    return [m for m in map(ROW.match, README.splitlines()) if m]


def function_sources() -> dict[str, str]:
    """grpo.py's top-level functions and classes by name, each as its source text (comments and
    docstring included)."""
    text = (ROOT / "grpo.py").read_text()
    lines = text.splitlines()
    return {n.name: "\n".join(lines[n.lineno - 1:n.end_lineno]) for n in ast.parse(text).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_each_equation_is_in_the_function_the_readme_names():
    sources = function_sources()
    rows = table_rows()
    assert len(rows) >= 10
    for r in rows:
        eq, fn = r["eq"].replace("\\|", "|"), r["fn"]
        assert fn in sources, f"grpo.py has no function {fn}"
        where = [name for name, src in sources.items() if eq in src]
        assert eq in sources[fn], f"{eq!r} is not in {fn}; it is in {where}"


def test_each_named_test_exists():
    sources = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for r in table_rows():
        for name in re.findall(r"`(test_\w+)", r["tests"]):
            assert f"def {name}(" in sources, name


def test_every_docs_page_is_linked_and_every_local_link_resolves():
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)\)", README))
    assert pages and pages == linked, f"not linked: {pages - linked}; missing: {linked - pages}"
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_reference_lists_every_grpo_config_field_and_no_other():
    """docs/reference.md's defaults table names every GRPOConfig field in its own row, and no row
    names a field that does not exist (it once listed top_k and top_p, and left out five)."""
    import dataclasses
    import re

    import grpo
    text = (ROOT / "docs" / "reference.md").read_text()
    start = text.index("\n", text.index("| `GRPOConfig` field | default | source |"))
    rows = re.findall(r"^\| `(\w+)`", text[start:text.index("\n\n", start)], re.M)
    fields = [f.name for f in dataclasses.fields(grpo.GRPOConfig)]
    assert sorted(rows) == sorted(fields)
