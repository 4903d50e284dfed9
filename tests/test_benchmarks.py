"""The benchmark scripts in benchmarks/ run end to end on tiny settings and print what they promise:
the comparison against TRL its final JSON line, the profile a split that adds up to the step.

Needs: trl and datasets for the comparison (skips with a reason without them). CPU, offline, ~40 s.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--gradient-checkpointing"]],
                         ids=["fp32", "bf16-autocast", "checkpointing"])
def test_vs_trl_reports_both_sides(precision):
    """Both sides run and report; and the settings each side reports it effectively ran with (TRL's
    read back from its trainer after training) are equal, gradient checkpointing included."""
    pytest.importorskip("trl",
                        reason="TRL is not installed: pip install -r benchmarks/requirements.txt")
    res = run("benchmarks/vs_trl.py", "--steps", "3", "--warmup", "1", "--rounds", "1", "--tokens",
              "4", *precision)
    ours, trl = res["settings"]["ours"], res["settings"]["trl"]
    assert res["settings_differ"] == {} and ours == trl and len(ours) >= 20
    assert ours["gradient_checkpointing"] is ("--gradient-checkpointing" in precision)
    assert ours["bf16"] is ("--bf16" in precision) and ours["max_dropout"] == 0.0
    assert res["precision"] == ("bf16 autocast" if "--bf16" in precision else "fp32")
    assert res["device"] == "cpu"
    assert "ours_peak_gpu_mb" not in res                                        # only on a GPU
    for key in ("ours_s_per_step", "trl_s_per_step", "ratio", "ours_peak_rss_mb",
                "trl_peak_rss_mb"):
        assert res[key] > 0, key
    assert res["ratio"] == pytest.approx(res["ours_s_per_step"] / res["trl_s_per_step"], rel=0.01)
    assert len(res["round_ratios"]) == 1 and res["round_ratios"][0] == pytest.approx(res["ratio"],
                                                                                     abs=0.01)


def test_profile_parts_add_up_to_the_step():
    res = run("benchmarks/profile_step.py", "--steps", "3", "--warmup", "1", "--tokens", "8")
    parts = ["generation", "no-grad log-probs", "train fwd+bwd", "optimizer", "everything else"]
    assert all(res[p] >= 0 for p in parts[:-1])
    # medians of parts need not sum exactly to the median total; within 20% they must
    assert sum(res[p] for p in parts) == pytest.approx(res["total"], rel=0.2)
    assert res["generation"] > 0 and res["train fwd+bwd"] > 0 and res["no-grad log-probs"] > 0


def test_scaling_fit_recovers_a_known_power_law():
    """Rows made from t = 0.01 · G^0.5 · T^1 · P^0.25 exactly: the least-squares fit returns 0.5, 1
    and 0.25."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from profile_step import fit_exponents
    rows = [{"group_size": G, "tokens": T, "parameters": P,
             "total": 0.01 * G ** 0.5 * T * P ** 0.25}
            for G, T,
            P in [(4, 32, 1e5), (8, 32, 1e5), (16, 32, 1e5), (4, 64, 1e5), (4, 128, 1e5),
                  (4, 32, 1e6),
                            (4, 32, 4e6)]]
    exps = fit_exponents(rows)
    assert exps == pytest.approx({"G": 0.5, "tokens": 1.0, "params": 0.25}, abs=1e-9)


@pytest.mark.parametrize("script", ["benchmarks/vs_trl.py", "benchmarks/profile_step.py"])
def test_bad_group_size_is_a_one_line_error(script):
    proc = subprocess.run([sys.executable, script, "--group-size", "1"], capture_output=True,
                          text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 2
    # the message is GRPOConfig's own, not a copy kept beside it
    assert proc.stderr.strip().splitlines()[-1].endswith(": error: group_size must be at least 2 "
                                                         "(a group baseline needs 2), got 1")
