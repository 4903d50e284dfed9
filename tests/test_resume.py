"""Crash safety of train_gsm8k.py: checkpoints are written whole or not at all, a run killed with
SIGKILL resumes with --resume and loses no completed step, and on CPU with a fixed seed the resumed
run reproduces the uninterrupted one exactly.

Needs: torch, transformers. CPU, offline; the tiny warm start (5 supervised steps) goes to a
temporary cache.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recipe import checkpoint
import train_gsm8k

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--warm-start-steps", "5", "--eval-size", "6", "--prompts-per-step", "2", "--group-size",
         "4",
         "--max-new-tokens", "20", "--sample-every", "1", "--threads", "1", "--save-every", "1"]


def steps_of(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock field, which no two runs share."""
    return [{k: v for k, v in json.loads(line).items() if k != "step_time"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(path: Path) -> dict:
    return load_file(path / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_loses_nothing_and_matches_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRPO_TINY_CACHE": str(tmp_path / "cache")}
    script = [sys.executable, str(ROOT / "train_gsm8k.py"), *FLAGS, "--steps", "8"]

    # The uninterrupted run (it also builds the warm start, so the killed run spends no time on it).
    whole = tmp_path / "whole"
    done = subprocess.run([*script, "--out", str(whole)], env=env, cwd=ROOT, capture_output=True,
                          text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    # The same run, killed with SIGKILL (no chance to clean up) once it has finished three steps.
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*script, "--out", str(killed)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        log = killed / "metrics.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "summary.json").exists()
    ckpt = checkpoint.latest_checkpoint(killed)     # the last complete checkpoint survived the kill
    saved_step = json.loads((ckpt / "state.json").read_text())["step"]
    assert saved_step >= 2
    finished_before_kill = [m["step"] for m in steps_of(killed)]

    resumed = subprocess.run([sys.executable, str(ROOT / "train_gsm8k.py"), "--resume",
                              str(killed)], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from checkpoint-{saved_step:06d}" in resumed.stdout

    # Same final step, every step exactly once, and every step the killed run had checkpointed
    # kept as it was.
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["steps"] == 8
    after = steps_of(killed)
    assert [m["step"] for m in after] == list(range(1, 9))
    assert set(range(1, saved_step + 1)) <= set(finished_before_kill)
    # Exactly reproducible on CPU with a fixed seed: every metric and every final weight.
    assert after == steps_of(whole)
    assert same_weights(weights(killed / "final"), weights(whole / "final"))
    whole_summary = json.loads((whole / "summary.json").read_text())
    assert whole_summary["accuracy_after"] == summary["accuracy_after"]


def test_resume_keeps_its_settings_and_can_extend_a_finished_run(tmp_path, monkeypatch):
    """A run of 2 steps extended to 4 with --resume equals a 4-step run; changing the math is
    refused."""
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    train_gsm8k.main([*FLAGS, "--steps", "4", "--out", str(tmp_path / "four")])
    train_gsm8k.main([*FLAGS, "--steps", "2", "--out", str(tmp_path / "two")])
    with pytest.raises(train_gsm8k.InputError, match="--lr was 0.0001 there"):
        train_gsm8k.main(["--resume", str(tmp_path / "two"), "--lr", "1"])
    train_gsm8k.main(["--resume", str(tmp_path / "two"), "--steps", "4"])
    assert steps_of(tmp_path / "two") == steps_of(tmp_path / "four")
    assert same_weights(weights(tmp_path / "two" / "final"), weights(tmp_path / "four" / "final"))
    assert [p.name for p in (tmp_path / "two").glob("checkpoint-*")] == ["checkpoint-000004"]


def test_resume_without_a_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert train_gsm8k.cli(["--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint there" in err and len(err.strip().splitlines()) == 1


class RunsCode:
    """Unpickling this touches a file: what a checkpoint from a stranger could do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_refuses_a_checkpoint_whose_pickle_would_run_code(tmp_path, monkeypatch, capsys):
    """A real run's checkpoint loads with weights_only (AdamW's state and every RNG are tensors
    and plain values). Its trainer_state.pt replaced by one whose unpickling runs code: --resume
    is a one-line error and the code never runs. The bug it catches: torch.load(...,
    weights_only=False), which ran it."""
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    train_gsm8k.main([*FLAGS, "--steps", "1", "--out", str(run)])
    ckpt = checkpoint.latest_checkpoint(run)
    trainer = checkpoint.load_trainer_state(ckpt / "trainer_state.pt")
    assert trainer["optimizer"]["state"] and len(trainer["python_rng"][1]) == 625
    marker = tmp_path / "the code ran"
    torch.save({**trainer, "optimizer": RunsCode(marker)}, ckpt / "trainer_state.pt")
    capsys.readouterr()  # the first run's progress bars
    assert train_gsm8k.cli(["--resume", str(run), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # NOTE: after transformers' load bar
    assert err.startswith("error: ") and "trainer_state.pt holds more than tensors" in err, err
    assert "Unsupported global" in err and not marker.exists()


def test_a_crash_while_writing_a_checkpoint_leaves_the_last_one_whole(tmp_path, monkeypatch):
    """The second save dies half-way through writing its weights: checkpoint-1 must still load and
    resume."""
    from recipe import tiny_world
    from transformers import AutoModelForCausalLM
    tok = tiny_world.char_tokenizer()
    model = tiny_world.tiny_llama(tok, hidden=32, layers=1, heads=2)
    opt = torch.optim.AdamW(model.parameters())
    state = {"step": 1}
    checkpoint.save_checkpoint(tmp_path, model, tok, opt, state)

    real = type(model).save_pretrained

    def dies_half_way(self, path, **kw):
        real(self, path, **kw)
        (Path(path) / "model.safetensors").write_bytes(b"torn")
        raise KeyboardInterrupt  # a kill signal arriving mid-write

    monkeypatch.setattr(type(model), "save_pretrained", dies_half_way)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, model, tok, opt, {"step": 2})
    kept = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert kept == ["checkpoint-000001"]
    ckpt = checkpoint.latest_checkpoint(tmp_path)
    assert ckpt.name == "checkpoint-000001"
    AutoModelForCausalLM.from_pretrained(ckpt)  # loads


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    from recipe import tiny_world
    tok = tiny_world.char_tokenizer()
    model = tiny_world.tiny_llama(tok, hidden=32, layers=1, heads=2)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save_checkpoint(tmp_path, model, tok, opt, {"step": 1})
    before = weights(tmp_path / "checkpoint-000001")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(checkpoint.TrainingStopped, match="not finite"):
        checkpoint.save_checkpoint(tmp_path, model, tok, opt, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001"]
    assert same_weights(weights(tmp_path / "checkpoint-000001"), before)
