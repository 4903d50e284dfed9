"""Pins every equation in grpo.py with hand-worked numbers, and checks fast code against slow,
obvious code.

Needs: torch and transformers only (the model is a tiny random Llama built in memory). CPU, offline,
~15 s.
"""

import math
import statistics

import pytest
import torch

import grpo
import rewards
from recipe import tiny_world

LN2 = math.log(2.0)


# --- 3. group advantages --------------------------------------------------------------------------
def test_advantages_hand_worked():
    """rewards [1, 0, 0, 1]: mean 0.5; sample std = sqrt(4 * 0.25 / 3) = 0.57735;
    A = ±0.5 / (0.57735 + 1e-4) = ±0.86588."""
    A = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    assert A.tolist() == pytest.approx([0.86588, -0.86588, -0.86588, 0.86588], abs=1e-5)


def test_advantages_equal_rewards_are_zero_not_nan():
    """All-equal groups: centred rewards are exactly 0, std is 0, so A = 0 / (0 + 1e-4) = 0."""
    A = grpo.group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3]),
                              group_size=3)
    assert torch.isfinite(A).all()
    assert A.tolist() == [0.0] * 9


def test_advantages_without_std_scaling_is_mean_centring():
    """Dr. GRPO: [1, 0, 0, 1] and [2, 0, 0, 0] -> minus their means 0.5 and 0.5."""
    A = grpo.group_advantages(torch.tensor([1.0, 0, 0, 1, 2, 0, 0, 0]), group_size=4,
                              scale_rewards=False)
    assert A.tolist() == [0.5, -0.5, -0.5, 0.5, 1.5, -0.5, -0.5, -0.5]


def test_advantages_match_a_slow_loop():
    """Vectorised group statistics equal a plain Python loop with statistics.stdev
    (Bessel-corrected)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 5, generator=g).round(decimals=1)
    fast = grpo.group_advantages(rewards, group_size=5, eps=1e-4)
    slow = []
    for b in range(6):
        group = rewards[b * 5:(b + 1) * 5].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)
        slow += [(r - mean) / (std + 1e-4) for r in group]
    assert fast.tolist() == pytest.approx(slow, abs=1e-5)


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="divisible by group_size=4"):
        grpo.group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="at least 2"):
        grpo.group_advantages(torch.zeros(6), group_size=1)


# --- 5. ratio and clip ---------------------------------------------------------------------------
def one_token_loss(ratio, A, **kw):
    """grpo_loss on a single token whose ratio π_θ/π_old is `ratio`; returns (loss, d loss / d logp,
    stats)."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = grpo.grpo_loss(logp, torch.zeros(1, 1), None, torch.tensor([float(A)]),
                                 torch.ones(1, 1),
                                 beta=0.0, **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_clip_binds_above_with_positive_advantage():
    """ratio 1.3, ε = 0.2, A = +1: min(1.3·1, clip(1.3, 0.8, 1.2)·1) = 1.2, so loss = -1.2,
    and the clipped branch is constant in θ: no gradient."""
    loss, grad, stats = one_token_loss(1.3, +1, clip_eps=0.2)
    assert loss == pytest.approx(-1.2, abs=1e-6)
    assert grad == 0.0
    assert stats["clip_ratio/high"] == 1.0 and stats["clip_ratio/low"] == 0.0


def test_clip_does_not_bind_when_it_would_help():
    """ratio 1.3, A = -1: min(-1.3, -1.2) = -1.3 is the unclipped branch: loss = 1.3,
    d loss/d logp = -A · ratio = 1.3. (The pessimistic bound keeps the worse of the two.)"""
    loss, grad, stats = one_token_loss(1.3, -1, clip_eps=0.2)
    assert loss == pytest.approx(1.3, abs=1e-6)
    assert grad == pytest.approx(1.3, abs=1e-6)
    assert stats["clip_ratio/region"] == 0.0


def test_clip_binds_below_with_negative_advantage():
    """ratio 0.7, A = -1: min(-0.7, clip(0.7)=0.8 · -1 = -0.8) = -0.8, loss = 0.8, no gradient."""
    loss, grad, stats = one_token_loss(0.7, -1, clip_eps=0.2)
    assert loss == pytest.approx(0.8, abs=1e-6)
    assert grad == 0.0
    assert stats["clip_ratio/low"] == 1.0


def test_clip_eps_high():
    """ratio 1.25, A = +1. With ε_high = ε = 0.2 it is clipped to 1.2 (no gradient);
    with DAPO's ε_high = 0.28 the bound is 1.28, so 1.25 passes: loss = -1.25, gradient -1.25."""
    loss, grad, _ = one_token_loss(1.25, +1, clip_eps=0.2)
    assert (loss, grad) == (pytest.approx(-1.2, abs=1e-6), 0.0)
    loss, grad, _ = one_token_loss(1.25, +1, clip_eps=0.2, clip_eps_high=0.28)
    assert loss == pytest.approx(-1.25, abs=1e-6) and grad == pytest.approx(-1.25, abs=1e-6)
    # the lower bound stays at 1 - ε: ratio 0.75 with A = -1 is clipped to 0.8
    loss, grad, _ = one_token_loss(0.75, -1, clip_eps=0.2, clip_eps_high=0.28)
    assert (loss, grad) == (pytest.approx(0.8, abs=1e-6), 0.0)


# --- 6. k3 KL ------------------------------------------------------------------------------------
@pytest.mark.parametrize("log_ref_ratio, expected",
                         [(LN2, 0.3068528), (-LN2, 0.1931472), (0.0, 0.0)])
def test_k3_kl_hand_worked(log_ref_ratio, expected):
    """k3 = π_ref/π_θ - log(π_ref/π_θ) - 1. At log-ratio ln 2: 2 - 0.6931472 - 1 = 0.3068528;
    at -ln 2: 0.5 + 0.6931472 - 1 = 0.1931472; at 0: 0. With A = 0 and β = 1 the loss is exactly
    β·k3. Fails on the other common estimators: k1 = -log ratio gives -0.6931 and +0.6931, k2 =
    (log ratio)²/2 gives 0.2402 at both, and the ratio the wrong way round (π_θ/π_ref) swaps the
    first two values."""
    logp = torch.zeros(1, 1)
    loss, stats = grpo.grpo_loss(logp, logp, logp + log_ref_ratio, torch.zeros(1), torch.ones(1, 1),
                                 beta=1.0)
    assert stats["kl"] == pytest.approx(expected, abs=1e-6)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_kl_gradient_pulls_toward_reference():
    """d k3 / d logp = -exp(logp_ref - logp) + 1. At logp_ref - logp = ln 2 that is -1: raising logp
    toward logp_ref lowers the loss, so gradient descent moves π_θ toward π_ref."""
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, _ = grpo.grpo_loss(logp, logp.detach(), torch.full((1, 1), LN2), torch.zeros(1),
                             torch.ones(1, 1),
                             beta=0.5)
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.5 * -1.0, abs=1e-6)


def test_beta_zero_needs_no_reference_and_beta_nonzero_does():
    logp = torch.zeros(2, 3)
    loss, stats = grpo.grpo_loss(logp, logp, None, torch.tensor([1.0, -1.0]), torch.ones(2, 3),
                                 beta=0.0)
    assert stats["kl"] == 0.0
    with pytest.raises(ValueError, match="logp_ref is required"):
        grpo.grpo_loss(logp, logp, None, torch.tensor([1.0, -1.0]), torch.ones(2, 3), beta=0.04)


# --- 7. aggregation ------------------------------------------------------------------------------
LENGTHS_1_AND_3 = dict(
    logp=torch.zeros(2, 4), logp_old=torch.zeros(2, 4), logp_ref=None,
    advantages=torch.tensor([1.0, -1.0]),
    completion_mask=torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]]),
)


@pytest.mark.parametrize("loss_type, expected_loss, expected_grads", [
    # per-token losses: sequence 1 (length 1, A=+1) has -1; sequence 2 (length 3, A=-1) has +1
    # per token.
    # 'grpo':    ( -1/1 + 3/3 ) / 2 = 0;   d/dlogp: seq1 -1/(1·2) = -0.5, seq2 +1/(3·2) = +0.1667
    ("grpo", 0.0, [-0.5, 1 / 6]),
    # 'token':   ( -1 + 3 ) / 4 tokens = 0.5; d/dlogp: -1/4 and +1/4
    ("token", 0.5, [-0.25, 0.25]),
    # 'dr_grpo': ( -1 + 3 ) / (2 seqs · L=4) = 0.25; d/dlogp: -1/8 and +1/8
    ("dr_grpo", 0.25, [-0.125, 0.125]),
])
def test_loss_types_on_lengths_1_and_3(loss_type, expected_loss, expected_grads):
    """Per-sequence and per-token averaging differ when lengths differ; worked numbers in the
    parameters."""
    logp = LENGTHS_1_AND_3["logp"].clone().requires_grad_(True)
    kw = {**LENGTHS_1_AND_3, "logp": logp}
    loss, _ = grpo.grpo_loss(**kw, beta=0.0, loss_type=loss_type, max_completion_length=4)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert logp.grad[0, 0].item() == pytest.approx(expected_grads[0], abs=1e-6)
    assert logp.grad[1, :3].tolist() == pytest.approx([expected_grads[1]] * 3, abs=1e-6)
    # masked tokens get no gradient
    assert logp.grad[0, 1:].abs().sum() == 0 and logp.grad[1, 3] == 0


def test_unknown_loss_type_is_rejected():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo.grpo_loss(**LENGTHS_1_AND_3, beta=0.0, loss_type="mean")


def test_mu_1_loss_is_zero_but_gradient_is_reinforce_with_group_baseline():
    """With μ = 1, logp_old = logp.detach(): every ratio is 1 and Σ_i A_i = 0 within each group, so
    the 'grpo' policy loss is -1/N Σ_i A_i · (|o_i|/|o_i|) = 0. Its gradient is not 0: it is
    -1/N Σ_i A_i / |o_i| Σ_t ∇ log π(o_it), the REINFORCE gradient with the group mean as
    baseline."""
    g = torch.Generator().manual_seed(0)
    N, T, V, G = 8, 5, 7, 4
    logits = torch.randn(N, T, V, generator=g, requires_grad=True)
    ids = torch.randint(V, (N, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (N, 1), generator=g)).long()
    rewards = torch.randint(0, 2, (N,), generator=g).float()
    A = grpo.group_advantages(rewards, G)

    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    loss, _ = grpo.grpo_loss(logp, logp.detach(), None, A, mask, beta=0.0)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    assert abs(loss.item()) < 1e-6

    reinforce = -(A[:, None] * logp * mask).sum(1).div(mask.sum(1)).mean()  # the textbook estimator
    (expected,) = torch.autograd.grad(reinforce, logits)
    assert grad.abs().sum() > 0.1
    torch.testing.assert_close(grad, expected)


# --- 1 & 4. sampling and log-probs on a real (tiny) model ----------------------------------------
@pytest.fixture(scope="module")
def tiny():
    tok = tiny_world.char_tokenizer()
    return tok, tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)


def test_completion_mask_includes_first_eos_only():
    """EOS id 2. Row 1 stops at position 1 (EOS kept); row 2 never stops (all 4 kept); row 3 stops
    at 0."""
    ids = torch.tensor([[5, 2, 7, 2], [5, 5, 5, 5], [2, 0, 0, 0]])
    mask = grpo.completion_mask_from_ids(ids, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_token_logprobs_match_full_log_softmax(tiny):
    """gather + logsumexp on the completion slice equals log_softmax over the whole sequence, and
    the entropy equals torch.distributions.Categorical's."""
    tok, model = tiny
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(4, 100, (3, 5), generator=g)
    completion_ids = torch.randint(4, 100, (3, 6), generator=g)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    completion_mask = torch.ones(3, 6, dtype=torch.long)
    logp, entropy = grpo.token_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                        completion_mask,
                                        temperature=0.7, with_entropy=True)
    # slow, obvious: the whole (n, P+T, V) log_softmax, then pick each completion token
    ids = torch.cat([prompt_ids, completion_ids], 1)
    am = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=am,
                   position_ids=(am.cumsum(1) - 1).clamp(min=0)).logits / 0.7
    full = torch.log_softmax(logits, -1)[:, 4:-1]
    expected = full.gather(-1, completion_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy,
                               torch.distributions.Categorical(logits=logits[:, 4:-1]).entropy(),
                               atol=1e-5, rtol=1e-5)


def test_sample_completions_groups_and_masks(tiny):
    tok, model = tiny
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=8)
    batch = grpo.sample_completions(model, tok, ["ab", "abcdef"], cfg)
    N, T = batch["completion_ids"].shape
    assert N == 8 and T <= 8
    # decoding ran under inference_mode; its outputs must still be ordinary tensors backward can
    # save
    assert not any(v.is_inference() for v in batch.values() if torch.is_tensor(v))
    assert torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][3])   # group rows are contiguous
    assert not torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][4])
    assert batch["prompt_mask"][0].tolist()[:4] == [0, 0, 0, 0]                  # left padding
    lengths = batch["completion_mask"].sum(1)
    for n in range(N):
        ids = batch["completion_ids"][n, :lengths[n]].tolist()
        ended = tok.eos_token_id in ids
        assert ended != bool(batch["truncated"][n])
        assert batch["completions"][n] == tok.decode(ids, skip_special_tokens=True)


# --- 2. rewards ----------------------------------------------------------------------------------
def test_compute_rewards_weights_and_means():
    """Two functions, weights 1 and 0.5: r = f1 + 0.5·f2. f1 = [1,0,1,0], f2 = [2,2,0,0] ->
    [2,1,1,0]."""
    def f1(prompts, completions, **kw):
        return [1.0, 0.0, 1.0, 0.0]

    def f2(prompts, completions, answer, **kw):
        assert answer == ["a", "a", "b", "b"]
        return [2, 2, 0, 0]

    r, means = grpo.compute_rewards([f1, f2], ["p"] * 4, ["c"] * 4,
                                    {"answer": ["a", "a", "b", "b"]}, [1.0, 0.5])
    assert r.tolist() == [2.0, 1.0, 1.0, 0.0]
    assert means == {"f1": 0.5, "f2": 1.0}


def test_compute_rewards_rejects_bad_reward_functions():
    with pytest.raises(ValueError, match="'short' returned 1 values for 2 completions"):
        def short(prompts, completions, **kw):
            return [1.0]
        grpo.compute_rewards([short], ["p", "p"], ["a", "b"])
    with pytest.raises(TypeError, match="'texty' returned 'yes'"):
        def texty(prompts, completions, **kw):
            return ["yes", 1.0]
        grpo.compute_rewards([texty], ["p", "p"], ["a", "b"])


# --- 8. the whole step ---------------------------------------------------------------------------
def contains_a(prompts, completions, **kw):
    return [float("a" in c) for c in completions]


def run_step(cfg, seed=0, reward_funcs=(contains_a,), with_ref=True, sgd=False):
    tok = tiny_world.char_tokenizer()
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    ref = grpo.make_reference(policy) if with_ref else None
    # WHY sgd: plain SGD makes the weight change the gradient itself; Adam would blow float rounding
    # in near-zero gradient entries up to a full lr-sized step.
    opt = torch.optim.SGD(policy.parameters(), lr=cfg.lr) if sgd else grpo.make_optimizer(policy,
                                                                                          cfg)
    torch.manual_seed(seed)
    metrics = grpo.grpo_step(policy, ref, opt, tok, ["Q1", "Q22"], list(reward_funcs), cfg)
    return policy, metrics


@pytest.mark.parametrize("loss_type", ["grpo", "token"])
def test_micro_batches_give_the_same_update(loss_type):
    """One SGD step with micro_batch_size 16 (all 16 sequences at once) and 3 (6 uneven chunks) from
    the same seed samples the same completions and must land on the same weights (so the same
    gradient)."""
    base = dict(group_size=8, max_new_tokens=10, lr=1.0, loss_type=loss_type)
    full, m_full = run_step(grpo.GRPOConfig(**base, micro_batch_size=16), sgd=True)
    micro, m_micro = run_step(grpo.GRPOConfig(**base, micro_batch_size=3), sgd=True)
    assert m_full["reward_std"] > 0  # there was something to learn
    for p, q in zip(full.parameters(), micro.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    assert m_full["grad_norm"] > 1e-3
    assert m_full["grad_norm"] == pytest.approx(m_micro["grad_norm"], rel=1e-5)
    assert m_full["loss"] == pytest.approx(m_micro["loss"], abs=1e-6)
    assert m_full["kl"] == pytest.approx(m_micro["kl"], abs=1e-7)


def test_micro_batch_weights_hand_worked():
    """Rows of 1 and 3 real tokens, micro-batches of 1 row: 'grpo' weighs each row's mean loss
    1/2 (a mean over sequences), 'token' by its share of the 4 tokens, 1/4 and 3/4; the token
    shares, which weigh the logged KL and clip ratios, are 1/4 and 3/4 either way. In one
    micro-batch of 2 the weight is 1."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    assert grpo.micro_batch_weights(mask, 1, "grpo") == ([0.5, 0.5], [0.25, 0.75])
    assert grpo.micro_batch_weights(mask, 1, "token") == ([0.25, 0.75], [0.25, 0.75])
    assert grpo.micro_batch_weights(mask, 1, "dr_grpo") == ([0.5, 0.5], [0.25, 0.75])
    assert grpo.micro_batch_weights(mask, 2, "grpo") == ([1.0], [1.0])


def test_step_moves_weights_and_reports_every_metric():
    tok = tiny_world.char_tokenizer()
    cfg = grpo.GRPOConfig(group_size=8, max_new_tokens=10, lr=1e-2)
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    before = [p.detach().clone() for p in policy.parameters()]
    torch.manual_seed(0)
    m = grpo.grpo_step(policy, grpo.make_reference(policy), grpo.make_optimizer(policy, cfg), tok,
                       ["Q1", "Q22"], [contains_a], cfg)
    for key in ["reward", "reward_std", "rewards/contains_a", "frac_reward_zero_std", "kl",
                "clip_ratio/low",
                "clip_ratio/high", "completions/mean_length", "completions/clipped_ratio",
                "entropy",
                "grad_norm", "loss", "step_time"]:
        assert key in m and math.isfinite(m[key]), key
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))
    assert m["kl"] == 0.0  # μ = 1: the policy equals the reference until this step's update
    assert 0 < m["completions/mean_length"] <= 10


def test_mu_2_keeps_logp_old_from_before_the_first_update(monkeypatch):
    """With μ = 2, both inner iterations see the same logp_old, equal to the policy's log-probs
    before any update; the second iteration's logp differs from it because the weights moved."""
    calls = []
    real = grpo.grpo_loss

    def spy(logp, logp_old, *a, **kw):
        calls.append((logp.detach().clone(), logp_old.clone()))
        return real(logp, logp_old, *a, **kw)

    monkeypatch.setattr(grpo, "grpo_loss", spy)
    _, m = run_step(grpo.GRPOConfig(group_size=8, max_new_tokens=10, lr=1e-2, num_iterations=2,
                                    micro_batch_size=16))
    (logp1, old1), (logp2, old2) = calls
    torch.testing.assert_close(old1, old2)
    torch.testing.assert_close(logp1, old1, atol=1e-5, rtol=1e-5)   # ratio 1 in the first iteration
    assert (logp2 - old2).abs().max() > 1e-3                        # not in the second


def test_beta_zero_runs_without_reference_model():
    _, m = run_step(grpo.GRPOConfig(group_size=4, max_new_tokens=6, beta=0.0), with_ref=False)
    assert m["kl"] == 0.0
    with pytest.raises(ValueError, match="needs a reference model"):
        run_step(grpo.GRPOConfig(group_size=4, max_new_tokens=6, beta=0.04), with_ref=False)


def test_non_finite_reward_skips_the_update():
    """A NaN reward makes the gradient NaN; the step must skip the optimizer and leave the weights
    alone."""
    def nan_reward(prompts, completions, **kw):
        return [float("nan")] + [0.0] * (len(completions) - 1)

    tok = tiny_world.char_tokenizer()
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=6, lr=1e-2)
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    before = [p.detach().clone() for p in policy.parameters()]
    m = grpo.grpo_step(policy, grpo.make_reference(policy), grpo.make_optimizer(policy, cfg), tok,
                       ["Q1"], [nan_reward], cfg)
    assert m["skipped_updates"] == 1
    assert all(torch.equal(b, p) for b, p in zip(before, policy.parameters()))


def test_non_finite_logits_in_the_training_pass_skip_the_update():
    """Logits that overflow to inf/NaN in the forward pass with gradients (as bf16 can) poison the
    loss; the update is skipped, the weights and AdamW's moments stay exactly as they were. Sampling
    is unaffected."""
    tok = tiny_world.char_tokenizer()
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=6, lr=1e-2, beta=0.04)
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    ref = grpo.make_reference(policy)
    opt = grpo.make_optimizer(policy, cfg)
    torch.manual_seed(0)
    # a normal step: Adam has state
    grpo.grpo_step(policy, ref, opt, tok, ["Q1", "Q22"], [contains_a], cfg)
    before = [p.detach().clone() for p in policy.parameters()]
    moments = {k: v.clone() for k, v in opt.state[next(policy.parameters())].items()}

    def overflow(module, args, output):
        if torch.is_grad_enabled():  # only the training forward pass, not generation or π_ref
            output.logits[..., 0] = float("inf")
        return output

    policy.register_forward_hook(overflow)
    m = grpo.grpo_step(policy, ref, opt, tok, ["Q1", "Q22"], [contains_a], cfg)
    assert m["skipped_updates"] == 1 and not math.isfinite(m["loss"])
    assert all(torch.equal(b, p) for b, p in zip(before, policy.parameters()))
    after = opt.state[next(policy.parameters())]
    assert all(torch.equal(v, after[k]) for k, v in moments.items())


@pytest.mark.parametrize("field, value, message", [
    ("group_size", 1, "group_size must be at least 2"),
    ("beta", -0.1, "beta must be >= 0"),
    ("clip_eps", 0.0, "clip_eps must be > 0"),
    ("clip_eps_high", -0.2, "clip_eps_high must be > 0"),
    ("num_iterations", 0, "num_iterations must be >= 1"),
    ("loss_type", "sum", "loss_type must be one of"),
    ("temperature", 0.0, "temperature must be > 0"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
    ("loss_type", "cispo", "loss_type must be one of"),   # CISPO: compare/baselines.py
    ("lr", -1e-6, "lr must be > 0"),
    ("max_grad_norm", 0.0, "max_grad_norm must be > 0"),
    ("micro_batch_size", 0, "micro_batch_size must be >= 1"),
    ("reward_weights", [1.0, float("nan")], "reward_weights must be finite"),
    ("sampler_is_cap", -1.0, "sampler_is_cap must be >= 0"),
])
def test_config_values_that_cannot_work_fail_at_construction(field, value, message):
    with pytest.raises(ValueError, match=message):
        grpo.GRPOConfig(**{field: value})
    grpo.GRPOConfig()  # the defaults pass


# --- beyond vanilla GRPO: process supervision (§4.1.3), GSPO, dynamic sampling -------------------
def test_process_advantages_hand_worked():
    """G = 2, T = 4. Completion 0 has steps ending at tokens 1 and 3, both right (reward 1);
    completion 1 has one step ending at token 2, wrong (0). R = [1, 1, 0]: mean 2/3, sample std
    sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3) = 0.57735, so r̃ = [+0.57735, +0.57735, -1.15470]
    (eps 0 here). Each token sums the r̃ of the steps ending at or after it:
        completion 0: [0.577+0.577, 0.577+0.577, 0.577, 0.577] = [1.15470, 1.15470, 0.57735,
        0.57735]
        completion 1: [-1.15470, -1.15470, -1.15470, 0]  (nothing ends after token 2)"""
    A = grpo.process_advantages([[(1, 1.0), (3, 1.0)], [(2, 0.0)]], group_size=2, num_tokens=4,
                                eps=0.0)
    torch.testing.assert_close(A, torch.tensor([[1.15470, 1.15470, 0.57735, 0.57735],
                                                [-1.15470, -1.15470, -1.15470, 0.0]]), atol=1e-5,
                                                rtol=0)


def test_process_advantages_with_only_a_final_step_equal_outcome_advantages():
    """One step per completion, at its last token: the paper's two forms coincide on every real
    token."""
    rewards_ = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1.0])
    last = [3, 1, 4, 0, 2, 2, 4, 1]
    A = grpo.process_advantages([[(t, r.item())] for t, r in zip(last, rewards_)], group_size=4,
                                num_tokens=5)
    outcome = grpo.group_advantages(rewards_, group_size=4)
    for n, t in enumerate(last):
        torch.testing.assert_close(A[n, :t + 1], outcome[n].expand(t + 1))
        assert (A[n, t + 1:] == 0).all()


def test_step_ends_map_to_the_token_holding_their_last_character(tiny):
    """Character tokenizer: token k is character k. '1+1=<<1+1=2>>2' has its '>>' end at character
    13, so the step's last character (index 12) is token 12; a step ending at the text's end maps to
    the last token, here the EOS at index 16."""
    tok, _ = tiny
    text = "1+1=<<1+1=2>>2\n#"
    ids = torch.tensor([tok.convert_tokens_to_ids(list(text)) + [tok.eos_token_id,
                                                                 tok.pad_token_id]])
    assert grpo.step_token_index(tok, ids, torch.tensor([17]), [[13, len(text)]]) == [[12, 16]]


def subword_tokenizers():
    """Two tokenizers built here, offline: SentencePiece-style (Metaspace: '▁' marks a word's
    leading space, and a token decoded alone drops it) and byte-level BPE over bytes alone (so '€'
    is 3 tokens, each alone a '�')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    corpus = ["Tom has 3 apples. He buys 4 more for 1 €, so 3+4=7. The answer is 7 apples."] * 20
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer, sp.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp.train_from_iterator(corpus,
                           trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    bl = Tokenizer(models.BPE())
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bl.train_from_iterator([], trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                                   initial_alphabet=alphabet))
    return {"sentencepiece": PreTrainedTokenizerFast(tokenizer_object=sp, eos_token="</s>",
                                                     unk_token="<unk>"),
            "byte-level": PreTrainedTokenizerFast(tokenizer_object=bl, eos_token="</s>")}


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_step_ends_map_to_tokens_on_subword_tokenizers(kind):
    """Against the slow, obvious answer (the first k whose decoded prefix ids[:k+1] is at least e
    characters long), on text whose words carry leading spaces and whose '€' is split over 3 byte
    tokens. Decoding tokens one at a time would drift by a character per word (SentencePiece) or 2
    per '€' (byte-level)."""
    tok = subword_tokenizers()[kind]
    text = "Tom has 3 apples. He pays 4 €, so 3+4=7. €€ The answer is 7."
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == text
    ends = [text.index(".") + 1, text.index("€") + 1, text.index("7.") + 2, text.index("€€") + 2,
            len(text)]
    slow = [next(k for k in range(len(ids)) if len(tok.decode(ids[:k + 1],
                                                              skip_special_tokens=True)) >= e)
            for e in ends[:-1]] + [len(ids) - 1]                     # the last step ends at the EOS
    assert grpo.step_token_index(tok, torch.tensor([ids]), torch.tensor([len(ids)]),
                                    [ends]) == [slow]
    assert tok.decode(ids[:slow[0] + 1], skip_special_tokens=True).endswith("apples.")


def test_gspo_sequence_ratio_hand_worked():
    """log(π_θ/π_old) = [0.1, 0.3] on one completion. Token level: ratios e^0.1 = 1.10517 and e^0.3
    = 1.34986, clipped to 1.2 for A = +1: loss = -(1.10517 + 1.2) / 2 = -1.15259. GSPO: one ratio s
    = e^((0.1+0.3)/2) = e^0.2 = 1.22140 for both tokens, clipped to 1.2: loss = -1.2 and no gradient
    at all. For A = -1 the clip does not bind (min picks the larger loss): loss = +1.22140."""
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)

    def loss_of(level, A):
        logp = torch.tensor([[0.1, 0.3]], requires_grad=True)
        loss, _ = grpo.grpo_loss(logp, old, None, torch.tensor([A]), mask, beta=0.0,
                                 importance_sampling_level=level)
        loss.backward()
        return loss.item(), logp.grad

    assert loss_of("token", 1.0)[0] == pytest.approx(-1.15259, abs=1e-5)
    loss, grad = loss_of("sequence", 1.0)
    assert loss == pytest.approx(-1.2, abs=1e-6) and torch.equal(grad, torch.zeros(1, 2))
    loss, grad = loss_of("sequence", -1.0)
    assert loss == pytest.approx(1.22140, abs=1e-5) and (grad != 0).all()


def test_sampler_weighted_hand_worked():
    """TIS: π_old 0.5 on three tokens, π_sampler 0.25, 0.1 and 1.0, cap 2: weights 0.5/0.25 = 2,
    0.5/0.1 = 5 truncated to 2, and 0.5/1.0 = 0.5; an outcome A = 1.5 becomes 3, 3, 0.75 per
    token. A process advantage (n, T) is weighed token by token."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.25, 0.1, 1.0]]))
    got = grpo.sampler_weighted(torch.tensor([1.5]), old, sampler, cap=2.0)
    torch.testing.assert_close(got, torch.tensor([[3.0, 3.0, 0.75]]))
    got = grpo.sampler_weighted(torch.tensor([[1.0, -2.0, 4.0]]), old, sampler, cap=2.0)
    torch.testing.assert_close(got, torch.tensor([[2.0, -4.0, 2.0]]))


def is_step(cap, shift=0.0):
    """One SGD step (lr 1, β 0, no gradient clip) with sampler_is_cap = cap, where the sampler's
    log-probs are shifted by `shift` (a sampler that scores every token e^shift times more likely
    than the trainer does). Returns the weight change."""
    tok = tiny_world.char_tokenizer()
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    before = [p.detach().clone() for p in policy.parameters()]
    cfg = grpo.GRPOConfig(group_size=8, max_new_tokens=10, lr=1.0, beta=0.0, max_grad_norm=1e9,
                          sampler_is_cap=cap)

    def shifted(*args):
        ids, logp = grpo.decode(*args)
        return ids, logp + shift

    torch.manual_seed(0)
    m = grpo.grpo_step(policy, None, torch.optim.SGD(policy.parameters(), lr=1.0), tok,
                       ["Q1", "Q22"], [contains_a], cfg, seams=grpo.Seams(sample=shifted))
    assert m["reward_std"] > 0  # there was something to learn
    return [p.detach() - b for p, b in zip(policy.parameters(), before)]


def test_sampler_correction_in_fp32_is_the_plain_update():
    """In fp32 the sampler and the trainer agree to rounding, so every weight is ~1 and the step
    with the correction lands where the plain one does."""
    for a, b in zip(is_step(0.0), is_step(2.0)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_sampler_correction_weighs_each_token_by_the_capped_ratio():
    """A sampler that scores every token half as likely as the trainer (shift -ln 2) gives every
    token the weight 2: the step is exactly twice the plain one. With cap 1.5 it is 1.5 times;
    without the correction it is the plain one, whatever the sampler said."""
    plain = is_step(0.0)
    for cap, factor in [(3.0, 2.0), (1.5, 1.5), (0.0, 1.0)]:
        for p, d in zip(plain, is_step(cap, shift=-math.log(2))):
            torch.testing.assert_close(d, factor * p, atol=1e-5, rtol=1e-4)


def alternating_unless_same(prompts, completions, **kw):
    """0 for every completion of the prompt "SAME" (a zero-std group); 1, 0, 1, 0... for any other
    prompt."""
    return [0.0 if p == "SAME" else float(i % 2) for i, p in enumerate(prompts)]


def test_dynamic_sampling_drops_agreeing_groups_and_tops_up():
    """B = 2: 'SAME' agrees with itself, so it is dropped and one fresh prompt ('Q2') fills its
    place."""
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=6, dynamic_sampling=2)
    asked = []

    def more(k):
        asked.append(k)
        return ["Q2"] * k, {}

    tok = tiny_world.char_tokenizer()
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    m = grpo.grpo_step(policy, grpo.make_reference(policy), grpo.make_optimizer(policy, cfg), tok,
                       ["SAME", "Q1"], [alternating_unless_same], cfg, return_samples=True,
                       more_prompts=more)
    assert asked == [1]
    assert m["dynamic_sampling/rounds"] == 1 and m["dynamic_sampling/groups_trained"] == 2
    assert [s["prompt"] for s in m["samples"]] == ["Q1"] * 4 + ["Q2"] * 4
    assert m["frac_reward_zero_std"] == pytest.approx(1 / 3)  # of the 3 groups sampled
    # Without fresh prompts the step trains on the one group with signal.
    m = grpo.grpo_step(policy, grpo.make_reference(policy), grpo.make_optimizer(policy, cfg), tok,
                       ["SAME", "Q1"], [alternating_unless_same], cfg, return_samples=True)
    assert m["dynamic_sampling/groups_trained"] == 1
    assert {s["prompt"] for s in m["samples"]} == {"Q1"}


def test_process_supervision_step_runs_with_the_calculator_reward():
    tok = tiny_world.char_tokenizer()
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=12, lr=1e-2, supervision="process")
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    seen = []
    real = grpo.grpo_loss

    def spy(logp, logp_old, logp_ref, advantages, *a, **kw):
        seen.append(advantages.shape)
        return real(logp, logp_old, logp_ref, advantages, *a, **kw)

    grpo.grpo_loss = spy
    try:
        m = grpo.grpo_step(policy, grpo.make_reference(policy), grpo.make_optimizer(policy, cfg),
                           tok,
                           ["1+1=", "2*3="], [rewards.calculator_process_reward], cfg,
                           columns={"answer": ["2", "6"]})
    finally:
        grpo.grpo_loss = real
    N, T = 8, seen[0][1]
    assert seen == [(N, T)] and math.isfinite(m["loss"]) and "rewards/steps_mean" in m
    with pytest.raises(ValueError, match="one step-reward function"):
        grpo.grpo_step(policy, None, grpo.make_optimizer(policy, cfg), tok, ["1+1="],
                       [rewards.calculator_process_reward, rewards.format_reward],
                       grpo.GRPOConfig(group_size=2, max_new_tokens=4, supervision="process",
                                       beta=0.0),
                       columns={"answer": ["2"]})
