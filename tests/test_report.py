"""Watching a run (report.py): each health warning fires once when its condition holds and names
its metric, value and the flag that helps; a healthy run's numbers stay silent; μ = 1 gets its
NOTE on the first step; --report-to tensorboard writes events that TensorBoard's own reader reads
back (W&B in offline mode writes its run); a missing package is one line; curves.png has a moving
average, drops an all-zero panel, and a run with --eval-every has a held-out curve.

Needs: torch, transformers, matplotlib; tensorboard and wandb for their tests (skipped with the
reason without them). CPU, offline, ~25 s.
"""

import json
import sys

import pytest

from recipe import report
import train_gsm8k
from recipe.flags import InputError
from test_train_gsm8k import TINY_FLAGS, cache  # noqa: F401 (a fixture)

HEALTHY = {"completions/clipped_ratio": 0.0, "frac_reward_zero_std": 0.3, "kl": 0.02,
           "entropy": 0.06, "reward": 0.5, "sampling/ratio_outside_0.9_1.1": 0.0}


def run(series: list[dict], num_iterations: int = 1) -> list[tuple[int, str]]:
    """(step, line) of every warning Health prints over these metrics, steps from 1."""
    health = report.Health(num_iterations)
    return [(i, line) for i, m in enumerate(series, 1) for line in health.check(m)]


def test_moving_average_by_hand():
    """window 2: [1, 3, 5] -> [1, (1+3)/2, (3+5)/2] = [1, 2, 4]."""
    assert report.moving_average([1, 3, 5], 2) == [1, 2, 4]
    assert report.moving_average([2.0], 5) == [2.0]


def test_a_healthy_run_gets_only_the_mu_1_note():
    """Numbers like the quick start's (entropy drifting from 0.065 to 0.037, zero-std 0.1 to 0.5,
    no truncation, KL under 0.06): no warning in 60 steps; the NOTE once, at step 1; none at μ=2."""
    series = [{**HEALTHY, "entropy": 0.065 - 0.0005 * k, "kl": 0.001 * k,
               "frac_reward_zero_std": 0.1 + 0.4 * (k % 2)} for k in range(60)]
    said = run(series)
    assert [step for step, _ in said] == [1]
    assert said[0][1].startswith("NOTE: with --num-iterations 1")
    assert run(series, num_iterations=2) == []


@pytest.mark.parametrize("name, change, flag", [
    ("truncation", {"completions/clipped_ratio": 0.6}, "--max-new-tokens"),
    ("no signal", {"frac_reward_zero_std": 0.9}, "--dynamic-sampling"),
    ("KL blow-up", {"kl": 2.5}, "--lr"),
    ("entropy collapse", {"entropy": 0.001}, "--beta"),
    ("sampler mismatch", {"sampling/ratio_outside_0.9_1.1": 0.069}, "--fp32-logits"),
])
def test_each_warning_fires_once_after_a_window(name, change, flag):
    """Healthy for 5 steps, then the condition: it fires at the 5th bad step (the window mean is
    over the line only then, except for truncation whose window mean passes 0.5 at the 5th),
    exactly once however long it lasts, naming its metric, its value and a flag."""
    series = [HEALTHY] * report.WINDOW + [{**HEALTHY, **change}] * 30
    said = [(step, line) for step, line in run(series) if line.startswith("WARNING")]
    assert len(said) == 1, said
    step, line = said[0]
    assert report.WINDOW < step <= 2 * report.WINDOW
    key = next(iter(change))
    assert f"({name}, {key})" in line and flag in line


def test_bf16_with_fp32_logits_stays_silent():
    """The sampler-mismatch line sits between bf16 with fp32 logits (0.62% of tokens outside
    [0.9, 1.1] on SmolLM2-135M, benchmarks/results/real-model/numerics.json) and bf16 logits
    (6.9%): the first never warns, the second does."""
    quiet = [{**HEALTHY, "sampling/ratio_outside_0.9_1.1": 0.0062}] * 30
    loud = [{**HEALTHY, "sampling/ratio_outside_0.9_1.1": 0.069}] * 30
    assert [line for _, line in run(quiet) if line.startswith("WARNING")] == []
    assert [line for _, line in run(loud) if "sampler mismatch" in line]


def test_one_bad_step_does_not_warn():
    series = [HEALTHY] * 10 + [{**HEALTHY, "kl": 3.0}] + [HEALTHY] * 10
    assert [line for _, line in run(series) if line.startswith("WARNING")] == []


def test_zero_reward_warns_after_20_steps_in_a_row():
    series = [{**HEALTHY, "reward": 0.0}] * 19 + [{**HEALTHY, "reward": 0.1}]
    series += [{**HEALTHY, "reward": 0.0}] * 20
    said = [(step, line) for step, line in run(series) if "zero reward" in line]
    assert [step for step, _ in said] == [40]
    assert "--max-new-tokens" in said[0][1] and "samples.jsonl" in said[0][1]


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rep = report.Reporter("tensorboard", tmp_path, {"lr": 1e-6})
    for step in (1, 2, 3):
        rep.log({"step": step, "reward": 0.1 * step, "kl": 0.01, "truncated": True}, step)
    rep.log({"eval/accuracy": 0.42}, 3, wall_seconds=12.0)
    rep.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"reward", "kl", "eval/accuracy", "eval/accuracy_by_seconds"} <= set(
        events.Tags()["scalars"])
    assert [round(e.value, 6) for e in events.Scalars("reward")] == [0.1, 0.2, 0.3]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("eval/accuracy_by_seconds")] == [
        (12, 0.42)]
    assert "step" not in events.Tags()["scalars"]


def test_wandb_offline_writes_its_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="pip install wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rep = report.Reporter("wandb", tmp_path, {"lr": 1e-6})
    rep.log({"reward": 0.5}, 1)
    rep.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/*.wandb"))


def test_a_missing_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(InputError, match="pip install tensorboard"):
        report.Reporter("tensorboard", tmp_path, {})
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(InputError, match="pip install wandb"):
        report.Reporter("wandb", tmp_path, {})


def test_bad_report_to_and_eval_every_are_one_line(capsys):
    for argv, says in [(["--report-to", "mlflow"], "invalid choice: 'mlflow'"),
                       (["--eval-every", "-1"], "--eval-every must be >= 0")]:
        assert train_gsm8k.cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_a_run_with_eval_every_draws_a_held_out_curve(tmp_path, cache, capsys):  # noqa: F811
    """--eval-every 1 over 3 steps: evaluations before, at steps 1 and 2 (on the first
    --eval-batch-size problems) and after; they are in summary.json and TensorBoard; curves.png
    leaves out the clip-ratio panel, all 0 at μ = 1; the run says no WARNING."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    summary = train_gsm8k.main([*TINY_FLAGS, "--steps", "3", "--eval-every", "1",
                                "--eval-batch-size", "4", "--report-to", "tensorboard",
                                "--out", str(out)])
    assert [step for step, _ in summary["evals"]] == [0, 1, 2]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/accuracy")] == [1, 2, 3]
    assert len(events.Scalars("reward")) == 3
    assert "WARNING" not in capsys.readouterr().out
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    titles = report.plot_curves(metrics, summary["evals"], tmp_path / "c.png", 6, 4)
    assert "clip ratio" not in titles and "accuracy" in titles
