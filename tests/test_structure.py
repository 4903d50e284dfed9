"""The shape of the code, checked: grpo.py stays a one-sitting read, no line passes 100 columns, the
project's imports form no cycle and never reach into the train_gsm8k.py script, and the README front
page stays short.

Needs: nothing beyond the standard library. CPU, offline, under a second.
"""

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for p in ROOT.rglob("*.py") if ".git" not in p.parts and ".cache" not in p.parts)
MODULES = {p.stem: p for p in ROOT.glob("*.py")}  # the flat, importable top level


def line_kinds(path: Path) -> tuple[set[int], set[int]]:
    """(comment lines, code lines) of a Python file. A comment line holds only a comment or is part
    of a docstring (a string standing alone as a statement); a code line is any other non-blank
    line."""
    text = path.read_text()
    docstring = set()
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docstring |= set(range(node.lineno, node.end_lineno + 1))
    code, comment = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comment.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code |= set(range(tok.start[0], tok.end[0] + 1))
    code -= docstring
    return (comment - code) | docstring, code


def test_line_kinds_on_a_hand_written_file(tmp_path):
    """Lines 1-3 docstring, 4 a comment, 5 code with a trailing comment, 6 blank, 7-8 code."""
    f = tmp_path / "x.py"
    f.write_text('"""doc\nmore\n"""\n# a comment\nx = 1  # shape\n\ny = (2,\n     3)\n')
    assert line_kinds(f) == ({1, 2, 3, 4}, {5, 7, 8})


GRPO_PY_CODE_LINES = 450
"""The most lines holding code grpo.py may have. NOTE: the aim is 330; grpo.py now carries its own
KV-cache sampler, tokenizer plumbing and DAPO's merge, which engine.py held before, so it is not
there yet (docs/known_limits.md). Shorter by moving things out, never by packing lines."""


def test_grpo_py_reads_in_one_sitting():
    """At most GRPO_PY_CODE_LINES code lines, at least one comment line per code line, >= 6 PAPER:
    tags, no function over 50 lines, and it imports only the standard library and torch."""
    path = ROOT / "grpo.py"
    comment, code = line_kinds(path)
    assert len(code) <= GRPO_PY_CODE_LINES, f"grpo.py has {len(code)} code lines"
    assert len(comment) >= len(code), f"grpo.py: {len(comment)} comment lines for {len(code)} code"
    assert path.read_text().count("PAPER:") >= 6
    tree = ast.parse(path.read_text())
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 50]
    assert not long, f"functions over 50 lines: {long}"
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    import sys
    assert imported - set(sys.stdlib_module_names) - {"__future__"} == {"torch"}, imported


def test_no_line_is_longer_than_100_columns():
    long = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 100]
    assert not long, f"lines over 100 columns: {long[:10]}"


def imports_of(path: Path) -> set[str]:
    """The project modules a file imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(MODULES)


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None. Depth-first search with three colours."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_imports_form_no_cycle_and_nothing_imports_the_script():
    """Library modules and the other scripts (benchmarks included) never import train_gsm8k.py, and
    no chain of imports leads back to where it started. Tests may import anything."""
    files = [p for p in SOURCES if "tests" not in p.relative_to(ROOT).parts]
    graph = {p.stem: imports_of(p) - {p.stem} for p in files if p.parent == ROOT}
    assert cycle_in(graph) is None, f"import cycle: {' -> '.join(cycle_in(graph))}"
    users = [str(p.relative_to(ROOT)) for p in files if "train_gsm8k" in imports_of(p)]
    assert not users, f"these import the train_gsm8k.py script: {users}"


def test_the_front_page_stays_short():
    assert len((ROOT / "README.md").read_text()) <= 15_000


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if "tests" not in p.parts], ids=lambda p: p.name
)
def test_every_module_opens_with_a_docstring(path):
    assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name} has no module docstring"
