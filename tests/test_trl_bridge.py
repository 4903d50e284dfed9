"""train_trl.py, the road past one GPU: TRL's GRPOTrainer trains for 2 steps on a tiny local model,
fed by train_gsm8k.py's data loading and rewards.py's reward functions unchanged.

Needs: trl and datasets (benchmarks/requirements.txt; .ci/run installs them). Skips with a reason
without them. CPU, offline, ~15 s.
"""

import pytest

trl = pytest.importorskip("trl",
                          reason="TRL is not installed: pip install -r benchmarks/requirements.txt")


def test_trl_trains_two_steps_with_our_data_and_rewards(tmp_path, monkeypatch):
    import tiny_world
    import train_trl
    from transformers import AutoModelForCausalLM
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = tiny_world.char_tokenizer()
    tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")

    trainer = train_trl.main(["--model", str(tmp_path / "model"), "--data", "tiny", "--steps", "2",
                              "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens",
                              "16",
                              "--cpu", "--out", str(tmp_path / "out")])
    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2
    # Our reward functions ran inside TRL, under their own names, with the paper's settings.
    assert all("rewards/correctness_reward/mean" in h and "rewards/format_reward/mean" in h
               for h in logs)
    assert trainer.args.loss_type == "grpo" and trainer.args.beta == 0.04
    assert trainer.args.top_k == 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
