"""LoRA through PEFT (lora.py, train_gsm8k.py --lora-r): π_ref is the base model bit for bit (the
adapters switched off, no copy), a GRPO step trains the adapters only, β = 0 runs no reference
pass, the merged model is a plain one that from_pretrained loads, a LoRA run's checkpoints hold
adapters in PEFT's format and --resume continues it exactly, and bad input is one line.

Needs: torch, transformers, peft (skipped with the reason without it). CPU, offline, ~20 s.
"""

import copy
import json
import sys

import pytest
import torch

peft = pytest.importorskip("peft", reason="LoRA needs peft (pip install peft)")

import grpo  # noqa: E402
from machinery import lora, precision  # noqa: E402
from recipe import tiny_world  # noqa: E402
import train_gsm8k  # noqa: E402
from recipe.flags import InputError  # noqa: E402
from test_resume import FLAGS, steps_of  # noqa: E402

PROMPTS = ["What is 2+3?", "Hi", "Q: 7*8 then 9"]


def reward(completions, **_):
    return [float(len(c) % 3) for c in completions]


@pytest.fixture
def models():
    """(tokenizer, base model, a LoRA policy on a copy of it)."""
    tok = tiny_world.char_tokenizer()
    base = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    return tok, base, lora.add_adapters(copy.deepcopy(base), r=4, alpha=8)


def logits(model, tok):
    ids = tok(PROMPTS, return_tensors="pt", padding=True)["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits


def one_step(policy, ref, tok, beta=0.04):
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=8, lr=5e-2, beta=beta)
    torch.manual_seed(0)
    return grpo.grpo_step(policy, ref, grpo.make_optimizer(policy, cfg), tok, PROMPTS, [reward],
                          cfg)


def test_reference_is_the_base_model_exactly_before_and_after_training(models):
    """LoRA's B starts at zero, so the new policy is the base exactly; after a step the policy has
    moved but AdaptersOff(policy) still gives the base model's logits bit for bit."""
    tok, base, policy = models
    want = logits(base, tok)
    assert torch.equal(logits(policy, tok), want)
    ref = lora.AdaptersOff(policy)
    one_step(policy, ref, tok)
    assert not torch.allclose(logits(policy, tok), want, atol=1e-4)
    assert torch.equal(logits(ref, tok), want)


def test_a_step_trains_the_adapters_only_and_no_reference_copy_exists(models):
    tok, base, policy = models
    trainable, total = lora.trainable_share(policy)
    assert 0 < trainable < 0.2 * total
    frozen = {n: p.clone() for n, p in policy.named_parameters() if not p.requires_grad}
    adapters = {n: p.clone() for n, p in policy.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in adapters)
    one_step(policy, lora.AdaptersOff(policy), tok)
    now = dict(policy.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in frozen.items())
    assert any(not torch.equal(now[n], p) for n, p in adapters.items() if "lora_B" in n)
    # WHY: AdaptersOff holds no tensors of its own; π_ref is the policy's own weights.
    assert not any(isinstance(v, torch.Tensor) for v in vars(lora.AdaptersOff(policy)).values())


def test_beta_zero_runs_no_reference_pass(models, monkeypatch):
    tok, _, policy = models
    calls = []
    monkeypatch.setattr(lora.AdaptersOff, "__call__", lambda self, *a, **k: calls.append(1))
    one_step(policy, None, tok, beta=0.0)
    assert calls == []
    with pytest.raises(ValueError, match="beta != 0 needs a reference"):
        one_step(policy, None, tok, beta=0.04)


def test_the_merged_model_is_a_plain_model_that_from_pretrained_loads(models, tmp_path):
    from transformers import AutoModelForCausalLM
    tok, _, policy = models
    one_step(policy, lora.AdaptersOff(policy), tok)
    want = logits(policy, tok)
    lora.merged(policy).save_pretrained(tmp_path / "m")
    assert not (tmp_path / "m" / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert not lora.is_lora(plain)
    torch.testing.assert_close(logits(plain, tok), want, rtol=1e-5, atol=1e-5)


def trained_adapters(policy, seed=1, scale=0.3):
    """Give every adapter random B (PEFT starts it at zero), so merging has something to add."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return policy


@pytest.mark.parametrize("name", ["engine", "plain"])
def test_sampling_merged_draws_the_unmerged_tokens_and_leaves_the_base_untouched(models, name):
    """lora.sample_merged (EngineConfig.merge_adapters): from the same seed, the same tokens as
    PEFT's unmerged layers, and log-probs within float rounding; inside, one forward's logits
    equal the unmerged policy's within 1e-5; afterwards every base weight is the very tensor it
    was, unchanged, and the adapters are on again."""
    from test_engine import sampler
    tok, _, policy = models
    trained_adapters(policy)
    base = {n: (p, p.clone()) for n, p in policy.named_parameters() if "base_layer" in n}
    assert len(base) == 2 * 7                       # q, k, v, o, gate, up, down in 2 layers
    want = logits(policy, tok)
    assert not torch.allclose(want, logits(lora.AdaptersOff(policy), tok), atol=1e-3)
    assert lora.merge_keeps_updates(policy)                 # an fp32 base: sample_merged merges
    with lora.merged_weights(policy):
        torch.testing.assert_close(logits(policy, tok), want, rtol=1e-5, atol=1e-5)
    for n, (p, before) in base.items():
        got = dict(policy.named_parameters())[n]
        assert got is p and torch.equal(got, before), n
    torch.testing.assert_close(logits(policy, tok), want, rtol=0, atol=0)

    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=24, temperature=1.0)
    runs = []
    for sample in (sampler(policy, tok, name), lora.sample_merged(sampler(policy, tok, name))):
        torch.manual_seed(0)
        runs.append(grpo.sample_completions(policy, tok, PROMPTS, cfg, sample=sample))
    assert torch.equal(runs[0]["completion_ids"], runs[1]["completion_ids"])
    assert runs[0]["completion_mask"].sum() > 3 * len(PROMPTS) * 4     # not all stopped at once
    torch.testing.assert_close(runs[1]["sampler_logp"], runs[0]["sampler_logp"],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["engine", "plain"])
def test_a_bf16_base_samples_unmerged_as_merging_would_drop_small_updates(name):
    """--bf16 --lora-r: W + (alpha/r) B A rounded to bf16 loses an update well under W's bf16
    resolution (most of what one forward's logits moved by), so lora.sample_merged leaves a
    bf16 base unmerged: under autocast its tokens and log-probs are the unmerged sampler's, bit for
    bit."""
    from test_engine import sampler
    tok = tiny_world.char_tokenizer()
    policy = trained_adapters(lora.add_adapters(
        precision.bf16_reference(tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)),
        4, 8),
        scale=1e-4)
    assert not lora.merge_keeps_updates(policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base, unmerged = logits(lora.AdaptersOff(policy), tok), logits(policy, tok)
        with lora.merged_weights(policy):
            merged = logits(policy, tok)
    moved = (unmerged - base).abs().max()
    assert moved > 0 and (merged - unmerged).abs().max() > 0.5 * moved

    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=24, temperature=1.0)
    runs = []
    for sample in (sampler(policy, tok, name), lora.sample_merged(sampler(policy, tok, name))):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(grpo.sample_completions(policy, tok, PROMPTS, cfg, sample=sample))
    assert torch.equal(runs[0]["completion_ids"], runs[1]["completion_ids"])
    assert torch.equal(runs[0]["sampler_logp"], runs[1]["sampler_logp"])


def test_bf16_base_keeps_fp32_adapters_and_residual_stream():
    """--bf16 --lora-r: the adapters and everything outside the blocks' Linear layers (embedding,
    norms, output layer) stay fp32, so under autocast the base (adapters off, B = 0) computes bit
    for bit what autocast computes from the fp32 model: at step 1, sampler, trainer, π_ref agree."""
    tok = tiny_world.char_tokenizer()
    fp32 = precision.fp32_logits(tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0))
    policy = lora.add_adapters(precision.bf16_reference(copy.deepcopy(fp32)), 4, 8)
    dtypes = {p.dtype for n, p in policy.named_parameters() if "lora_" in n}
    linear = {n for n, m in policy.named_modules() if isinstance(m, torch.nn.Linear)}
    bf16 = {n for n, p in policy.named_parameters() if p.dtype == torch.bfloat16}
    assert dtypes == {torch.float32}
    assert bf16 and all(n.rsplit(".", 1)[0] in linear for n in bf16)  # a Linear's weight
    assert policy.get_input_embeddings().weight.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = logits(fp32, tok), logits(policy, tok)
    assert torch.equal(got, want)


def test_missing_peft_and_a_bad_target_are_one_line_errors(monkeypatch, tmp_path):
    """lora.py raises its own one-line LoRAError (the machinery may not import the recipe); the
    recipe shows it as bad input, exit code 2."""
    tok = tiny_world.char_tokenizer()
    model = tiny_world.tiny_llama(tok, hidden=32, layers=1, heads=2)
    with pytest.raises(lora.LoRAError, match="--lora-target-modules nope_proj"):
        lora.add_adapters(model, 4, 8, "nope_proj")
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(InputError, match="--lora-target-modules nope_proj"):
        train_gsm8k.main(["--warm-start-steps", "5", "--lora-r", "4", "--lora-target-modules",
                          "nope_proj", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(lora.LoRAError, match="pip install peft"):
        lora.add_adapters(model, 4, 8)


def test_train_gsm8k_with_lora_saves_adapters_merges_at_the_end_and_resumes_exactly(tmp_path,
                                                                                   monkeypatch):
    """A 2-step LoRA run resumed to 4 equals a 4-step LoRA run: every metric and the final merged
    weights. Checkpoints are PEFT adapter folders; final/ is a plain model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from recipe import gsm8k
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    # WHY: a 5-step warm start answers nothing right, so correctness gives no signal; a reward on
    #      the length does, so the adapters move and resuming has something to get right.
    by_length = lambda completions, **_: [float(len(c) % 3) for c in completions]  # noqa: E731
    monkeypatch.setattr(gsm8k, "REWARD_FUNCS", [by_length, gsm8k.rewards.format_reward])
    flags = [*FLAGS, "--lora-r", "4", "--lora-alpha", "8", "--lr", "1e-2"]
    four = train_gsm8k.main([*flags, "--steps", "4", "--out", str(tmp_path / "four")])
    train_gsm8k.main([*flags, "--steps", "2", "--out", str(tmp_path / "two")])
    ckpt = tmp_path / "two" / "checkpoint-000002"
    assert json.loads((ckpt / "adapter_config.json").read_text())["r"] == 4
    assert (ckpt / "adapter_model.safetensors").exists()
    assert not (ckpt / "model.safetensors").exists()
    train_gsm8k.main(["--resume", str(tmp_path / "two"), "--steps", "4"])
    assert steps_of(tmp_path / "two") == steps_of(tmp_path / "four")
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("two", "four"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    AutoModelForCausalLM.from_pretrained(tmp_path / "four" / "final")  # plain: no peft needed
    assert four["train_config"]["lora_r"] == 4
    assert any(m["kl"] > 0 for m in steps_of(tmp_path / "four"))  # π_ref really differs now


def test_resuming_a_lora_run_with_other_lora_settings_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_TINY_CACHE", str(tmp_path / "cache"))
    train_gsm8k.main([*FLAGS, "--lora-r", "4", "--steps", "1", "--out", str(tmp_path / "r")])
    with pytest.raises(InputError, match="--lora-r was 4 there"):
        train_gsm8k.main(["--resume", str(tmp_path / "r"), "--lora-r", "8"])


@pytest.mark.parametrize("flag, value, message", [
    ("--lora-r", "-1", "--lora-r must be >= 0"),
    ("--lora-alpha", "0", "--lora-alpha must be >= 1e-09"),
])
def test_bad_lora_flags_are_one_line(flag, value, message, capsys):
    assert train_gsm8k.cli([flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
