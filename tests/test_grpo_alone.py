"""The page is the path: grpo.py runs by itself, and with GRPOConfig() and grpo.Seams() defaults a
step runs no project code but grpo.py's.

- grpo.py copied alone into an empty folder runs a whole GRPO step (μ = 2, β > 0) in a fresh
  process whose import path is that folder plus site-packages, on a small random Llama with a chat
  tokenizer built offline: the loss is finite and the weights move. The bug it catches: grpo.py
  importing another project file (engine, memory, baselines, rewards), as it once did.
- sys.setprofile records every Python frame entered during one grpo_step with the defaults: the
  only project files among them are grpo.py and this file (the reward function). The bug it
  catches: a default that routes the step through the machinery (engine.py's sampler or scorer),
  so that what a reader edits in grpo.py is not what runs.

Needs: torch, transformers, tokenizers. CPU, offline, about 10 s.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import grpo
from recipe import tiny_world

ROOT = Path(__file__).resolve().parent.parent

ALONE = r'''
import json, sys
sys.path.insert(0, sys.argv[1])       # the folder that holds grpo.py, and nothing else
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
import grpo

specials = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>", "<unk>"]
vocab = {t: i for i, t in enumerate(specials + sorted(set("abcdefghij0123456789 +=?\n")))}
core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
core.decoder = decoders.Fuse()
tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                              eos_token="<|im_end|>", unk_token="<unk>",
                              additional_special_tokens=["<|im_start|>"])
tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                     "assistant\n{% endif %}")
torch.manual_seed(0)
policy = LlamaForCausalLM(LlamaConfig(
    vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
    eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id))
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                   add_generation_prompt=True) for q in ("1+2=?", "3+4=?")]


def has_a(completions, **_):
    return [float("a" in c) for c in completions]


cfg = grpo.GRPOConfig(group_size=4, num_iterations=2, beta=0.04, max_new_tokens=12, lr=1e-2)
policy = grpo.disable_dropout(policy)
ref = grpo.make_reference(policy)
before = [p.detach().clone() for p in policy.parameters()]
m = grpo.grpo_step(policy, ref, grpo.make_optimizer(policy, cfg), tok, prompts, [has_a], cfg)
# NOTE: a virtual environment inside the checkout (sys.prefix) holds packages, not the project
venv_inside = sys.prefix.startswith(sys.argv[2] + "/")
project = sorted(name for name, mod in sys.modules.items()
                 if (getattr(mod, "__file__", None) or "").startswith(sys.argv[2] + "/")
                 and not (venv_inside and mod.__file__.startswith(sys.prefix + "/")))
print(json.dumps({"loss": m["loss"], "kl": m["kl"], "reward_std": m["reward_std"],
                  "moved": any(not torch.equal(a, b) for a, b in zip(before, policy.parameters())),
                  "grpo_file": grpo.__file__, "project_modules": project,
                  "prompt": prompts[0]}))
'''


def test_grpo_py_copied_alone_runs_a_whole_step(tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(ROOT / "grpo.py", alone / "grpo.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # WHY -I: isolated mode puts neither the current folder nor PYTHONPATH on the import path, so
    #     the path is the copy's folder (added by the script) plus site-packages.
    out = subprocess.run([sys.executable, "-I", "-c", ALONE, str(alone), str(ROOT)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["grpo_file"] == str(alone / "grpo.py")
    assert res["project_modules"] == []          # not one module from this repository
    assert res["prompt"].startswith("<|im_start|>user\n1+2=?<|im_end|>")
    assert torch.isfinite(torch.tensor(res["loss"])) and res["moved"]
    assert res["reward_std"] > 0 and res["kl"] > 0  # μ = 2: π_θ moved from π_ref by update 2


def has_a(completions, **_):
    """A reward with signal on a random model's text."""
    return [float("a" in c) for c in completions]


def test_a_default_step_runs_only_grpo_py(monkeypatch):
    tok = tiny_world.char_tokenizer()
    policy = grpo.disable_dropout(tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2))
    cfg = grpo.GRPOConfig()                          # the paper's defaults, G = 8, T up to 256
    ref, opt = grpo.make_reference(policy), grpo.make_optimizer(policy, cfg)
    files = set()

    def record(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)

    torch.manual_seed(0)
    sys.setprofile(record)
    try:
        m = grpo.grpo_step(policy, ref, opt, tok, ["1+2=", "3+4="], [has_a], cfg)
    finally:
        sys.setprofile(None)
    # NOTE: frames of generated code carry names like "<string>": only real files count.
    # NOTE: a virtual environment inside the checkout (sys.prefix) holds packages, not the project
    venv = Path(sys.prefix).resolve()
    project = {Path(f).resolve() for f in files if Path(f).is_absolute()
               and Path(f).resolve().is_relative_to(ROOT)
               and not (venv.is_relative_to(ROOT) and Path(f).resolve().is_relative_to(venv))}
    assert project == {ROOT / "grpo.py", Path(__file__).resolve()}, sorted(map(str, project))
    assert m["reward_std"] > 0 and len(files) > 20  # a real step, and the profiler saw it


def test_the_frame_record_sees_the_machinery_when_it_is_handed_in():
    """The same record with engine.py's seams (train_gsm8k.py's default) finds engine.py: so the
    test above can fail."""
    from machinery import engine
    tok = tiny_world.char_tokenizer()
    policy = grpo.disable_dropout(tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2))
    cfg = grpo.GRPOConfig(max_new_tokens=8)
    seams = engine.apply(engine.EngineConfig(), grpo.Seams(), grpo.eos_token_ids(policy, tok),
                         grpo.pad_token_id(policy, tok))
    files = set()
    sys.setprofile(lambda frame, event, arg: files.add(frame.f_code.co_filename)
                   if event == "call" else None)
    try:
        grpo.grpo_step(policy, None, grpo.make_optimizer(policy, cfg), tok, ["1+2="], [has_a],
                       grpo.GRPOConfig(max_new_tokens=8, beta=0.0), seams=seams)
    finally:
        sys.setprofile(None)
    assert str(ROOT / "machinery" / "engine.py") in {str(Path(f).resolve()) for f in files}
