"""train_trl.py, the road past one GPU: TRL's GRPOTrainer trains for 2 steps on a tiny local model,
fed by train_gsm8k.py's data loading and rewards.py's reward functions unchanged.

Needs: trl and datasets (benchmarks/requirements.txt; .ci/run installs them). Skips with a reason
without them. CPU, offline, ~15 s.
"""

import pytest

trl = pytest.importorskip("trl",
                          reason="TRL is not installed: pip install -r benchmarks/requirements.txt")


def test_trl_trains_two_steps_with_our_data_and_rewards(tmp_path, monkeypatch):
    from recipe import tiny_world
    from compare import train_trl
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


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_under_accelerate_launch(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 train_trl.py ... --cpu`: torchrun starts
    two processes that form one group (gloo on this CPU: the main process counts 2), train one
    model for 2 steps with our rewards, and the main process saves it.
    NOTE: `accelerate launch --cpu --num_processes 2` starts one process, not two (accelerate
          1.16's simple launcher); this test caught that."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from recipe import tiny_world
    from transformers import AutoModelForCausalLM
    pytest.importorskip("accelerate", reason="accelerate comes with TRL")
    root = Path(__file__).resolve().parent.parent
    tok = tiny_world.char_tokenizer()
    tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", str(free_port()), "compare/train_trl.py", "--model",
         str(tmp_path / "model"), "--data", "tiny", "--steps", "2", "--prompts-per-step", "2",
         "--group-size", "4", "--max-new-tokens", "16", "--cpu", "--out", str(tmp_path / "out")],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "trained 2 steps on 2 process(es)" in proc.stdout
    # our reward functions ran inside TRL, under their own names
    assert "'rewards/correctness_reward/mean'" in proc.stdout + proc.stderr
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_zero3_config_is_one_accelerate_reads():
    """zero3.yaml, the README's DeepSpeed config, parses as accelerate's own config class says."""
    from pathlib import Path
    config_args = pytest.importorskip("accelerate.commands.config.config_args",
                                      reason="accelerate comes with TRL")
    c = config_args.load_config_from_file(
        str(Path(__file__).resolve().parent.parent / "compare" / "zero3.yaml"))
    assert c.distributed_type.value == "DEEPSPEED" and c.deepspeed_config["zero_stage"] == 3
    assert c.mixed_precision == "bf16" and c.num_machines == 1
