"""The speed machinery (engine.py) against the page's path (grpo.decode, grpo.token_logprobs) and
slow, obvious samplers: uncached_decode below (no KV cache, the whole sequence every step) and
transformers' generate(). grpo.decode itself is checked against uncached_decode. Token for token
from the same seed, on a Llama with SDPA attention (the ready 4D mask), the same Llama on eager
attention (the 2D mask) and a GPT-2 (absolute positions, so left padding must be handled); and
every decode step's logits against one uncached forward pass.

Needs: torch and transformers only (tiny random models built in memory). CPU, offline, ~15 s.
"""

import copy
import functools

import pytest
import torch

from machinery import engine
import grpo
from recipe import tiny_world

ARCHS = ["llama", "llama-eager", "gpt2"]
PROMPTS = ["What is 2+3? Then add 17 and 45.", "Hi", "Q: 7*8"]  # 3 lengths: real left padding


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_world.char_tokenizer()
    return tok, tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)


def tiny_gpt2(tok):
    """GPT-2 learns ABSOLUTE position embeddings, so left padding shifts its positions unless
    handled."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2,
                                       n_positions=64, bos_token_id=tok.bos_token_id,
                                       eos_token_id=tok.eos_token_id))
    grpo.disable_dropout(model)  # GPT-2 has dropout 0.1; with it on, no two forward passes agree
    return model


def model_for(arch, tiny):
    """The tiny Llama (SDPA: the engine hands it a ready 4D mask), the same weights on eager
    attention (the plain 2D mask path), or a tiny GPT-2."""
    tok, model = tiny
    if arch == "llama-eager":
        model = copy.deepcopy(model)
        model.set_attn_implementation("eager")
        assert not engine.sdpa_full_attention(model)
        return model
    return model if arch == "llama" else tiny_gpt2(tok)


def uncached_decode(model, prompt_ids, prompt_mask, group_size, max_new_tokens, pick):
    """The slow, obvious sampler: no KV cache, so step t runs the model over all P+t tokens so far;
    grpo.decode's contract."""
    ids = prompt_ids.repeat_interleave(group_size, 0)                                 # (N, P)
    mask = prompt_mask.repeat_interleave(group_size, 0)                               # (N, P)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)                                # (N,)
    tokens, logps = [], []
    for t in range(max_new_tokens):
        out = model(input_ids=ids, attention_mask=mask, use_cache=False,
                    position_ids=(mask.cumsum(1) - 1).clamp(min=0))
        next_ids, done, logp = pick(out.logits[:, -1, :].float(), t, done)
        tokens.append(next_ids)
        logps.append(logp)
        ids = torch.cat([ids, next_ids[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if done.all():
            break
    return torch.stack(tokens, 1), torch.stack(logps, 1)


DECODERS = {"plain": grpo.decode, "uncached": uncached_decode, "engine": engine.decode,
            "compiled": engine.decode_compiled}


def sampler(model, tok, name, min_new_tokens=0, sample_batch_size=0):
    """The decode loop `name`, wrapped as engine.apply wraps it (EOS floor, batches)."""
    decode = DECODERS[name]
    if min_new_tokens:
        decode = engine.at_least(decode, min_new_tokens, grpo.eos_token_ids(model, tok))
    return engine.in_batches(decode, sample_batch_size, grpo.pad_token_id(model, tok))


def sample(model, tok, name, seed=0, greedy=False, min_new_tokens=0, sample_batch_size=0, **cfg):
    """G = 4 completions of up to 24 tokens for each of PROMPTS (greedy: one each)."""
    torch.manual_seed(seed)
    config = grpo.GRPOConfig(group_size=4, max_new_tokens=24, **cfg)
    return grpo.sample_completions(model, tok, PROMPTS, config, greedy=greedy,
                                   group_size=1 if greedy else None,
                                   sample=sampler(model, tok, name, min_new_tokens,
                                                  sample_batch_size))


# --- the engine draws exactly the page's tokens, and the page the uncached sampler's -------------
@pytest.mark.parametrize("pair", [("engine", "plain"), ("plain", "uncached")])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setting", [dict(temperature=0.7), dict(temperature=1.0),
                                     dict(greedy=True, min_new_tokens=10)],
                         ids=["t0.7", "t1.0", "greedy-floor"])
def test_engine_draws_the_reference_samplers_tokens(tiny, arch, setting, pair):
    """Same seed, same settings: engine.decode and grpo.decode (the page's), and grpo.decode and
    uncached_decode, give identical token ids, masks, texts, truncation flags and (within float
    tolerance) the sampler's log-probs, for sampled (two temperatures) and greedy decoding with a
    length floor. The draws are not trivial: the rows differ from each other."""
    tok, model = tiny[0], model_for(arch, tiny)
    fast, slow = (sample(model, tok, s, **setting) for s in pair)
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(fast[key], slow[key]), key
    torch.testing.assert_close(fast["sampler_logp"], slow["sampler_logp"], atol=1e-5, rtol=1e-5)
    assert fast["completions"] == slow["completions"]
    assert len(set(fast["completions"])) > 1
    assert fast["completion_ids"].shape[1] > 5


def assert_same_logits_as_the_reference(model, tok, sampler, monkeypatch):
    """Equal tokens could hide a slightly wrong distribution (a random tiny model rarely flips a
    draw under a 1% logit error), so compare what each sampler hands to grpo.draw_tokens: the
    logits of every step, before the draw, within float tolerance."""
    seen, real = [], grpo.draw_tokens

    def spy(logits, t, done, **kw):
        seen[-1].append(logits.clone())
        return real(logits, t, done, **kw)

    monkeypatch.setattr(grpo, "draw_tokens", spy)
    for s in (sampler, "uncached"):
        seen.append([])
        sample(model, tok, s, temperature=0.7)
    fast, slow = seen
    assert len(fast) == len(slow) > 5
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["engine", "plain"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_hands_draw_tokens_the_reference_logits(tiny, arch, name, monkeypatch):
    """engine.decode's and grpo.decode's logits at every step are the uncached sampler's."""
    assert_same_logits_as_the_reference(model_for(arch, tiny), tiny[0], name, monkeypatch)


def test_a_different_seed_draws_different_tokens(tiny):
    """So the equality above is not two samplers ignoring the seed in the same way."""
    tok, model = tiny
    a, b = sample(model, tok, "engine", seed=0), sample(model, tok, "engine", seed=1)
    assert not torch.equal(a["completion_ids"], b["completion_ids"])


def contains_a(completions, **kw):
    """A reward with signal on random text: 1 where the completion holds an 'a'."""
    return [float("a" in c) for c in completions]


def one_step(base, tok, sampler: str | None, checkpointing: bool = False,
             update_in_backward: bool = False, **engine_config):
    """One grpo_step from a copy of base's weights, seed 0, with engine.apply's seams for this
    sampler (None: grpo.Seams(), the page alone): (its metrics, the step time left out, with the
    samples; the updated weights; how many layers were compiled). As train_gsm8k.py does, the
    'compiled' sampler compiles the decoder layers too."""
    from machinery import memory
    policy = copy.deepcopy(base)
    if checkpointing:
        engine.enable_activation_checkpointing(policy)
    policy.train()
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=12, lr=1e-2,
                          micro_batch_size=8 if update_in_backward else 16)
    ecfg = engine.EngineConfig(sampler=sampler or "plain", **engine_config)
    seams = grpo.Seams() if sampler is None else engine.apply(
        ecfg, grpo.Seams(), grpo.eos_token_ids(policy, tok), grpo.pad_token_id(policy, tok))
    seams = memory.apply(memory.MemoryConfig(update_in_backward=update_in_backward), seams)
    ref = grpo.make_reference(policy)
    n_compiled = engine.compile_layers(ecfg, update_in_backward, policy, ref)
    torch.manual_seed(0)
    m = grpo.grpo_step(policy, ref, grpo.make_optimizer(policy, cfg), tok, ["Q1", "Q22"],
                       [contains_a], cfg, return_samples=True, seams=seams)
    m.pop("step_time")
    return m, policy.state_dict(), n_compiled


def test_a_whole_grpo_step_is_the_same_with_either_sampler(tiny):
    """One full grpo_step with the engine's sampler and one with the page's (grpo.Seams()), from
    the same seed and weights, both scoring with the page's plain forward: every metric (but the
    time and the sampler-trainer agreement), every logged sample and every updated weight are
    equal. The agreement measures the sampler itself: both keep a KV cache (rounding, ~1e-8)."""
    tok, base = tiny
    (m_fast, w_fast, _), (m_slow, w_slow, _) = (
        one_step(base, tok, "engine", share_prompts=False), one_step(base, tok, None))
    gap = "sampling/logp_difference/mean"
    assert 0 <= m_slow[gap] < 1e-6 and 0 <= m_fast[gap] < 1e-6
    assert m_fast["sampling/ratio_outside_0.9_1.1"] == m_slow["sampling/ratio_outside_0.9_1.1"] == 0
    assert ({k: v for k, v in m_fast.items() if k != gap}
            == {k: v for k, v in m_slow.items() if k != gap}) and m_fast["reward_std"] > 0
    assert all(torch.equal(w_fast[k], w_slow[k]) for k in w_fast)


@pytest.mark.parametrize("skip_pads", [False, True])
def test_the_engines_whole_step_lands_where_the_pages_does(tiny, skip_pads):
    """train_gsm8k.py's default machinery (engine.apply: the fast sampler and each prompt scored
    once; and with --skip-pads, the output layer only at completion tokens) against the page
    alone, one grpo_step from the same seed and weights: the same samples, and every metric and
    updated weight within float tolerance (the shared prompt pass sums the same products in
    another order)."""
    tok, base = tiny
    fast, w_fast, _ = one_step(base, tok, "engine", skip_pads=skip_pads)
    slow, w_slow, _ = one_step(base, tok, None)
    assert [s["completion"] for s in fast["samples"]] == [s["completion"] for s in slow["samples"]]
    assert slow["reward_std"] > 0 and slow["grad_norm"] > 0
    for key in ("loss", "kl", "entropy", "grad_norm", "reward"):
        assert fast[key] == pytest.approx(slow[key], rel=1e-4, abs=1e-6), key
    assert any(not torch.equal(w_slow[k], base.state_dict()[k]) for k in w_slow)
    for k in w_slow:
        torch.testing.assert_close(w_fast[k], w_slow[k], atol=1e-4, rtol=1e-4)


# --- --draw inverse-cdf: the same distribution, drawn from N numbers, not N x V -------------------
def slow_inverse_cdf(logits, temperature, seed):
    """The obvious inverse transform, one row at a time in Python floats: u ~ U[0, 1) from the same
    generator, then walk the tokens, summing softmax(logits / temperature), to the first whose
    running sum exceeds u times the row's total."""
    torch.manual_seed(seed)
    u = torch.rand(logits.shape[0], 1, dtype=torch.float64)                      # (N, 1)
    probs = torch.softmax(logits / temperature, -1).tolist()
    ids = []
    for row, (r,) in zip(probs, u.tolist()):
        target, running = r * sum(row), 0.0
        ids.append(next(i for i, p in enumerate(row) if (running := running + p) > target))
    return torch.tensor(ids)


def test_inverse_cdf_draws_the_slow_walks_tokens_and_draw_tokens_log_probs():
    """draw_by_inverse_cdf against slow_inverse_cdf token for token, 64 rows of a 300-token
    vocabulary; its log-probs are grpo.draw_tokens' formula for the same tokens; a finished row
    gets the pad and an EOS ends its row; greedy is grpo.draw_tokens' argmax."""
    torch.manual_seed(1)
    logits, eos, pad = 3 * torch.randn(64, 300), torch.tensor([7]), 0                # (N, V)
    done = torch.zeros(64, dtype=torch.bool)
    done[:4] = True
    kw = dict(eos=eos, pad_id=pad, temperature=0.7, greedy=False)
    torch.manual_seed(5)
    ids, now_done, logp = engine.draw_by_inverse_cdf(logits, 0, done, **kw)
    slow = slow_inverse_cdf(logits, 0.7, seed=5)
    assert torch.equal(ids[4:], slow[4:]) and (ids[:4] == pad).all()
    assert len(set(ids.tolist())) > 20  # drawn, not one token
    scaled = logits / 0.7
    expected = scaled.gather(-1, ids[:, None]).squeeze(1) - scaled.logsumexp(-1)
    torch.testing.assert_close(logp, expected, atol=1e-6, rtol=0)
    assert torch.equal(now_done, done | (ids == 7))
    logits[10, 7] = 100.0  # row 10 must draw the EOS now
    assert engine.draw_by_inverse_cdf(logits, 0, done, **kw)[1][10]
    greedy = engine.draw_by_inverse_cdf(logits, 0, done, **{**kw, "greedy": True})
    for a, b in zip(greedy, grpo.draw_tokens(logits, 0, done, **{**kw, "greedy": True})):
        assert torch.equal(a, b)


def test_inverse_cdf_draws_the_policys_distribution_and_never_a_zero_probability_token():
    """40,000 draws from one distribution of 6 tokens, one of them impossible (logit -inf), one
    rare (p ~ 0.002): each token's frequency lies within 5 standard errors of its probability,
    and the impossible one is never drawn, not even where the uniform draw is exactly 0."""
    logits = torch.tensor([2.0, 0.0, -float("inf"), 1.0, -4.0, 0.5]).repeat(40_000, 1)
    done, kw = torch.zeros(40_000, dtype=torch.bool), dict(eos=torch.tensor([99]), pad_id=0,
                                                          temperature=1.0, greedy=False)
    torch.manual_seed(0)
    ids = engine.draw_by_inverse_cdf(logits, 0, done, **kw)[0]
    p = torch.softmax(logits[0], -1)
    freq = torch.bincount(ids, minlength=6).double() / len(ids)
    se = (p * (1 - p) / len(ids)).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq, p)
    assert freq[2] == 0 and freq[4] > 0
    zero = torch.zeros(2, 1, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "rand", lambda *a, **k: zero)
        ids = engine.draw_by_inverse_cdf(torch.tensor([[-float("inf"), 0.0, 1.0]] * 2), 0,
                                         done[:2], **kw)[0]
    assert (ids == 1).all()


def test_the_engine_samples_by_inverse_cdf_from_the_distribution_the_loss_scores(tiny):
    """EngineConfig(draw="inverse-cdf") through grpo.sample_completions: other tokens than
    multinomial's from the same seed, and each sampled log-prob is token_logprobs' for its token
    (the sampler draws from the distribution the loss scores). Anything but grpo.draw_tokens as
    `pick` is refused in one line."""
    tok, model = tiny
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=16, temperature=0.7)
    eos, pad = grpo.eos_token_ids(model, tok), grpo.pad_token_id(model, tok)
    batches = {}
    for draw in ("multinomial", "inverse-cdf"):
        seams = engine.apply(engine.EngineConfig(draw=draw), grpo.Seams(), eos, pad)
        torch.manual_seed(0)
        batches[draw] = grpo.sample_completions(model, tok, PROMPTS, cfg, sample=seams.sample)
    b = batches["inverse-cdf"]
    assert not torch.equal(b["completion_ids"], batches["multinomial"]["completion_ids"])
    ours = grpo.token_logprobs(model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"],
                               b["completion_mask"], temperature=0.7)
    m = b["completion_mask"].bool()
    torch.testing.assert_close(b["sampler_logp"][m], ours[m], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="replaces grpo.draw_tokens"):
        engine.drawn_by_inverse_cdf(engine.decode)(model, b["prompt_ids"], b["prompt_mask"], 2, 4,
                                                   lambda logits, t, done: None)
    with pytest.raises(ValueError, match="draw must be"):
        engine.EngineConfig(draw="gumbel")


# --- the engine's shortcuts, pinned ---------------------------------------------------------------
def test_ready_4d_mask_only_for_full_sdpa_attention(tiny):
    """The 4D-mask shortcut is for SDPA with full attention only; a sliding window or eager kernel
    opts out."""
    _, model = tiny
    assert engine.sdpa_full_attention(model)
    sliding = copy.deepcopy(model)
    sliding.config.sliding_window = 16
    assert not engine.sdpa_full_attention(sliding)
    sliding.config.sliding_window = None
    sliding.config.layer_types = ["full_attention", "sliding_attention"]
    assert not engine.sdpa_full_attention(sliding)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_decode_step_sees_the_logits_of_a_full_forward(tiny, arch):
    """The logits behind every sampled token (caught by a hook on the output layer) equal one
    uncached forward over the finished, left-padded sequences. This pins the KV cache, the padding
    mask (2D or the ready 4D one) and the position ids together. A random tiny model samples the
    same tokens under small mask errors, so token-level checks cannot see them; this one can."""
    tok, model = tiny[0], model_for(arch, tiny)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, inp, out: seen.append(out[:, -1].clone()))
    cfg = grpo.GRPOConfig(group_size=2, max_new_tokens=8)
    torch.manual_seed(0)
    batch = grpo.sample_completions(model, tok, ["What is 2+3? Then add 17 and 45.", "Hi"], cfg,
                                    sample=sampler(model, tok, "engine", min_new_tokens=8))
    hook.remove()
    P, T = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    assert len(seen) == T and (batch["prompt_mask"] == 0).sum() >= 2 * 25  # "Hi" behind 25+ pads
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)             # (N, P+T)
    mask = torch.cat([batch["prompt_mask"], torch.ones_like(batch["completion_ids"])], 1)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask,
                     position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits        # (N, P+T, V)
    for t in range(T):
        step = seen[0].repeat_interleave(2, 0) if t == 0 else seen[t]  # one prefill per prompt
        torch.testing.assert_close(step, full[:, P - 1 + t], atol=1e-5, rtol=1e-5)


# --- both samplers against transformers' generate() -----------------------------------------------
@pytest.mark.parametrize("name", ["engine", "plain"])
@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_distribution_is_the_one_the_loss_scores(tiny, arch, name):
    """Each sampler draws exactly the tokens transformers' generate() draws from the same seed, and
    the log-probs generate() sampled from (its processed scores, at temperature 0.7 and with no
    top-k) equal token_logprobs on the same left-padded sequences. This catches a hidden top_k=50,
    a temperature mismatch, and (on GPT-2) positions that differ between sampling and scoring."""
    tok, model = tiny[0], model_for(arch, tiny)
    cfg = grpo.GRPOConfig(group_size=3, max_new_tokens=12, temperature=0.7)
    torch.manual_seed(0)
    batch = grpo.sample_completions(model, tok, ["What is 2+3?", "Hi"], cfg,
                                    sample=sampler(model, tok, name))
    torch.manual_seed(0)
    out = model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"],
                         do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=12,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, batch["prompt_ids"].shape[1]:], batch["completion_ids"])
    scores = torch.stack(out.scores, 1).log_softmax(-1)                          # (N, T, V)
    sampled = scores.gather(-1, batch["completion_ids"][..., None]).squeeze(-1)  # (N, T)
    ours = grpo.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                               batch["completion_ids"], batch["completion_mask"], temperature=0.7)
    m = batch["completion_mask"].bool()
    torch.testing.assert_close(ours[m], sampled[m], atol=1e-4, rtol=1e-4)
    # no truncation: at least one sampled token lay outside the top 50 of its distribution
    rank = scores.argsort(-1, descending=True).argsort(-1)                       # (N, T, V)
    assert (rank.gather(-1, batch["completion_ids"][..., None]).squeeze(-1)[m] >= 50).any()


@pytest.mark.parametrize("name", ["engine", "plain"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_min_new_tokens_match_generate(tiny, arch, name):
    """Greedy decoding with a length floor: each sampler and generate() give the same tokens."""
    tok, model = tiny[0], model_for(arch, tiny)
    cfg = grpo.GRPOConfig(max_new_tokens=10)
    batch = grpo.sample_completions(model, tok, ["What is 2+3?", "Hi"], cfg, greedy=True,
                                    group_size=1, sample=sampler(model, tok, name, 6))
    out = model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"],
                         do_sample=False, max_new_tokens=10, min_new_tokens=6,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert torch.equal(out[:, batch["prompt_ids"].shape[1]:], batch["completion_ids"])
    assert (batch["completion_mask"].sum(1) >= 6).all()


# --- compiled decoding: a static KV cache and the decode step under torch.compile -----------------
COMPILED_ARCHS = ["llama", pytest.param("llama-eager", marks=pytest.mark.slow),
                  pytest.param("gpt2", marks=pytest.mark.slow),
                  pytest.param("qwen2", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def compiled_models(tiny):
    """One model per architecture for the whole module, so each compiles once."""
    tok = tiny[0]
    return {"llama": tiny[1], "llama-eager": model_for("llama-eager", tiny),
            "gpt2": tiny_gpt2(tok), "qwen2": tiny_world.tiny_qwen2(tok)}


def no_fallback(capsys):
    """The compiled path really ran: engine.decode_compiled prints a NOTE when it falls back."""
    assert "compiled decoding is off" not in capsys.readouterr().err


@pytest.mark.parametrize("arch", COMPILED_ARCHS)
def test_compiled_decoding_draws_the_reference_samplers_tokens(tiny, compiled_models, arch,
                                                               capsys):
    """Same seed: engine.decode_compiled gives exactly grpo.decode's tokens, masks and
    texts, sampled at two temperatures and greedy with a length floor, and with early EOS: the
    EOS ids are set to the three tokens these random models draw most, so most rows stop early
    and the static cache's rows go on past their end. Every setting shares one shape (one
    compile)."""
    tok, model = tiny[0], compiled_models[arch]
    for setting in (dict(greedy=True, min_new_tokens=10), dict(temperature=0.7),
                    dict(temperature=1.0)):
        fast, slow = (sample(model, tok, s, **setting) for s in ("compiled", "plain"))
        for key in ("completion_ids", "completion_mask", "truncated"):
            assert torch.equal(fast[key], slow[key]), (setting, key)
        assert fast["completions"] == slow["completions"]
        assert len(set(fast["completions"])) > 1 or setting.get("greedy")
    no_fallback(capsys)
    common = torch.bincount(slow["completion_ids"].flatten()).topk(3).indices.tolist()
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = common  # three EOS ids, as chat models have several
    try:
        fast, slow = (sample(model, tok, s, temperature=1.0) for s in ("compiled", "plain"))
    finally:
        model.generation_config.eos_token_id = eos
    assert torch.equal(fast["completion_ids"], slow["completion_ids"])
    lengths = fast["completion_mask"].sum(1)
    assert (lengths < 24).sum() > len(lengths) // 2 and lengths.max() > lengths.min()
    no_fallback(capsys)


@pytest.mark.parametrize("arch", COMPILED_ARCHS)
def test_compiled_decoding_hands_draw_tokens_the_reference_logits(tiny, compiled_models, arch,
                                                                  monkeypatch, capsys):
    """The compiled step's logits at every step are the uncached sampler's, within float
    tolerance: this pins the static cache's slots, the mask and the position ids, which a token
    check on a random model can miss (a stale position id changes no Llama token here)."""
    assert_same_logits_as_the_reference(compiled_models[arch], tiny[0], "compiled", monkeypatch)
    no_fallback(capsys)


def test_a_second_step_with_other_prompt_lengths_does_not_recompile(tiny, capsys):
    """Prompt lengths change from step to step; the cache's prompt slots are rounded up to
    engine.PROMPT_BUCKET and only ever grow, so a second step whose prompts are shorter or
    longer (within the bucket) runs the graph the first compiled, under torch's
    fail_on_recompile stance. A prompt past the bucket gets a wider cache: one new compile."""
    tok, model = tiny
    cfg = grpo.GRPOConfig(group_size=2, max_new_tokens=6)
    compiled = sampler(model, tok, "compiled")
    grpo.sample_completions(model, tok, ["What is 2+3?", "Hi"], cfg, sample=compiled)  # P = 12
    _, first = engine._caches[model][(4, 6, torch.float32, torch.device("cpu"))]
    with torch.compiler.set_stance("fail_on_recompile"):
        for prompts in (["What is 2+3? Then add 17 and 45.", "Hi"], ["Q", "7*8"]):     # 32, 3
            before = engine.compile_seconds()
            grpo.sample_completions(model, tok, prompts, cfg, sample=compiled)
            assert engine.compile_seconds() == before > 0
    no_fallback(capsys)
    assert first == engine.PROMPT_BUCKET
    grpo.sample_completions(model, tok, ["x" * (engine.PROMPT_BUCKET + 1), "Hi"], cfg,
                            sample=compiled)                                        # wider
    assert engine._caches[model][(4, 6, torch.float32, torch.device("cpu"))][1] == \
        2 * engine.PROMPT_BUCKET
    grpo.sample_completions(model, tok, ["Hi", "Q"], cfg, sample=compiled)  # fit the wider cache
    no_fallback(capsys)


def test_compiled_decoding_falls_back_with_its_reason_printed_once(tiny, capsys, monkeypatch):
    """Where it cannot run, decode_compiled draws with decode() instead and says why, once:
    a sliding-window model (compile_blocker), and a compile that fails after some tokens were
    drawn, whose draws are rewound, so the tokens are still exactly the seed's. A model whose
    compile failed is not tried again at the next step."""
    tok, model = tiny
    sliding = copy.deepcopy(model)
    sliding.config.sliding_window = 16
    for _ in range(2):
        fast, slow = (sample(sliding, tok, s) for s in ("compiled", "engine"))
        assert torch.equal(fast["completion_ids"], slow["completion_ids"])
    assert capsys.readouterr().err.count("compiled decoding is off (sliding-window") == 1

    calls = []

    def breaks_on_the_third_token(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("no C++ compiler found")
        return engine._decode_step(*args)

    monkeypatch.setattr(engine, "compiled_step", lambda device_type: breaks_on_the_third_token)
    broken = copy.deepcopy(model)  # WHY a copy: the shared model must stay compilable for others
    fast, slow = (sample(broken, tok, s) for s in ("compiled", "plain"))
    assert len(calls) == 3 and torch.equal(fast["completion_ids"], slow["completion_ids"])
    assert "compiled decoding is off (RuntimeError: no C++ compiler found)" in \
        capsys.readouterr().err
    again = sample(broken, tok, "compiled")
    assert len(calls) == 3 and torch.equal(again["completion_ids"], slow["completion_ids"])
    assert "compiled decoding is off" not in capsys.readouterr().err   # said once already


def test_compile_auto_turns_on_where_the_decode_steps_pay_for_it():
    """--compile auto: on from engine.AUTO_COMPILE_DECODE_STEPS (100,000) decode steps. The quick
    start (60 steps x 96 tokens = 5,760) stays eager; the Qwen preset (200 x 512 = 102,400)
    compiles.
    'on' and 'off' force it (off also turns a resumed run's 'compiled' back to 'engine'); auto
    keeps a sampler chosen by name, and 'plain' always stays."""
    assert engine.AUTO_COMPILE_DECODE_STEPS == 100_000
    assert engine.sampler_for("auto", "engine", 60 * 96) == "engine"
    assert engine.sampler_for("auto", "engine", 200 * 512) == "compiled"
    assert engine.sampler_for("auto", "engine", 100_000) == "compiled"
    assert engine.sampler_for("auto", "engine", 99_999) == "engine"
    assert engine.sampler_for("on", "engine", 1) == "compiled"
    assert engine.sampler_for("off", "engine", 10**9) == "engine"
    assert engine.sampler_for("on", "plain", 10**9) == "plain"
    assert engine.sampler_for("off", "compiled", 10**9) == "engine"
    assert engine.sampler_for("auto", "compiled", 1) == "compiled"
    assert engine.sampler_for("off", "plain", 1) == "plain"


@pytest.mark.parametrize("checkpointing,in_backward",
                         [(False, False), pytest.param(True, False, marks=pytest.mark.slow),
                          (False, True)], ids=["plain", "checkpointing", "update-in-backward"])
def test_compiled_layers_give_the_eager_step_within_float_tolerance(tiny, checkpointing,
                                                                     in_backward):
    """One whole grpo_step with --compile on (compiled decoding and compiled decoder layers, as
    train_gsm8k.py sets them) against the eager step, from the same seed and weights: the same
    tokens, the same metrics and the same updated weights, within float tolerance (the fused
    kernels round differently). With gradient checkpointing too, and with AdamW stepped inside
    backward against the plain eager update: there decoding is compiled and the layers stay
    eager, since a compiled layer's backward refuses the second pass over its graph. Each prompt
    is scored G times here (share_prompts=False): with it on, the layers are not compiled."""
    tok, base = tiny
    (fast, w_fast, n_fast), (slow, w_slow, n_slow) = (
        one_step(base, tok, s, checkpointing, fast, share_prompts=False)
        for s, fast in (("compiled", in_backward), ("engine", False)))
    assert (n_fast, n_slow) == (0 if in_backward else 4, 0)
    # NOTE: scoring each prompt once hands the layers a KV cache: they stay eager then.
    assert engine.compile_layers(engine.EngineConfig(sampler="compiled"), False,
                                 copy.deepcopy(base)) == 0
    assert [s["completion"] for s in fast["samples"]] == [s["completion"] for s in slow["samples"]]
    assert slow["reward_std"] > 0 and slow["grad_norm"] > 0
    for key in ("loss", "kl", "entropy", "grad_norm", "reward"):
        assert fast[key] == pytest.approx(slow[key], rel=1e-4, abs=1e-6), key
    moved = [k for k in w_slow if not torch.equal(w_slow[k], base.state_dict()[k])]
    assert moved
    # NOTE: AdamW moves each weight by about lr (1e-2) whatever its gradient's size, so where a
    #       gradient is near 0 its rounding shows in the step: allow 1% of one step.
    for k in w_slow:
        torch.testing.assert_close(w_fast[k], w_slow[k], atol=1e-4, rtol=1e-4)


# --- sampling in batches (EngineConfig.sample_batch_size) ----------------------------------------
@pytest.mark.parametrize("name", ["engine", "plain"])
@pytest.mark.parametrize("rows", [3, 5, 8], ids=["split-groups", "one-group-a-piece", "2-groups"])
def test_sampling_in_batches_keeps_the_rows_in_their_groups(tiny, name, rows, monkeypatch):
    """sample_batch_size = rows: greedy decoding (every copy of a prompt alike) gives the same
    completions, masks, truncation flags and ids, pads included, as one batch, although the pieces
    stop at different lengths (one token made EOS); no decode call gets more than `rows`
    rows. 3 splits each group of 4 into 3 + 1, 5 holds one group, 8 two groups."""
    tok, model = tiny
    first = sample(model, tok, "engine", greedy=True)["completion_ids"]  # one row a prompt
    # WHY: the 4th token of prompt 0's greedy completion as EOS ends that group early
    monkeypatch.setattr(model.generation_config, "eos_token_id", [int(first[0, 3])])
    calls = []

    def spy(model, prompt_ids, prompt_mask, group_size, max_new_tokens, pick):
        calls.append(prompt_ids.shape[0] * group_size)
        return DECODERS[name](model, prompt_ids, prompt_mask, group_size, max_new_tokens, pick)

    def greedy(rows=0):
        config = grpo.GRPOConfig(group_size=4, max_new_tokens=24)
        return grpo.sample_completions(model, tok, PROMPTS, config, greedy=True,
                                       sample=engine.in_batches(spy, rows, tok.pad_token_id))

    whole = greedy()
    calls.clear()
    pieces = greedy(rows)
    assert max(calls) <= rows and sum(calls) == 12 and len(calls) > 1
    for key in ("completion_ids", "completion_mask", "truncated", "prompt_ids"):
        assert torch.equal(pieces[key], whole[key]), key
    assert pieces["completions"] == whole["completions"]
    lengths = whole["completion_mask"].sum(1)
    assert lengths.max() > lengths.min()  # the pieces did end at different lengths


def test_sampling_in_batches_draws_from_the_policy(tiny):
    """Sampled, not greedy: the rows differ from one another, every one is a valid completion
    (a mask of ones up to its end), and a batch of all N rows is the one-batch path exactly."""
    tok, model = tiny
    one = sample(model, tok, "engine")
    same = sample(model, tok, "engine", sample_batch_size=12)
    assert torch.equal(one["completion_ids"], same["completion_ids"])
    split = sample(model, tok, "engine", sample_batch_size=2)
    assert split["completion_ids"].shape[0] == 12 and len(set(split["completions"])) > 1
    mask = split["completion_mask"]
    assert torch.equal(mask, mask.cummin(1).values)  # ones, then zeros: no holes


def test_the_agreement_metric_sees_a_sampler_that_differs(tiny, monkeypatch):
    """sampling/logp_difference/mean: the sampler's log-probs of its own tokens against the
    trainer's. Both in fp32: under 1e-6, no token's ratio outside [0.9, 1.1]. A sampler run under
    bf16 autocast while the trainer scores in fp32, the mismatch the metric exists for: more
    than 1000 times larger."""
    tok, base = tiny
    m32 = one_step(base, tok, "engine")[0]
    real = grpo.sample_completions

    def bf16_sampler(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "sample_completions", bf16_sampler)
    m16 = one_step(base, tok, "engine")[0]
    assert m32["sampling/logp_difference/mean"] < 1e-6
    assert m32["sampling/ratio_outside_0.9_1.1"] == 0
    assert m16["sampling/logp_difference/mean"] > 1000 * max(m32["sampling/logp_difference/mean"],
                                                             1e-9)


def test_sampling_leaves_the_model_in_the_mode_it_found(tiny):
    """grpo.sample_completions samples in eval mode (under gradient checkpointing, train mode turns
    the KV cache off) and hands the model back in its own mode, after an error too."""
    tok, model = tiny
    model = copy.deepcopy(model).train()
    modes = []

    def spy(model, *args):
        modes.append(model.training)
        return grpo.decode(model, *args)

    sample_kw = dict(cfg=grpo.GRPOConfig(max_new_tokens=3), sample=spy)
    grpo.sample_completions(model, tok, ["Hi"], **sample_kw)
    assert modes == [False] and model.training

    def broken(*args):
        raise RuntimeError("inside")
    with pytest.raises(RuntimeError, match="inside"):
        grpo.sample_completions(model, tok, ["Hi"], grpo.GRPOConfig(), sample=broken)
    assert model.training and not model.eval().training
    grpo.sample_completions(model, tok, ["Hi"], **sample_kw)
    assert not model.training


# --- scoring each prompt once (EngineConfig.share_prompts) ---------------------------------------
def scored_batch(tok, G=3, T=9):
    """PROMPTS (3 lengths, left-padded) with G random completions of T tokens each, some of which
    end early: EOS, then pads and a zero mask, as sample_completions lays them out."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(tok), (len(PROMPTS) * G, T), generator=g)              # (n, T)
    ends = torch.tensor([T, 4, T, 1, 6, T, T, 2, T])[:len(PROMPTS) * G]              # (n,)
    mask = (torch.arange(T)[None, :] < ends[:, None]).long()                         # (n, T)
    ids = torch.where(mask.bool(), ids, tok.pad_token_id)
    ids[torch.arange(len(ends)), (ends - 1).clamp(max=T - 1)] = tok.eos_token_id
    return (enc["input_ids"].repeat_interleave(G, 0), enc["attention_mask"].repeat_interleave(G, 0),
            ids, mask)


def embedded_tokens(model):
    """A list that the model's input embedding appends the number of token ids it sees to."""
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(
        args[0].numel()))
    return seen


@pytest.mark.parametrize("skip_pads", [False, True])
@pytest.mark.parametrize("arch", ["llama", "llama-eager", "gpt2", "qwen2"])
def test_scoring_each_prompt_once_gives_the_whole_sequences_logprobs_and_gradient(tiny, arch,
                                                                                 skip_pads):
    """engine.shared_token_logprobs runs each of the 3 distinct prompts once and only the
    completions per row: the embedding sees 3 x (P-1) + 9 x T token ids instead of 9 x (P+T).
    Its log-probs and entropies (every position, before and after EOS; with skip_pads, every
    completion token, and 0 at the pads, where the output layer saw only the k kept positions)
    and the gradient of a masked, weighted sum of them equal the whole-sequence forward's within
    float tolerance (the same sums, in another order), on SDPA and eager attention, GPT-2's
    absolute positions and Qwen2's grouped-query attention with q/k/v biases."""
    tok = tiny[0]
    model = copy.deepcopy(tiny_world.tiny_qwen2(tok) if arch == "qwen2" else model_for(arch, tiny))
    assert engine.share_blocker(model) is None
    prompt_ids, prompt_mask, ids, mask = scored_batch(tok)
    (n, P), T = prompt_ids.shape, ids.shape[1]
    weights = torch.linspace(-1, 2, n * T).reshape(n, T) * mask                      # (n, T)
    seen = embedded_tokens(model)
    heads = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: heads.append(out.shape))
    results = {}
    for share in (False, True):
        seen.clear()
        model.zero_grad()
        score = (functools.partial(engine.shared_token_logprobs, skip_pads=skip_pads) if share
                 else grpo.token_logprobs)
        logp, entropy = score(model, prompt_ids, prompt_mask, ids, mask, 0.7, True)
        (logp * weights).sum().backward()
        results[share] = (logp.detach(), entropy, [p.grad.clone() for p in model.parameters()],
                          sum(seen))
    assert results[False][3] == n * (P + T) and results[True][3] == 3 * (P - 1) + n * T
    k = int(mask.sum())
    assert (heads[-1][:-1] == (k,)) == skip_pads and 0 < k < n * T  # the pads were skipped
    keep = mask.bool() if skip_pads else torch.ones_like(mask, dtype=torch.bool)
    for shared, whole in zip(results[True][:2], results[False][:2]):
        torch.testing.assert_close(shared[keep], whole[keep], atol=1e-5, rtol=1e-5)
        assert (shared[~keep] == 0).all()
    # the hook is gone: the next forward's output layer sees every position again
    model(input_ids=ids, attention_mask=mask)
    assert heads[-1] == (n, T, len(tok))
    for shared, whole in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(shared, whole, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in results[False][2])


def test_scoring_each_prompt_once_steps_aside_where_it_cannot_help_or_run(tiny):
    """engine.shared_logits gives None, and grpo.token_logprobs then runs its whole-sequence
    forward (the embedding sees n x (P+T) ids): when no two neighbouring rows share a prompt; in a
    training pass with gradient checkpointing, whose layers drop the KV cache; and for a sliding
    window. A no-gradient pass (π_ref) on a checkpointed model still shares."""
    tok, base = tiny
    prompt_ids, prompt_mask, ids, mask = scored_batch(tok)
    (n, P), T = prompt_ids.shape, ids.shape[1]
    whole_ids, whole_mask = torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, mask], 1)
    assert engine.shared_logits(base, whole_ids, whole_mask, T) is not None
    assert engine.shared_logits(base, whole_ids[::3], whole_mask[::3], T) is None
    checkpointed = copy.deepcopy(base)
    engine.enable_activation_checkpointing(checkpointed)
    checkpointed.train()
    assert "checkpointing" in engine.share_blocker(checkpointed)
    seen = embedded_tokens(checkpointed)
    logp = engine.shared_token_logprobs(checkpointed, prompt_ids, prompt_mask, ids, mask)
    assert seen == [n * (P + T)]
    torch.testing.assert_close(logp, grpo.token_logprobs(base, prompt_ids, prompt_mask, ids, mask))
    seen.clear()
    with torch.no_grad():
        engine.shared_token_logprobs(checkpointed, prompt_ids, prompt_mask, ids, mask)
    assert sum(seen) == 3 * (P - 1) + n * T
    sliding = copy.deepcopy(base)
    sliding.config.sliding_window = 16
    assert "sliding" in engine.share_blocker(sliding)
    assert engine.shared_logits(sliding, whole_ids, whole_mask, T) is None


@pytest.mark.parametrize("skip_pads", [False, True])
def test_a_frozen_reference_scores_shared_prompts_bit_for_bit_as_the_policy(tiny, skip_pads):
    """At step 1 π_ref is a frozen copy of π_θ, and with every advantage 0 the update must be
    exactly 0: the KL term's gradient is 0 only if log π_ref equals log π_θ bit for bit. With
    shared prompts, a frozen copy (weights without gradients, eval mode, no_grad) scores exactly
    what the policy's training pass scores. (A first version took the first completion token's
    logit from the prompt's own forward, where torch's matmul rounds differently for weights
    that need gradients: 2e-7 apart, and the weights moved in a step with no signal.)"""
    tok = tiny[0]
    policy = grpo.disable_dropout(copy.deepcopy(tiny[1])).train()
    inputs = scored_batch(tok)
    logp, _ = engine.shared_token_logprobs(policy, *inputs, 1.0, True, skip_pads=skip_pads)
    with torch.no_grad():
        ref = engine.shared_token_logprobs(grpo.make_reference(policy), *inputs, 1.0, False,
                                           skip_pads=skip_pads)
    assert torch.equal(logp, ref)


# --- the KV cache fills one buffer instead of a new copy per token ------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_the_in_place_cache_holds_what_a_growing_cache_holds_in_one_buffer(tiny, arch):
    """engine.in_place_cache against transformers' DynamicCache, fed the same prefill of 3 prompts
    repeated G = 2 times and 3 decode tokens: the same keys and values after every step, in a
    buffer that never moves; and past its planned length it goes on by copies, still the same.
    The bug it catches: a cache that grows by a copy per token again (the buffer's address
    changes), or one that repeats rows out of their groups or writes a token in the wrong slot."""
    from transformers import DynamicCache
    tok, model = tiny[0], model_for(arch, tiny)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    P, G, kv = ids.shape[1], 2, engine.cache_kwarg(model)
    caches = [engine.in_place_cache(model, P + 2), DynamicCache(config=model.config)]
    assert caches[0] is not None
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{kv: c})
            c.batch_repeat_interleave(G)
        where = [b.data_ptr() for b in caches[0].layers[0].buffers]
        full = mask.repeat_interleave(G, 0)
        for t in range(3):                        # the third token is past the planned P + 2
            new = torch.full((len(PROMPTS) * G, 1), 5 + t)
            full = torch.cat([full, torch.ones_like(full[:, :1])], 1)
            for c in caches:
                model(input_ids=new, attention_mask=full, use_cache=True, **{kv: c})
            for a, b in zip(*(c.layers for c in caches)):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            if t < 2:
                assert [b.data_ptr() for b in caches[0].layers[0].buffers] == where
    assert caches[0].layers[0].keys.shape[2] == P + 3
