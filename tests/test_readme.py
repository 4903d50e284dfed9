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


# --- every figure the README states is in the page or raw result its section cites ---------------
FIGURE = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+(?=\s?%)")
NOT_FIGURES = [
    re.compile(r"```.*?```", re.S),                    # commands
    re.compile(r"`[^`\n]*`"),                          # code, paths, flags
    re.compile(r"\]\([^)]*\)"),                        # link targets
    re.compile(r"\d+\.\d+\.\d+\w*"),                   # versions (torch 2.13.0)
    re.compile(r"arXiv \d+\.\d+|§[\d.]+|eq\. \d+"),    # the paper's numbers
]
UNCHECKED = {"Where each equation lives", "Files", "Citation"}  # no figures: equations, layout


def sections() -> dict[str, str]:
    """The README by `## ` heading; the text above the first is "intro"."""
    parts = re.split(r"^## (.+)$", README, flags=re.M)
    return {"intro": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def cited_text(section: str) -> str:
    """What a README section cites: the docs pages it links and the raw results it names under
    benchmarks/results/ (a file, or every file in a folder)."""
    texts = []
    for page in re.findall(r"\]\((docs/[\w.-]+\.md)\)", section):
        texts.append((ROOT / page).read_text())
    for path in re.findall(r"`(benchmarks/results/[^`\s]+)`", section):
        p = ROOT / path
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
        texts += [f.read_text(errors="replace") for f in files]
    return "\n".join(texts)


def without_non_figures(text: str) -> str:
    """`text` with what is not a figure blanked out: commands, code, link targets, versions."""
    for pattern in NOT_FIGURES:
        text = pattern.sub(" ", text)
    return text


def figures(section: str) -> list[str]:
    return FIGURE.findall(without_non_figures(section))


def test_every_readme_figure_is_in_what_its_section_cites():
    """A figure in the README (a decimal, a number with thousands separators, a percentage) must
    appear in a docs page its section links or a raw result it names: a number edited in one
    place and not the other, or one with no source, fails here. Small counts (steps, seeds, G)
    are settings, not figures, and are not checked."""
    missing, checked = [], 0
    for title, text in sections().items():
        if title in UNCHECKED:
            continue
        cited = cited_text(text)
        for fig in figures(text):
            checked += 1
            if not re.search(rf"(?<![\d.,]){re.escape(fig)}(?![\d]|[.,]\d)", cited):
                missing.append(f"{title}: {fig}")
    assert checked >= 40, checked
    assert not missing, "not in the pages or results their section cites: " + "; ".join(missing)


# --- every figure a docs page states is in a file the page names --------------------------------
# NOTE: model names are not figures (Qwen2.5-0.5B, SmolLM2-135M, 7B): digits glued to a name
MODEL_NAMES = re.compile(r"[A-Za-z][\w.]*\d[\w.]*(?:-[\d.]+[BMK]\b[\w-]*)*|\b[\d.]+ ?[BM]\b")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def named_sources(page: Path, root: Path = ROOT) -> str:
    """The text of every file a docs page names as its source: a path in backticks that exists in
    the repository (a raw result, a script, the code that sets a default; every file in a folder)
    or a link to a file outside docs/ (a notebook's committed outputs, a results README)."""
    text = page.read_text()
    paths = re.findall(r"`(?:\.\./)?([\w./*-]+)`", text)
    paths += [link.split("#")[0] for link in re.findall(r"\]\((\.\./[^)\s]+)\)", text)]
    files = set()
    for path in paths:
        p = ((page.parent / path) if path.startswith("..") else root / path).resolve()
        # NOTE: not outside the repository, not the whole of it, nothing hidden (.git, caches)
        if (not p.is_relative_to(root) or p == root or "**" in path
                or any(part.startswith(".") for part in p.relative_to(root).parts)):
            continue
        for q in (root.glob(path) if "*" in path else [p] if p.exists() else []):
            files.update([q] if q.is_file() else (f for f in q.rglob("*") if f.is_file()))
    docs = (root / "docs").resolve()
    # WHY only the repository's files, and no docs page: a figure copied from page to page, or
    #     found in some system file a page names (/proc/...), has no source
    return "\n".join(f.read_text(errors="replace") for f in sorted(files)
                      if docs not in f.resolve().parents)


def untraced_figures(page: Path, root: Path = ROOT) -> list[str]:
    """The figures on `page` that are in no file it names (named_sources): not as written, nor as
    one of its numbers rounded to the figure's decimals (a share also as a percentage: 0.527 for
    52.7%)."""
    text = without_non_figures(MODEL_NAMES.sub(" ", page.read_text()))
    source = named_sources(page, root)
    numbers = set()
    for n in NUMBER.findall(source):
        try:
            numbers.add(float(n.replace(",", "")))
        except ValueError:
            pass
    written = set(FIGURE.findall(source))
    rounded, missing = {}, []                      # rounded: (decimals, percent) -> numbers
    for m in FIGURE.finditer(text):
        figure = m.group()
        if figure in written:
            continue
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        value = float(figure.replace(",", ""))
        found = False
        for percent in (False, True) if text[m.end():m.end() + 1] == "%" else (False,):
            if (decimals, percent) not in rounded:
                rounded[decimals, percent] = {round(100 * x if percent else x, decimals)
                                              for x in numbers}
            found = found or value in rounded[decimals, percent]
        if not found:
            missing.append(figure)
    return missing


def test_every_docs_figure_is_in_a_file_its_page_names():
    """A figure on a docs page (a decimal, a number with thousands separators, a percentage) must
    be in a file that page names: a raw result under benchmarks/results/ (its README included,
    where the history of a number is kept), a notebook's committed outputs, or the code that sets
    a default; as written, or rounded from a number there. A figure edited on the page and not at
    its source, or one with no source, fails here."""
    missing = {page.name: untraced_figures(page) for page in sorted((ROOT / "docs").glob("*.md"))}
    missing = {name: figs for name, figs in missing.items() if figs}
    assert not missing, "figures with no source the page names: " + repr(missing)


def test_the_docs_trace_fails_on_a_figure_with_no_source(tmp_path):
    """The trace is not vacuous: a page that names a raw result traces what the result holds,
    rounded too, and not a figure the result lacks, nor a model's name as a figure."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text('{"ratio": 0.4663, "mb": 12972.9, "share": 0.527}')
    page = tmp_path / "page.md"
    page.write_text("Raw: `results/r.json`. Ours 0.47 of TRL's, 12,973 MB, 52.7% on Qwen2.5-0.5B; "
                    "and 0.48, 13,000 MB.")
    assert untraced_figures(page, tmp_path) == ["0.48", "13,000"]
    page.write_text("No source named: 0.47 of TRL's.")
    assert untraced_figures(page, tmp_path) == ["0.47"]


def test_ci_runs_exactly_the_readmes_install_and_test_commands():
    """What CI installs is what the README tells a newcomer to install: every `pip install` and
    `python -m pytest` line of the README's Tests section stands in .ci/run (as `python3 -m ...`),
    and .ci/run installs nothing else but torch, when it is missing (the quick start's line)."""
    block = re.search(r"## Tests.*?```bash\n(.*?)```", README, re.S).group(1)
    readme = [line.split("#")[0].split() for line in block.splitlines() if line.strip()]
    ci_text = (ROOT / ".ci" / "run").read_text()
    ci = [line.split() for line in ci_text.splitlines()
          if line.strip().startswith("python3 -m pip install")]
    installs = [words for words in readme if words[:2] == ["pip", "install"]]
    ci_installs = [[w for w in words[2:] if w != "--quiet"] for words in ci
                   if "torch==2.13.0" not in words]
    assert installs and ci_installs == installs, (ci_installs, installs)
    assert any(words[:3] == ["python", "-m", "pytest"] for words in readme)
    assert "python3 -m pytest" in ci_text


# --- the GRPO-against-PPO table, recomputed from its raw results ----------------------------------
COMPARED = {"GRPO": "grpo", "PPO + critic": "ppo", "PPO, critic at 10x lr": "ppo_critic_lr",
            "RLOO": "rloo", "REINFORCE": "reinforce"}  # the README's row: the runs' name


def test_grpo_against_ppo_recomputes_from_each_runs_summary():
    """The README's GRPO-against-PPO table from the raw summary.json of each seed's run in the
    folder its section names, not from the derived compare.md: each method's final accuracy
    (mean ± sample std over seeds), its lead over GRPO, its seconds per step (the summed step
    times over the steps), and the time ratio the text states. A figure with no raw source, or
    one edited in one place only, fails here."""
    import json
    import statistics
    part = sections()["Results"].split("### GRPO against PPO with a critic")[1].split("\n## ")[0]
    folder = ROOT / re.search(r"`(benchmarks/results/[^`]+)`", part).group(1)
    seeds = re.search(r"--seeds ([\d ]+)", part).group(1).split()
    per_step, accuracy = {}, {}
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = next((run for row, run in COMPARED.items() if cells[0].split(" (")[0] == row), None)
        if name is None:
            continue
        runs = [json.loads((folder / f"{name}-seed{s}.summary.json").read_text()) for s in seeds]
        acc = [100 * r["accuracy_after"] for r in runs]
        accuracy[name] = statistics.mean(acc)
        per_step[name] = statistics.mean(r["train_seconds"] / r["steps"] for r in runs)
        assert cells[1] == f"{accuracy[name]:.1f} ± {statistics.stdev(acc):.1f}", (name, cells)
        assert cells[3] == f"{per_step[name]:.2f}", (name, cells)
        lead = "—" if name == "grpo" else f"{accuracy[name] - accuracy['grpo']:+.1f} "
        assert cells[2].startswith(lead), (name, cells)
    assert sorted(per_step) == sorted(COMPARED.values())
    assert f"time, {per_step['grpo'] / per_step['ppo']:.2f} of PPO's" in part
