"""README.md's equation table points at the line of grpo.py that holds each equation, and names
tests that exist. Needs nothing. Instant. On failure it prints the line the equation is really
on."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(
    r"^\| `(?P<eq>[^`]+)`.*?\| \[L(?P<line>\d+)\]\(grpo\.py#L(?P=line)\) \| (?P<tests>.+) \|$"
)


def table_rows():
    rows = [ROW.match(line) for line in (ROOT / "README.md").read_text().splitlines()]
    return [r for r in rows if r]


def test_each_equation_is_on_the_line_the_readme_names():
    grpo_lines = (ROOT / "grpo.py").read_text().splitlines()
    rows = table_rows()
    assert len(rows) >= 8
    for r in rows:
        eq = r["eq"].replace("\\|", "|")
        n = int(r["line"])
        actually = [i + 1 for i, line in enumerate(grpo_lines) if eq in line]
        assert eq in grpo_lines[n - 1], f"{eq!r} is not on grpo.py line {n}; it is on {actually}"


def test_each_named_test_exists():
    sources = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for r in table_rows():
        for name in re.findall(r"`(test_\w+)", r["tests"]):
            assert f"def {name}(" in sources, name
