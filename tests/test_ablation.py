"""ablation.py end to end on tiny settings: every variant (and the supervised control) runs for 2
seeds, and the table and plot come out. The full-size numbers in the README come from the same
script.

Needs: torch, transformers, matplotlib. CPU, offline; the warm start (5 supervised steps) goes to a
temporary cache. About a minute.
"""

import json

import pytest

from compare import ablation


@pytest.mark.slow
def test_every_variant_runs_and_the_table_and_plot_come_out(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "ablation"
    stats = ablation.main(["--seeds", "0", "1", "--steps", "2", "--eval-size", "4", "--jobs", "2",
                           "--out", str(out),
                           "--", "--warm-start-steps", "5", "--prompts-per-step", "2",
                           "--group-size", "4",
                           "--max-new-tokens", "16"])
    default = [v for v in ablation.VARIANTS if v not in ablation.COMPARE[1:]]
    assert list(stats) == default and "cispo_mu2" in default
    table = (out / "ablation.md").read_text()
    for name in default:
        assert f"| {name} |" in table
        for seed in (0, 1):
            assert (out / f"{name}-seed{seed}" / "summary.json").exists()
    assert "spread" in table and (out / "ablation.png").stat().st_size > 5_000
    # The control's budget is the same seed's grpo time in grpo_step, spent on supervised steps
    # instead. (Its own seconds reach the budget by its loop's construction: not checked here.)
    for seed in (0, 1):
        control = json.loads((out / f"sft_control-seed{seed}" / "summary.json").read_text())
        grpo_time = ablation.run_stats(out / f"grpo-seed{seed}", 4, 2)["train_seconds"]
        assert control["supervised_steps"] >= 1 and control["budget_seconds"] == grpo_time
    # A rerun keeps finished runs instead of training them again.
    stamp = (out / "grpo-seed0" / "summary.json").stat().st_mtime_ns
    ablation.main(["--variants", "grpo", "--seeds", "0", "--steps", "2", "--eval-size", "4",
                   "--out", str(out),
                   "--", "--warm-start-steps", "5", "--prompts-per-step", "2", "--group-size", "4",
                   "--max-new-tokens", "16"])
    assert (out / "grpo-seed0" / "summary.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_compare_runs_grpo_against_its_baselines_with_learning_curves(tmp_path, monkeypatch):
    """--compare: GRPO, PPO with a critic, RLOO and REINFORCE, each with evaluations every 5
    steps; compare.md has a row per method with seconds per step, and compare.png both curves."""
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "compare"
    stats = ablation.main(["--compare", "--seeds", "0", "1", "--steps", "6", "--eval-size", "4",
                           "--jobs", "2", "--out", str(out), "--", "--warm-start-steps", "5",
                           "--prompts-per-step", "2", "--group-size", "4",
                           "--max-new-tokens", "12"])
    assert list(stats) == ablation.COMPARE == ["grpo", "ppo", "ppo_critic_lr", "rloo", "reinforce"]
    table = (out / "compare.md").read_text()
    assert all(f"| {name} |" in table for name in ablation.COMPARE) and "seconds per step" in table
    assert (out / "compare.png").stat().st_size > 10_000
    points = ablation.curve(out / "ppo-seed0")
    assert [p[0] for p in points] == [0, 5, 6]  # before, the step-5 evaluation, after
    assert points[0][1] == 0 and points[-1][1] > 0
    summary = json.loads((out / "ppo-seed0" / "summary.json").read_text())
    assert summary["baseline_config"]["baseline"] == "critic"
