"""Every notebook in notebooks/ runs headless, top to bottom, without a cell error, and its
committed copy carries its plots.

Needs: nbclient, nbformat, ipykernel (requirements.txt). Runs each notebook with
GRPO_NOTEBOOK_QUICK=1 (a weaker, faster model; the committed outputs come from the full run) and the
warm-start cache in a temporary folder. CPU, offline, about a minute per notebook.
"""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_headless(path, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors
    if path.name == "06_limits_and_risks.ipynb":   # its four lines, from this quick run
        printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                          for o in c.get("outputs", []))
        limits_lines(printed, quick=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_notebook_shows_its_plots_and_ends_with_a_checked_exercise(path):
    nb = nbformat.read(path, as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} was committed without its plot outputs"
    assert nb.cells[0].cell_type == "markdown" and "What you will learn" in nb.cells[0].source
    (exercise,) = [c for c in nb.cells if c.cell_type == "code" and "def check(" in c.source]
    # An exercise shows a hint, not its answer: the committed run prints only the request to
    # answer (a self-check that printed "Right: 1.4997" gave the answer away)
    printed = "".join(o.get("text", "") for o in exercise.get("outputs", []))
    assert printed.strip() == "Replace None with your answer and run this cell again.", printed
    # and its checker is checked, silently, against a right answer worked out independently and
    # against a plausible wrong one
    assert "assert is_right(" in exercise.source and "not is_right(" in exercise.source
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                if o.output_type == "error"]


NOTES = NOTEBOOKS[0].parent                                 # notebooks/
PAGE = NOTES.parent / "docs" / "notebooks.md"               # the page that quotes their outputs


def printed_by(name: str) -> str:
    """Everything the committed copy of notebooks/<name> printed, its cells' text outputs joined."""
    return "".join(o.get("text", "") for c in nbformat.read(NOTES / name, as_version=4).cells
                   if c.cell_type == "code" for o in c.get("outputs", []))

def test_the_one_update_notebook_shows_grpos_idea_and_its_page_quotes_it():
    """notebooks/00_one_update.ipynb's committed run prints its two lines: the loss built by hand
    equal to grpo_loss's, and a correlation between A_i and Δ log π(o_i) that is positive and
    large (GRPO's one claim, in one update); docs/notebooks.md quotes that very correlation."""
    import re
    printed = printed_by("00_one_update.ipynb")
    hand = re.search(r"built by hand: loss = (\S+), grpo_loss = (\S+)", printed)
    assert hand and hand.group(1) == hand.group(2)
    corr = re.search(r"one update: corr\(A_i, Δ log π\(o_i\)\) = ([+-][\d.]+) over G = 8 "
                     r"completions", printed)
    assert corr and float(corr.group(1)) > 0.5, printed
    page = PAGE.read_text()
    assert f"corr(A_i, Δ log π(o_i)) = {corr.group(1)} over G = 8" in page
    # and the page's other two numbers: the pull back, and the tokens the clip stopped
    back = re.search(r"of this one\) = ([+-][\d.]+)", printed).group(1)
    assert float(back) < 0 and f"(corr {back} with the first update's change)" in page
    clip = re.search(r"the clip binds on (\d+ of \d+) tokens", printed).group(1)
    assert f"the clip binds on {clip} tokens" in page


def test_the_advantages_notebook_quotes_its_own_numbers():
    """docs/notebooks.md's headline for notebook 01 (the expected share of silent groups at G = 8
    and G = 64) is what the committed run printed, rounded to a percent."""
    import ast
    import re
    printed = printed_by("01_group_advantages.ipynb")
    shares = ast.literal_eval(re.search(r"\{2: [^}]*\}", printed).group(0))
    page = PAGE.read_text()
    assert (f"an expected {100 * shares[8]:.0f}% of groups of G = 8" in page
            and f"G = 64 would leave {100 * shares[64]:.0f}%" in page)


def test_the_ppo_notebook_quotes_its_own_numbers():
    """docs/notebooks.md's headline for notebook 05 (each method's held-out accuracy, the warm
    start's, each method's seconds a step for GRPO and PPO) is what the committed run printed."""
    import re
    printed = printed_by("05_grpo_vs_ppo.ipynb")
    acc = dict(re.findall(r"^\s*(GRPO|PPO|RLOO|REINFORCE)(?: \+ critic)?: held-out accuracy "
                          r"([\d.]+)%", printed, re.M))
    secs = dict(re.findall(r"^\s*(GRPO|PPO)(?: \+ critic)?: held-out accuracy [\d.]+% after \d+ "
                           r"steps, ([\d.]+) s per step", printed, re.M))
    warm = re.search(r"warm start: ([\d.]+)% on the same", printed).group(1)
    page = PAGE.read_text()
    quoted = (f"GRPO {acc['GRPO']}%, PPO {acc['PPO']}%, RLOO {acc['RLOO']}%, REINFORCE "
              f"{acc['REINFORCE']}% (warm start {warm}%); PPO took {secs['PPO']} s a step against "
              f"GRPO's {secs['GRPO']}")
    assert quoted in page, quoted
    v, mean, corr = re.search(r"critic V\(s_0\): mean ([\d.]+), spread [\d.]+; group mean reward: "
                              r"mean ([\d.]+), spread [\d.]+; correlation ([+-][\d.]+)",
                              printed).groups()
    assert f"averaged {v} against a mean reward of {mean}, correlation {corr}" in page


def test_the_policy_notebook_quotes_its_own_numbers():
    """docs/notebooks.md's headline for notebook 02 (the ratio's range in the second updates, the
    share of tokens clipped, where the largest move sits) is what the committed run printed."""
    import re
    printed = printed_by("02_how_the_policy_changes.ipynb")
    low, high, share = re.search(r"ratio range ([\d.]+) \.\. ([\d.]+); tokens clipped overall: "
                                 r"([\d.]+)", printed).groups()
    page = PAGE.read_text()
    assert (f"the ratio ranged from {low} to {high}, yet the clip bound on only "
            f"{100 * float(share):.2f}% of tokens") in page
    assert re.search(r"the largest move: [+-][\d.]+ on '\d', after '[^']*#### '", printed)


def test_the_pass_at_k_and_memory_notebooks_quote_their_own_numbers():
    """Notebook 04's text and docs/notebooks.md quote the Maj@64, Pass@1 and Pass@64 changes its
    committed run printed; docs/notebooks.md quotes notebook 03's measured memory ratios."""
    import re
    printed = printed_by("04_what_rl_improves.ipynb")
    one, pass64, maj64 = re.search(r"Pass@1 by \+?([-\d.]+) points, Pass@64 by \+?([-\d.]+) points "
                                   r"and Maj@64 by \+?([-\d.]+) points", printed).groups()
    text = "".join(c.source for c in nbformat.read(NOTES / "04_what_rl_improves.ipynb",
                                                   as_version=4).cells
                   if c.cell_type == "markdown")
    page = PAGE.read_text()
    quoted = f"Maj@64 rose {maj64} points, Pass@1 {one}"
    assert quoted in " ".join(text.split()) and quoted in page
    assert f"Pass@64 {pass64} (from" in " ".join(text.split()) and f"Pass@64 {pass64} (from" in page
    printed = printed_by("03_why_no_critic.ipynb")
    grpo_ppo, with_rm = re.search(r"peaked at (\d+)% of PPO's \(rule-based reward\), "
                                  r"(\d+)% of PPO's", printed).groups()
    assert (f"peaked at {grpo_ppo}% of the PPO update's memory ({with_rm}% against PPO with a "
            f"reward model)") in page


NUMBER = r"([+-]?\d+(?:\.\d+)?)"


def limits_lines(printed: str, quick: bool = False) -> dict:
    """The four lines notebook 06 prints, parsed and checked for consistency, never for outcome
    (the science decides that): accuracies are percentages, KLs are not negative, rewards are
    shares, zero-signal shares are percentages, the three parts of a step add up to 100% and its
    seconds are positive. quick: a pool the weak QUICK model left empty prints n/a. Returns the
    values by name."""
    import re
    n = NUMBER
    brakes = re.search(rf"^brakes on: held-out {n} -> {n}, KL {n}; brakes off: held-out {n} -> "
                       rf"{n}, KL {n}$", printed, re.M)
    assert brakes, "the brakes line is missing"
    on0, on1, kl_on, off0, off1, kl_off = map(float, brakes.groups())
    assert all(0 <= a <= 100 for a in (on0, on1, off0, off1)) and on0 == off0  # the same start
    assert kl_on >= 0 and kl_off >= 0
    game = re.search(rf"^gameable reward: {n} -> {n}; strict accuracy of the same samples: {n} -> "
                     rf"{n}$", printed, re.M)
    assert game, "the gameable-reward line is missing"
    g0, g1, s0, s1 = map(float, game.groups())
    assert all(0 <= x <= 1 for x in (g0, g1, s0, s1))
    # WHY: every strictly right answer holds its gold number, so the substring reward pays at
    #      least what the strict check pays, on the same samples
    assert g0 >= s0 and g1 >= s1
    value = r"(\d+%|n/a)" if quick else r"(\d+%)"
    gain = rf"({n[1:-1]}|n/a)" if quick else n
    pools = re.search(rf"^zero-signal groups: too easy {value}, too hard {value}, mixed {value}; "
                      rf"held-out gain: too easy {gain}, too hard {gain}, mixed {gain}$",
                      printed, re.M)
    assert pools, "the zero-signal line is missing"
    shares = [float(x[:-1]) for x in pools.groups()[:3] if x != "n/a"]
    gains = [float(x) for x in pools.groups()[3:] if x != "n/a"]
    assert all(0 <= x <= 100 for x in shares) and all(-100 <= x <= 100 for x in gains)
    assert [x == "n/a" for x in pools.groups()[:3]] == [x == "n/a" for x in pools.groups()[3:]]
    step = re.search(rf"^one step at G = 8: sampling {n}%, scoring {n}%, update {n}% of {n} s$",
                     printed, re.M)
    assert step, "the step-split line is missing"
    *parts, total = map(float, step.groups())
    assert abs(sum(parts) - 100) <= 1.5 and all(x >= 0 for x in parts) and total > 0  # rounding
    return dict(brakes=brakes.groups(), game=game.groups(), pools=pools.groups(),
                step=step.groups())


def test_the_limits_notebook_prints_its_four_lines_and_its_page_quotes_them():
    """notebooks/06_limits_and_risks.ipynb's committed (full-setting) run printed its four lines,
    each consistent (limits_lines) and with every pool filled; docs/notebooks.md quotes each one
    whole, and each part's seconds, every part within the 3 minutes it is allowed."""
    import re
    printed = printed_by("06_limits_and_risks.ipynb")
    limits_lines(printed)
    page = " ".join(PAGE.read_text().split())
    for prefix in ("brakes on: held-out", "gameable reward:", "zero-signal groups:",
                   "one step at G = 8:"):
        line = re.search(rf"^{re.escape(prefix)}.*$", printed, re.M).group(0)
        assert f"`{line}`" in page, line
    seconds = dict(re.findall(r"^part (\d) took (\d+) s$", printed, re.M))
    assert sorted(seconds) == ["1", "2", "3", "4"]
    assert all(int(s) <= 180 for s in seconds.values()), seconds
    quoted = " | ".join(seconds[k] for k in "1234")
    assert f"| seconds | {quoted} |" in page


def test_the_limits_lines_check_fails_on_inconsistent_values():
    """limits_lines catches what it is for: a negative KL, shares that do not add up, a strict
    accuracy above the substring reward of the same samples, and n/a outside quick mode."""
    good = ("brakes on: held-out 42.7 -> 68.0, KL 0.021; "
            "brakes off: held-out 42.7 -> 48.7, KL 0.134\n"
            "gameable reward: 0.66 -> 0.73; strict accuracy of the same samples: 0.46 -> 0.37\n"
            "zero-signal groups: too easy 78%, too hard 58%, mixed 17%; "
            "held-out gain: too easy +2.7, too hard +18.7, mixed +24.0\n"
            "one step at G = 8: sampling 61%, scoring 12%, update 27% of 1.43 s\n")
    limits_lines(good)
    for bad in (good.replace("KL 0.134", "KL -0.134"), good.replace("update 27%", "update 37%"),
                good.replace("0.46 -> 0.37", "0.96 -> 0.37"),
                good.replace("too easy 78%", "too easy n/a")):
        with pytest.raises(AssertionError):
            limits_lines(bad)
    quick = good.replace("too easy 78%", "too easy n/a").replace("too easy +2.7", "too easy n/a")
    limits_lines(quick,
                 quick=True)
