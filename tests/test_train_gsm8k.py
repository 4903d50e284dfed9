"""train_gsm8k.py end to end on tiny settings, its outputs, its bad-input errors, and the
qwen2.5-0.5b preset's code path on a small locally built Qwen2 model with a chat template.

Needs: torch, transformers, matplotlib; GSM8K (`--gsm8k-dir`, conftest.py) for the Qwen-path test,
which skips without it. CPU, offline. The warm-start cache goes to a temporary folder, so nothing
here reuses a checkpoint from elsewhere.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe import evaluation
from recipe import gsm8k
from recipe import tiny_world
import train_gsm8k

ROOT = Path(__file__).resolve().parent.parent
TINY_FLAGS = ["--warm-start-steps", "5", "--steps", "2", "--eval-size", "6", "--prompts-per-step",
              "2",
              "--group-size", "4", "--max-new-tokens", "20", "--sample-every", "1", "--threads",
              "1"]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def run_script(*args, env_extra=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, str(ROOT / "train_gsm8k.py"), *args],
                          capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def test_tiny_run_end_to_end_writes_every_output(tmp_path, cache):
    out = tmp_path / "run"
    proc = run_script(*TINY_FLAGS, "--out", str(out), env_extra={"GRPO_TINY_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| before | after |" in proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "steps", "wall_seconds", "model", "data"):
        assert key in summary
    assert summary["steps"] == 2 and summary["data"] == "tiny" and summary["eval_size"] == 6

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        for key in ("reward", "kl", "clip_ratio/low", "entropy", "grad_norm", "loss",
                    "completions/mean_length",
                    "rewards/correctness_reward", "rewards/format_reward", "step_time"):
            assert math.isfinite(m[key]), key
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion", "reward", "advantage"} <= set(samples[0])
    assert (out / "curves.png").stat().st_size > 10_000

    # final/ loads with AutoModelForCausalLM. Its weights moved away from the warm start exactly
    # when some group had a reward spread: with μ = 1 and every advantage 0 the gradient is exactly
    # 0 (the KL term's gradient is 0 too while the policy still equals the reference).
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    (warm,) = list(cache.glob("warm-start-*"))
    start = AutoModelForCausalLM.from_pretrained(warm)
    moved = any(not torch.equal(a, b) for a, b in zip(final.parameters(), start.parameters()))
    assert moved == any(m["reward_std"] > 0 for m in lines)
    assert not list(out.glob(".tmp*")) and not list(cache.glob(".tmp*"))


def test_warm_start_is_cached_and_reused(cache):
    cfg = tiny_world.WarmStartConfig(hidden=32, layers=1, heads=2, steps=3, batch_size=4)
    first = tiny_world.warm_start(cfg, log=lambda *a: None)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = tiny_world.warm_start(cfg, log=lambda *a: None)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    other = tiny_world.warm_start(tiny_world.WarmStartConfig(hidden=32, layers=1, heads=2, steps=4,
                                                             batch_size=4),
                                  log=lambda *a: None)
    assert other != first


def test_tiny_problems_are_gsm8k_format_and_splits_are_disjoint():
    import rewards
    train = tiny_world.make_problems(3000, "train")
    test = tiny_world.make_problems(500, "test")
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert len({r["question"] for r in train}) == 3000
    for r in train[:200] + test[:200]:
        *steps, final = r["answer"].split("\n")
        assert final.startswith("#### ") and 1 <= len(steps) <= 3
        for line in steps:  # every calculator annotation is right: a op b=<<a op b=c>>c
            expr, rest = line.split("=<<")
            inner, shown = rest.split(">>")
            lhs, result = inner.split("=")
            assert lhs == expr and result == shown
            # test-only check of our own generated text
            assert eval(lhs.replace("/", "//")) == int(result)
        assert rewards.correctness_reward([r["answer"]], [r["answer"]]) == [1.0]


def test_slips_answer_the_first_steps_result_and_never_reach_the_gold():
    """Same seed, same questions. With slip_rate 1 every multi-step solution keeps all its (right)
    steps but its '####' line repeats the first step's result; one-step problems are untouched. The
    default (slip_rate 0) is always right. Worked example: Mia has 25, buys 5 packs of 2 -> 5*2=10,
    25+10=35; true answer #### 35, slipped answer #### 10."""
    import random
    import rewards
    clean = tiny_world.make_problems(2000, "train", seed=3)
    careless = tiny_world.make_problems(2000, "train", seed=3, slip_rate=1.0)
    assert [r["question"] for r in clean] == [r["question"] for r in careless]
    for c, s in zip(clean, careless):
        full, slipped = c["answer"].split("\n"), s["answer"].split("\n")
        assert slipped[:-1] == full[:-1]  # every step written, and written right
        first = full[0].split(">>")[1]
        assert slipped[-1] == ("#### " + first if len(full) > 2 else full[-1])
        right = rewards.correctness_reward([s["answer"]], [c["answer"]]) == [1.0]
        # right only when there is one step, or by coincidence (2*6=12, then 24-12=12)
        assert right == (len(full) == 2 or "#### " + first == full[-1])
    multi = sum(len(c["answer"].split("\n")) > 2 for c in clean) / 2000
    assert 0.5 < multi < 0.8  # most problems have a wrong quantity to answer
    two_steps = [(5, "*", 2), (25, "+", tiny_world.P)]
    assert tiny_world.solve(two_steps, slip_rate=1.0, rng=random.Random(0)) == (
        "5*2=<<5*2=10>>10\n25+10=<<25+10=35>>35\n#### 10", 10)
    assert tiny_world.solve(two_steps) == ("5*2=<<5*2=10>>10\n25+10=<<25+10=35>>35\n#### 35", 35)


def test_arithmetic_slips_put_the_mistake_in_the_first_calculator_step():
    """slip='arithmetic' (process supervision's fair test): 5*2 is written <<5*2=11>>11 and
    carried on, 25+11=36, #### 36. Over 2,000 problems at slip_rate 1: every multi-step solution
    without a later division has exactly its first step wrong and a wrong answer, so the step
    reward (rewards.calculator_process_reward) scores [0, 1, ..., final 0] where the outcome
    reward only says 0; the rest are the true solution. The default text is unchanged, and so is
    the default warm start's cache key."""
    import hashlib
    import json as json_
    import random
    from dataclasses import asdict
    import rewards
    two_steps = [(5, "*", 2), (25, "+", tiny_world.P)]
    assert tiny_world.solve(two_steps, 1.0, random.Random(0), "arithmetic") == (
        "5*2=<<5*2=11>>11\n25+11=<<25+11=36>>36\n#### 36", 36)
    clean = tiny_world.make_problems(2000, "train", seed=3)
    slipped = tiny_world.make_problems(2000, "train", seed=3, slip_rate=1.0, slip="arithmetic")
    n_slipped = 0
    for c, s in zip(clean, slipped):
        steps = rewards.calculator_process_reward([s["answer"]], [c["answer"]])[0]
        if s["answer"] == c["answer"]:
            assert all(r == 1.0 for _, r in steps)
            assert len(steps) == 2 or "/" in "".join(c["answer"].split("\n")[1:-1])
            continue
        n_slipped += 1
        assert [r for _, r in steps] == [0.0] + [1.0] * (len(steps) - 2) + [0.0], s["answer"]
    assert n_slipped / 2000 > 0.4
    with pytest.raises(ValueError, match="slip must be one of"):
        tiny_world.solve(two_steps, 1.0, random.Random(0), "typo")
    cfg = tiny_world.WarmStartConfig()
    old_key = {k: v for k, v in asdict(cfg).items() if k != "slip"}
    digest = hashlib.sha256(json_.dumps(old_key, sort_keys=True).encode()).hexdigest()[:12]
    assert tiny_world.warm_start_key(cfg) == digest
    assert tiny_world.warm_start_key(tiny_world.WarmStartConfig(slip="arithmetic")) != digest


def test_slip_rate_sets_how_often_the_wrong_quantity_is_answered():
    """With slip_rate 0.6 a two-step solution answers its first result 60% of the time (binomial sd
    over 4,000 draws is 0.8 points, so 0.57-0.63 is about 4 sd)."""
    import random
    rng = random.Random(0)
    early = sum(tiny_world.solve([(5, "*", 2), (25, "+", tiny_world.P)], 0.6,
                                 rng)[1] == 10 for _ in range(4000))
    assert 0.57 < early / 4000 < 0.63


# --- bad input: one line, exit code 2, nothing written -------------------------------------------
def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


GOOD = json.dumps({"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"})


@pytest.mark.parametrize("case, expected", [
    ("preset", "invalid choice: 'huge'"),
    ("data_dir", "is not 'tiny', 'openai/gsm8k' or an existing directory"),
    ("bad_json", "train.jsonl:2: not valid JSON"),
    ("missing_field",
     "train.jsonl:3: expected an object with string fields 'question' and 'answer'"),
    ("no_final_number", "test.jsonl:1: the answer has no final number"),
    ("model_dir", "model directory ./no/such/model does not exist"),
    ("hub_offline", "cannot load model 'nobody/no-such-model'"),
    ("group_size", "--group-size must be at least 2"),
    ("beta", "--beta must be >= 0"),
    ("critic_lora", "--baseline critic (PPO, ppo.py) trains every weight from the start"),
    ("lam", "--lam must be from 0 to 1"),
    ("model_before_data", "model directory /no/such/dir does not exist"),
    ("gguf_before_data", "model file /no/such/model.gguf does not exist"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, case, expected, capsys, monkeypatch):
    data = tmp_path / "data"
    write(data / "train.jsonl", GOOD + "\n")
    write(data / "test.jsonl", GOOD + "\n")
    args = {"preset": ["--preset", "huge"],
            "data_dir": ["--data", str(tmp_path / "nowhere")],
            "bad_json": ["--data", str(data)],
            "missing_field": ["--data", str(data)],
            "no_final_number": ["--data", str(data)],
            "model_dir": ["--model", "./no/such/model", "--data", str(data)],
            "hub_offline": ["--model", "nobody/no-such-model", "--data", str(data)],
            "group_size": ["--group-size", "1"],
            "beta": ["--beta", "-0.1"],
            "critic_lora": ["--baseline", "critic", "--lora-r", "4"],
            "lam": ["--baseline", "critic", "--lam", "1.5"],
            # the model is named before the data is read: both are wrong here
            "model_before_data": ["--model", "/no/such/dir", "--data", "openai/gsm8k"],
            "gguf_before_data": ["--model", "/no/such/model.gguf", "--data", "/no/data"]}[case]
    if case == "bad_json":
        write(data / "train.jsonl", GOOD + "\n{not json\n")
    if case == "missing_field":
        write(data / "train.jsonl",
              GOOD + "\n" + GOOD + "\n" + json.dumps({"question": "q"}) + "\n")
    if case == "no_final_number":
        write(data / "test.jsonl", json.dumps({"question": "q", "answer": "no number"}) + "\n")
    out = tmp_path / "out"
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert train_gsm8k.cli([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("left_behind", ["metrics.jsonl", "summary.json", "final",
                                         "checkpoint-3"])
def test_an_out_folder_that_holds_a_run_is_refused(tmp_path, capsys, left_behind):
    """A new run into a folder an earlier (or interrupted) run wrote to would mix the two runs'
    logs: refused in one line, pointing to --resume, and the folder is left as it was."""
    out = tmp_path / "run"
    (out / left_behind).parent.mkdir(parents=True, exist_ok=True)
    if "." in left_behind:
        (out / left_behind).write_text("{}\n")
    else:
        (out / left_behind).mkdir()
    before = sorted(p.name for p in out.iterdir())
    assert train_gsm8k.cli(["--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds a run" in err and f"--resume {out}" in err
    assert len(err.strip().splitlines()) == 1 and sorted(p.name for p in out.iterdir()) == before


def test_an_empty_out_folder_is_not_a_run(tmp_path):
    from recipe import checkpoint
    (tmp_path / "notes.txt").write_text("mine")
    assert checkpoint.run_in(tmp_path) is None and checkpoint.run_in(tmp_path / "new") is None


def test_bad_input_from_the_real_command_line(tmp_path):
    """The same path through a real process: exit code 2 and a single line on stderr."""
    proc = run_script("--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: --data")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# --- the qwen2.5-0.5b preset's code path, on a small local Qwen2 ---------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow
def test_qwen_preset_code_path_on_local_qwen2_and_gsm8k(tmp_path, capsys, gsm8k_dir):
    """The Qwen preset (bf16 autocast, gradient checkpointing, a chat template) on a tiny Qwen2 and
    real GSM8K rows, with compiled decoding on, as --compile auto sets it for the preset's 200
    steps x 512 tokens."""
    gsm8k = str(gsm8k_dir)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = tiny_world.char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1,
                                         max_position_embeddings=1024,
                                         eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True))
    model.save_pretrained(tmp_path / "qwen2-tiny")
    tok.save_pretrained(tmp_path / "qwen2-tiny")

    out = tmp_path / "run"
    summary = train_gsm8k.main(["--preset", "qwen2.5-0.5b", "--model", str(tmp_path / "qwen2-tiny"),
                                "--data", gsm8k, "--steps", "2", "--eval-size", "4",
                                "--prompts-per-step", "2",
                                "--group-size", "2", "--max-new-tokens", "12", "--micro-batch-size",
                                "2",
                                "--device", "cpu", "--compile", "on", "--out", str(out)])
    assert summary["engine_config"]["sampler"] == "compiled"
    assert "compiled decoding is off" not in capsys.readouterr().err
    assert summary["grpo_config"]["lr"] == 1e-6 and summary["train_config"]["bf16"] is True
    assert summary["memory_config"]["gradient_checkpointing"] is True
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["prompt"].startswith("<|im_start|>system\nSolve the math problem")
    assert samples[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "final" / "config.json").exists()


def test_hub_dataset_without_datasets_installed_is_a_clear_error(monkeypatch, tmp_path):
    """--data openai/gsm8k loads with `datasets`; without it the user is told what to do, in one
    line."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(train_gsm8k.InputError, match="needs `pip install datasets`"):
        train_gsm8k.main(["--data", "openai/gsm8k", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_flags_override_the_preset_which_overrides_the_defaults():
    tcfg, gcfg, *_ = train_gsm8k.parse_args(["--preset", "qwen2.5-0.5b", "--lr", "2e-6",
                                             "--no-bf16"])
    assert tcfg.model == "Qwen/Qwen2.5-0.5B-Instruct" and tcfg.bf16 is False   # preset, then flag
    assert gcfg.lr == 2e-6 and gcfg.max_new_tokens == 512                       # flag, preset
    assert gcfg.beta == 0.04 and gcfg.clip_eps == 0.2                           # paper defaults
    tcfg, gcfg, *_ = train_gsm8k.parse_args([])
    assert tcfg.preset == "tiny" and tcfg.data == "tiny" and gcfg.max_new_tokens == 96


# --- numerical safety: non-finite steps are skipped, counted, and several in a row stop the run
RUN_FLAGS = ["--warm-start-steps", "5", "--eval-size", "6", "--prompts-per-step", "2",
             "--group-size", "4",
             "--max-new-tokens", "20", "--threads", "1", "--save-every", "1", "--max-bad-steps",
             "2"]


def test_nan_rewards_from_step_3_are_skipped_then_stop_the_run(tmp_path, cache, monkeypatch,
                                                               capsys):
    """Steps 1-2 are normal; from step 3 on, one reward per step is NaN. Step 3 is skipped (weights
    untouched, so its checkpoint holds exactly the weights after step 2), step 4 is the second bad
    step in a row and stops the run with exit code 1 and one line. No checkpoint ever holds a
    NaN."""
    from safetensors.torch import load_file
    calls = {"n": 0}

    def correctness_then_nan(completions, answer, **kw):
        # a training step (2 prompts x G=4), not the up-front check
        calls["n"] += len(completions) == 8
        values = rewards_mod.correctness_reward(completions, answer)
        return [float("nan")] + values[1:] if calls["n"] >= 3 else values

    import rewards as rewards_mod
    # logged under the same name as the real one
    correctness_then_nan.__name__ = "correctness_reward"
    train_gsm8k.main([*RUN_FLAGS, "--steps", "2", "--out", str(tmp_path / "clean")])
    monkeypatch.setattr(gsm8k, "REWARD_FUNCS", [correctness_then_nan, rewards_mod.format_reward])
    assert train_gsm8k.cli([*RUN_FLAGS, "--steps", "6", "--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    err = err[err.index("error: "):].strip()  # after the progress bars
    assert err.startswith("error: stopped at step 4: 2 steps in a row had a non-finite loss or "
                          "gradient")
    assert "checkpoint-000003" in err and "\n" not in err
    log = (tmp_path / "bad" / "metrics.jsonl").read_text()
    lines = [json.loads(line) for line in log.splitlines()]
    assert [m["skipped_updates"] for m in lines] == [0, 0, 1, 1]
    clean = load_file(tmp_path / "clean" / "checkpoint-000002" / "model.safetensors")
    kept = load_file(tmp_path / "bad" / "checkpoint-000003" / "model.safetensors")
    assert all(torch.isfinite(v).all() and torch.equal(v, clean[k]) for k, v in kept.items())
    assert not (tmp_path / "bad" / "summary.json").exists()


def test_non_finite_logits_in_training_stop_the_run_with_weights_untouched(tmp_path, cache,
                                                                           monkeypatch, capsys):
    """Every training forward pass overflows (as bf16 can); sampling does not. Nothing is ever
    updated."""
    from recipe import tiny_world
    real_load = tiny_world.load_warm_start

    def load_with_overflow(*a, **kw):
        model, tok, name = real_load(*a, **kw)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        loaded.append((model, start))

        def overflow(module, args, output):
            if torch.is_grad_enabled():
                output.logits[..., 3] = float("nan")
            return output
        model.register_forward_hook(overflow)
        return model, tok, name

    loaded = []
    monkeypatch.setattr(tiny_world, "load_warm_start", load_with_overflow)
    assert train_gsm8k.cli([*RUN_FLAGS, "--steps", "5", "--save-every", "0", "--out",
                            str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "stopped at step 2" in err and "no checkpoint was written" in err
    (model, start), = loaded
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bad, expected", [
    (lambda completions, **kw: [1.0], "returned 1 values for 2 completions"),
    (lambda completions, **kw: ["yes"] * len(completions), "returned 'yes'; expected a number"),
])
def test_a_broken_reward_function_fails_before_any_model_loads(tmp_path, cache, monkeypatch, capsys,
                                                               bad, expected):
    import rewards as rewards_mod
    monkeypatch.setattr(gsm8k, "REWARD_FUNCS", [bad, rewards_mod.format_reward])
    assert train_gsm8k.cli([*RUN_FLAGS, "--steps", "2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1
    assert not cache.exists() and not (tmp_path / "r").exists()



# --- train_gsm8k.py eval: greedy accuracy, Maj@K, Pass@K -----------------------------------------
def test_maj_and_pass_by_hand():
    """Gold 5: answers 5, 3, 5, none -> Maj right, Pass right; 3, 3, 5 -> Maj wrong, Pass right;
    a 3-5 tie goes to 3, drawn first; no answer at all -> both wrong."""
    row = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    maj_and_pass = evaluation.maj_and_pass
    assert maj_and_pass(["#### 5", "#### 3", "so #### 5", "no idea"], row) == (True, True)
    assert maj_and_pass(["#### 3", "#### 3", "#### 5"], row) == (False, True)
    assert maj_and_pass(["#### 3", "#### 5"], row) == (False, True)
    assert maj_and_pass(["#### 5", "#### 3"], row) == (True, True)
    assert maj_and_pass(["hmm", "no"], row) == (False, False)


# The eval tests start from a model that answers its problems right, then train it on them at a
# learning rate that makes it forget: eval must give the trained model's accuracy, and a bug that
# evaluated the starting weights (or dropped LoRA's adapters) gives accuracy_before instead. (Runs
# from a 5-step warm start answer nothing, so any weights would have matched at 0.)
EVAL_N, EVAL_TOKENS = 8, 64
EVAL_FLAGS = ["--steps", "2", "--eval-size", str(EVAL_N), "--prompts-per-step", "2",
              "--group-size", "4", "--max-new-tokens", str(EVAL_TOKENS), "--threads", "1",
              "--lr", "1e-2"]


@pytest.fixture(scope="module")
def answering(tmp_path_factory):
    """(a model folder, a data folder): a tiny-world Llama fit for 90 steps to EVAL_N problems'
    solutions, which it then answers mostly right (greedy) and not always (sampled, so GRPO's
    groups carry a signal), and those problems as both train.jsonl and test.jsonl. About 5 s."""
    tok = tiny_world.char_tokenizer()
    torch.manual_seed(0)
    model = tiny_world.tiny_llama(tok, hidden=64, layers=2, heads=4)
    rows = tiny_world.make_problems(EVAL_N, "test", seed=0)
    enc = tok([tiny_world.prompt_of(r["question"]) + r["answer"] + tok.eos_token for r in rows],
              return_tensors="pt", padding=True, add_special_tokens=False)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(90):
        model(**enc, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("answering")
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    for split in ("train", "test"):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out / "model", out


def eval_json(model, data, k, capsys) -> dict:
    capsys.readouterr()
    assert train_gsm8k.cli(["eval", "--model", str(model), "--data", str(data), "--limit",
                            str(EVAL_N), "--k", str(k), "--max-new-tokens", str(EVAL_TOKENS),
                            "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_of_a_run_folder_matches_its_own_final_evaluation(tmp_path, answering, capsys):
    """`eval --model <a run's --out>` loads its final/; on the same held-out problems and token
    cap, its greedy accuracy is the run's own accuracy_after, and Pass@K >= Maj@K."""
    model, data = answering
    out = tmp_path / "run"
    summary = train_gsm8k.main(["--model", str(model), "--data", str(data), *EVAL_FLAGS,
                                "--out", str(out)])
    assert summary["accuracy_before"] > summary["accuracy_after"]  # the run moved it
    assert eval_json(model, data, 2, capsys)["greedy_accuracy"] == summary["accuracy_before"]
    res = eval_json(out, data, 4, capsys)
    assert res["problems"] == EVAL_N and res["greedy_accuracy"] == summary["accuracy_after"]
    assert 0 <= res["maj@4"] <= res["pass@4"] <= 1


def test_eval_of_a_run_with_no_other_flag_scores_as_the_run_did(tmp_path, answering, capsys):
    """With no flag but --model (the run's folder or its final/), eval takes the run's own data,
    held-out size and token cap from its summary.json: its greedy score is the run's
    accuracy_after. (Without them it would score GSM8K's hub split at 512 tokens.)"""
    model, data = answering
    out = tmp_path / "run"
    summary = train_gsm8k.main(["--model", str(model), "--data", str(data), *EVAL_FLAGS,
                                "--out", str(out)])
    for model_flag in (out, out / "final"):
        capsys.readouterr()
        assert train_gsm8k.cli(["eval", "--model", str(model_flag), "--k", "1", "--json"]) == 0
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert res["greedy_accuracy"] == summary["accuracy_after"]
        assert (res["data"], res["problems"], res["max_new_tokens"]) == (str(data), EVAL_N,
                                                                         EVAL_TOKENS)


def test_eval_takes_each_scoring_setting_from_the_run_unless_a_flag_overrides_it(tmp_path):
    """Every setting a run scored itself with comes from its summary.json: data, rewards,
    held-out size, token cap, decoding batch, system prompt, template, bf16; a flag given wins.
    Any other model gets eval's own defaults."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({
        "train_config": {"data": "tiny", "reward": ["r.py:f"], "eval_size": 7,
                         "eval_batch_size": 5, "system_prompt": "Think.", "template": "r1",
                         "bf16": True},
        "grpo_config": {"max_new_tokens": 33}}))
    for model in (run, run / "final"):
        a = evaluation.checked_eval_args(["--model", str(model)])
        assert (a.data, a.reward, a.limit, a.batch_size, a.system_prompt, a.template,
                a.max_new_tokens, a.bf16) == ("tiny", ["r.py:f"], 7, 5, "Think.", "r1", 33, True)
    a = evaluation.checked_eval_args(["--model", str(run), "--system-prompt", "", "--limit", "2",
                                      "--max-new-tokens", "9", "--template", "plain"])
    assert (a.system_prompt, a.limit, a.max_new_tokens, a.template) == ("", 2, 9, "plain")
    a = evaluation.checked_eval_args(["--model", str(tmp_path / "elsewhere")])
    assert (a.data, a.reward, a.limit, a.batch_size, a.system_prompt, a.template,
            a.max_new_tokens, a.bf16) == ("openai/gsm8k", [], 0, 32, None, "plain", 512, False)


@pytest.mark.parametrize("argv, says", [
    (["--k", "0", "--model", "x"], "--k must be >= 1"),
    (["--data", "tiny"], "the following arguments are required: --model"),
    (["--model", "x", "--data", "tiny"], "give --limit N"),
    (["--model", "/no/such/model", "--data", "tiny", "--limit", "2"], "does not exist"),
], ids=["k-0", "no-model", "tiny-no-limit", "missing-model"])
def test_bad_eval_input_is_one_line(argv, says, capsys):
    assert train_gsm8k.cli(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_eval_of_a_lora_checkpoint_merges_it_onto_its_base(tmp_path, answering, capsys):
    """A LoRA run's last checkpoint holds adapters only; eval puts them on the base model their
    adapter_config.json names and merges: the same greedy accuracy as the run's final/, not the
    base's. A checkpoint that names no base is one line."""
    pytest.importorskip("peft", reason="LoRA needs peft")
    model, data = answering
    out = tmp_path / "lora"
    summary = train_gsm8k.main(["--model", str(model), "--data", str(data), *EVAL_FLAGS,
                                "--lora-r", "4", "--out", str(out)])
    assert summary["accuracy_before"] > summary["accuracy_after"]
    (ckpt,) = out.glob("checkpoint-*")
    assert (ckpt / "adapter_config.json").exists() and not (ckpt / "config.json").exists()
    assert eval_json(ckpt, data, 2, capsys)["greedy_accuracy"] == summary["accuracy_after"]
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "adapter_config.json").write_text("{}")
    with pytest.raises(train_gsm8k.InputError, match="names no base model"):
        evaluation.load_for_eval(str(tmp_path / "bare"))


def test_ppo_with_a_critic_trains_on_the_tiny_world(tmp_path, cache):
    """--baseline critic runs ppo.Critic in grpo_step's place: the value model is logged, its
    settings are saved, and --resume of such a run is refused (its value model is not saved)."""
    out = tmp_path / "ppo"
    summary = train_gsm8k.main([*TINY_FLAGS, "--baseline", "critic", "--lam", "0.9",
                                "--out", str(out)])
    assert summary["ppo_config"]["lam"] == 0.9
    assert summary["baseline_config"]["baseline"] == "critic"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert all(math.isfinite(m["value/loss"]) and "value/explained_variance" in m
               for m in metrics)
    assert train_gsm8k.cli(["--resume", str(out), "--steps", "3"]) == 2


def test_r1_template_trains_on_the_tiny_world(tmp_path, cache):
    """--template r1: the prompts are R1-Zero's template around the question, the optimised
    rewards are correctness and r1_format_reward (weights 1 and 0.5), and the run completes."""
    out = tmp_path / "r1"
    summary = train_gsm8k.main([*TINY_FLAGS, "--template", "r1", "--out", str(out)])
    assert summary["grpo_config"]["reward_weights"] == [1.0, 0.5]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("rewards/r1_format_reward" in m and "rewards/correctness_reward" in m
               for m in metrics)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["prompt"].startswith("A conversation between User and Assistant.")
    assert samples[0]["prompt"].endswith("Assistant:")
    assert train_gsm8k.cli(["--template", "r2"]) == 2


def test_the_hub_data_set_without_a_network_is_one_line(monkeypatch):
    """datasets raises ConnectionError offline; the command says so in one line with the way out
    (this was a traceback in `eval` and training alike)."""
    datasets = pytest.importorskip("datasets", reason="datasets comes with TRL")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(train_gsm8k.InputError, match="pass a folder with train.jsonl"):
        gsm8k.load_data("openai/gsm8k", 5, 5)


def test_plain_runs_grpo_py_alone_and_lands_where_the_machinery_does(tmp_path, cache,
                                                                     monkeypatch):
    """--plain trains with grpo.Seams() (none of machinery/: engine.apply and memory.apply would
    raise here); the default run applies them. The same seed gives the same samples and rewards,
    and the same sampled texts: the machinery draws the page's tokens and scores them to float
    rounding."""
    from machinery import engine, memory
    real = engine.apply, memory.apply

    def refuse(*args):
        raise AssertionError("--plain applied the machinery")

    monkeypatch.setattr(engine, "apply", refuse)
    monkeypatch.setattr(memory, "apply", refuse)
    plain = train_gsm8k.main([*TINY_FLAGS, "--plain", "--out", str(tmp_path / "plain")])
    applied = []
    monkeypatch.setattr(engine, "apply", lambda *a: applied.append(1) or real[0](*a))
    monkeypatch.setattr(memory, "apply", lambda *a: applied.append(2) or real[1](*a))
    train_gsm8k.main([*TINY_FLAGS, "--out", str(tmp_path / "fast")])
    assert applied == [1, 2] and plain["train_config"]["plain"] is True
    metrics = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").open()]
               for d in ("plain", "fast")]
    for a, b in zip(*metrics):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == \
            b["completions/mean_length"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    # NOTE: no accuracy is compared: a 5-step warm start answers nothing, so both are 0 and the
    #       comparison could not fail. The sampled texts, step by step, are the check.
    plain_samples, fast_samples = ((tmp_path / d / "samples.jsonl").read_text()
                                   for d in ("plain", "fast"))
    assert plain_samples == fast_samples and len(plain_samples.splitlines()) >= 2


def test_eval_of_a_bf16_run_scores_with_the_runs_output_layer_and_precision(tmp_path, answering,
                                                                            capsys, monkeypatch):
    """`eval` of a --bf16 run's final/ (no flag but --model) samples as the run's own evaluations
    did: the fp32 output layer (precision.FP32Logits), each forward under bf16 autocast, and so
    gives the run's accuracy_after. The bug it catches: eval scored with a plain output layer,
    whose logits autocast rounds to bf16, where the run's evaluations used fp32 logits."""
    import grpo
    from machinery import engine
    model, data = answering
    out, seen, real = tmp_path / "run", [], grpo.sample_completions

    def recording(m, *args, **kwargs):
        head = type(engine.base_model(m).get_output_embeddings()).__name__
        hook = m.register_forward_pre_hook(
            lambda mod, a: seen.append((head, torch.is_autocast_enabled("cpu"))))
        try:
            return real(m, *args, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(grpo, "sample_completions", recording)
    summary = train_gsm8k.main(["--model", str(model), "--data", str(data), *EVAL_FLAGS, "--bf16",
                                "--out", str(out)])
    in_the_run = set(seen)
    seen.clear()
    capsys.readouterr()
    assert train_gsm8k.cli(["eval", "--model", str(out / "final"), "--k", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert in_the_run == set(seen) == {("FP32Logits", True)}
    assert res["bf16"] is True and res["greedy_accuracy"] == summary["accuracy_after"]


def test_eval_decodes_compiled_as_compile_says_and_as_the_run_did(tmp_path):
    """eval's --compile defaults to the run's (then auto); auto compiles from
    engine.AUTO_COMPILE_DECODE_STEPS decode steps ahead, as a run decides. The bug it catches:
    eval always decoded eagerly (GSM8K's 1,319 problems, K = 8, 512 tokens: over an hour on a
    GPU)."""
    from machinery import engine
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"train_config": {}, "grpo_config": {},
                                                  "engine_config": {"compile": "on"}}))
    a = evaluation.checked_eval_args(["--model", str(run)])
    assert a.compile == "on"

    def sampler(argv, n_rows):
        a = evaluation.checked_eval_args(["--model", "elsewhere", *argv])
        return engine.sampler_for(a.compile, "engine", evaluation.decode_steps(a, n_rows))

    assert sampler([], 1319) == "compiled"               # (42 + 330 batches) x 512 tokens
    assert sampler(["--k", "1", "--limit", "50"], 50) == "engine"
    assert sampler(["--compile", "off"], 1319) == "engine"


def test_the_sampler_that_ran_is_on_the_record(tmp_path, cache, monkeypatch, capsys):
    """summary.json's "sampler" and the first progress lines say which decode loop sampled:
    compiled, or eager and why compiled decoding fell back (here: it raises at its first token);
    a transformers whose StaticCache compiled decoding cannot fill is named when the run starts.
    The bug it catches: a fallback was one NOTE on stderr, and nothing on the record said which
    sampler ran."""
    from machinery import engine

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(engine, "_decode_compiled", broken)
    s = train_gsm8k.main([*TINY_FLAGS, "--compile", "on", "--out", str(tmp_path / "fell")])
    assert s["sampler"] == {"configured": "compiled", "used": "engine",
                            "fallback": "RuntimeError: no C++ compiler"}
    said = capsys.readouterr().out
    assert "sampler: compiled" in said  # at the start it could still compile
    assert "sampler in step 1: eager (engine): compiled decoding fell back: RuntimeError" in said
    plain = train_gsm8k.main([*TINY_FLAGS, "--plain", "--out", str(tmp_path / "plain")])
    assert plain["sampler"] == {"configured": "plain", "used": "plain", "fallback": None}
    monkeypatch.setattr(engine, "static_cache_api_blocker",
                        lambda: "transformers 9.0's StaticLayer keeps no cumulative_length")
    capsys.readouterr()
    train_gsm8k.main([*TINY_FLAGS, "--compile", "on", "--steps", "1",
                      "--out", str(tmp_path / "old")])
    first = capsys.readouterr().out.splitlines()
    start = next(line for line in first if line.startswith("model: "))
    assert "sampler: eager (engine): compiled decoding fell back: transformers 9.0's" in start


@pytest.mark.parametrize("failure, says", [
    ("raise", "reward function 'correctness_reward' raised KeyError: 'answer'"),
    # WHY slow: the same path as "raise" once the message is made; the fast tier keeps one
    pytest.param("count", "reward function 'correctness_reward' returned 7 values for 8 "
                          "completions", marks=pytest.mark.slow),
    pytest.param("text", "reward function 'correctness_reward' returned 'right'; expected a "
                         "number", marks=pytest.mark.slow),
])
def test_a_reward_that_fails_mid_run_stops_it_in_one_line_and_it_resumes(tmp_path, cache,
                                                                          monkeypatch, capsys,
                                                                          failure, says):
    """A reward that passes the check before training and fails at step 3 (raises, returns the
    wrong number of values, or a non-number) stops the run with exit code 1 and one line naming
    it and the last checkpoint; with the reward mended, --resume finishes the run from there.
    The bug it catches: grpo.py's traceback, many lines deep, at step 300 of a long run."""
    import rewards as rewards_mod
    calls = {"n": 0}

    def correctness_reward(completions, answer, **kw):
        calls["n"] += len(completions) == 8  # a training step (2 prompts x G=4)
        values = rewards_mod.correctness_reward(completions, answer)
        if calls["n"] < 3 or calls.get("mended"):
            return values
        if failure == "raise":
            raise KeyError("answer")
        return values[1:] if failure == "count" else ["right"] + values[1:]

    monkeypatch.setattr(gsm8k, "REWARD_FUNCS", [correctness_reward, rewards_mod.format_reward])
    out = tmp_path / "run"
    assert train_gsm8k.cli([*RUN_FLAGS, "--steps", "4", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    err = err[err.index("error: "):].strip()  # after the progress bars
    assert err.startswith(f"error: stopped after step 2: {says}") and "\n" not in err, err
    assert "checkpoint-000002" in err and f"--resume {out}" in err
    calls["mended"] = True
    assert train_gsm8k.cli(["--resume", str(out)]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
