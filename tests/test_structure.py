"""The shape of the code, checked: grpo.py stays a one-sitting read and imports only the standard
library and torch, no line passes 100 columns, the project's imports run one way (grpo.py <-
machinery/ <- recipe/ <- the scripts) with no cycle, the top level shows the design, and the README
front page stays short.

Needs: nothing beyond the standard library. CPU, offline, under a second.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python_files(folder: Path) -> list[Path]:
    """The project's .py files below folder: hidden folders (.git, .cache, .venv) and any virtual
    environment (a folder holding pyvenv.cfg, whatever its name) left out. WHY: a newcomer's venv
    inside the checkout holds thousands of other projects' files, which are not this code."""
    files = []
    for p in sorted(folder.iterdir()):
        if p.is_dir() and not p.name.startswith(".") and not (p / "pyvenv.cfg").exists():
            files += python_files(p)
        elif p.is_file() and p.suffix == ".py":
            files.append(p)
    return files


SOURCES = python_files(ROOT)


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


GRPO_PY_CODE_LINES = 520
"""A tripwire, not an aim: the most lines holding code grpo.py may have. Plain beats short: a
passage written out in more lines is better than a dense one, so this only catches growth that
belongs in a module of its own."""


def body_lines(fn: ast.FunctionDef) -> int:
    """A function's length without its signature and docstring: from the first statement after
    the docstring to its last line."""
    body = fn.body
    if (len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    return fn.end_lineno - body[0].lineno + 1


def plainness_problems(tree: ast.Module) -> list[str]:
    """What makes a file harder to read than it should be: a function defined inside another
    function, a generator over 10 lines, a function body over 40 lines (docstring aside)."""
    problems = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        inner = [n.name for n in ast.walk(fn) if n is not fn and isinstance(n, ast.FunctionDef)]
        if inner:
            problems.append(f"{fn.name} defines {', '.join(inner)} inside it")
        length = fn.end_lineno - fn.lineno + 1
        if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(fn)) and length > 10:
            problems.append(f"{fn.name} is a generator of {length} lines")
        if body_lines(fn) > 40:
            problems.append(f"{fn.name}'s body has {body_lines(fn)} lines")
    return problems


def test_plainness_check_finds_planted_problems():
    """A nested function, a 12-line generator and a 41-line body are each named; a method in a
    class and a short generator are fine."""
    gen = "def g():\n" + "    x = 1\n" * 10 + "    yield x\n"
    long = 'def f():\n    """doc\n    string"""\n' + "    x = 1\n" * 41
    nested = "def outer():\n    def inner():\n        pass\n    return inner\n"
    fine = "class C:\n    def m(self):\n        yield 1\n"
    tree = ast.parse(gen + long + nested + fine)
    assert plainness_problems(tree) == ["g is a generator of 12 lines", "f's body has 41 lines",
                                        "outer defines inner inside it"]


def test_grpo_py_reads_in_one_sitting():
    """At most GRPO_PY_CODE_LINES code lines, at least 0.9 comment lines per code line, >= 6
    PAPER: tags; no function inside another, no generator over 10 lines, no function body over 40
    lines; only the three speed and memory seams; and it imports only the standard library and
    torch."""
    path = ROOT / "grpo.py"
    comment, code = line_kinds(path)
    assert len(code) <= GRPO_PY_CODE_LINES, f"grpo.py has {len(code)} code lines"
    assert len(comment) >= 0.9 * len(code), f"grpo.py: {len(comment)} comment, {len(code)} code"
    assert path.read_text().count("PAPER:") >= 6
    tree = ast.parse(path.read_text())
    assert plainness_problems(tree) == []
    seams = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Seams")
    fields = [n.target.id for n in seams.body if isinstance(n, ast.AnnAssign)]
    assert fields == ["sample", "score", "update"], fields
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


def module_of(path: Path) -> str:
    """A project file's module name: grpo, machinery.engine, benchmarks.vs_trl, ..."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


PROJECT = {module_of(p) for p in SOURCES if "tests" not in p.relative_to(ROOT).parts}


def imports_of(path: Path) -> set[str]:
    """The project modules a file imports, anywhere in it (inside functions too):
    `import grpo`, `from machinery import engine`, `from recipe.flags import InputError`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    if path.parent.name == "benchmarks":  # NOTE: the scripts there import each other by name
        found |= {f"benchmarks.{m}" for m in found}
    return found & PROJECT


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


def rank(module: str) -> int:
    """The import direction, grpo.py <- machinery <- recipe <- the scripts <- benchmarks: a module
    may import only modules of a lower rank, or of its own rank in its own folder. Rank 3 (the
    scripts) is imported by no module but a benchmark, which may build the recipe's own run to
    measure it (benchmarks/profile_preset.py); rank 4 (benchmarks) by none but each other."""
    if module in ("grpo", "rewards"):
        return 0
    if module.startswith("machinery.") or module in ("compare.baselines", "compare.ppo"):
        return 1
    if module.startswith("recipe."):
        return 2
    if module.startswith("benchmarks."):
        return 4
    return 3  # train_gsm8k, compare's scripts


def against_the_direction(graph: dict[str, set[str]]) -> list[str]:
    """Every import `a -> b` that runs against the direction."""
    def folder(m):
        return m.rpartition(".")[0]
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                  if not (rank(b) < rank(a) or (rank(b) == rank(a) and folder(a) == folder(b)
                                                 and (rank(a) < 3 or folder(a) == "benchmarks"))))


def test_the_direction_check_finds_planted_imports():
    """The machinery importing the recipe's support, grpo.py importing the machinery, a script
    imported by the recipe, and the machinery importing a compared method are each refused."""
    planted = {"machinery.lora": {"recipe.flags"}, "grpo": {"machinery.engine"},
               "recipe.gsm8k": {"train_gsm8k"}, "machinery.engine": {"compare.baselines"},
               "recipe.checkpoint": {"machinery.lora", "grpo", "recipe.flags"}}
    assert against_the_direction(planted) == [
        "grpo -> machinery.engine", "machinery.engine -> compare.baselines",
        "machinery.lora -> recipe.flags", "recipe.gsm8k -> train_gsm8k"]


def test_imports_run_one_way_and_form_no_cycle():
    """grpo.py <- machinery/ (and the compared methods) <- recipe/ <- the scripts <- benchmarks/:
    no import runs against that direction, none forms a cycle, and nothing but a benchmark imports
    train_gsm8k.py. Tests may import anything."""
    files = [p for p in SOURCES if "tests" not in p.relative_to(ROOT).parts]
    graph = {module_of(p): imports_of(p) - {module_of(p)} for p in files}
    assert graph["machinery.engine"] >= {"grpo"} and graph["recipe.checkpoint"] >= {"grpo"}
    assert against_the_direction(graph) == []
    assert cycle_in(graph) is None, f"import cycle: {' -> '.join(cycle_in(graph))}"


def test_the_top_level_shows_the_design():
    """The design's files, docs/ and benchmarks/, and three folders by role, each opening with a
    paragraph that says its role and what may import it."""
    import subprocess
    # NOTE: what git tracks, where it can tell: a user's own files (a log, runs/) are not the design
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    names = ({line.split("/")[0] for line in tracked.stdout.splitlines()} if tracked.returncode == 0
             and tracked.stdout else {p.name for p in ROOT.iterdir()})
    top = {n for n in names if not n.startswith(".") and n not in ("__pycache__", "runs")}
    assert top == {"README.md", "LICENSE", "grpo.py", "rewards.py", "train_gsm8k.py",
                   "requirements.txt", "requirements-dev.txt", "your_task",
                   "notebooks", "tests", "docs", "benchmarks", "machinery", "recipe", "compare",
                   "pytest.ini", "ruff.toml"}, top
    for folder in ("machinery", "recipe", "compare"):
        doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))
        assert doc and "May import:" in doc, folder


def test_the_checked_files_leave_out_hidden_folders_and_virtual_environments(tmp_path):
    """A venv in the checkout, named .venv or anything else, is not checked as the project's code
    (a fresh clone with its venv inside once collected 14,093 tests here)."""
    for path in ("a.py", "pkg/b.py", ".venv/lib/c.py", "env/lib/d.py", "env/pyvenv.cfg"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert [p.relative_to(tmp_path).as_posix() for p in python_files(tmp_path)] == ["a.py",
                                                                                     "pkg/b.py"]


def test_the_front_page_stays_short():
    assert len((ROOT / "README.md").read_text()) <= 15_000


def test_each_docs_page_is_read_in_one_sitting_and_opens_with_its_answer():
    """Each page under docs/ but the reference.md lookup table is under 1,500 words, and within
    its first 40 lines shows a table, a command or a list: a reader who stops after the first
    screen has what they came for."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        if page.name != "reference.md":
            assert len(text.split()) < 1500, (page.name, len(text.split()))
        first = text.splitlines()[:40]
        assert any(re.match(r"\||```|    \S|- |\d+\. ", line) for line in first), page.name


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if "tests" not in p.parts], ids=lambda p: p.name
)
def test_every_module_opens_with_a_docstring(path):
    assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name} has no module docstring"
