"""The teaching baselines (baselines.py): RLOO's leave-one-out advantage, REINFORCE's reward as
advantage, and CISPO's clipped, detached importance weight, each pinned by hand-worked numbers,
against a slow loop, inside CISPO's loss and a whole step built from grpo.py's pieces; and
cispo_update, which mirrors grpo.policy_update, checked equal to it bit for bit.

Needs: torch (tiny_world and transformers for the step). CPU, offline, ~5 s.
"""

import dataclasses

import pytest
import torch

from compare import baselines, ppo
import grpo
from recipe import tiny_world


def test_leave_one_out_by_hand():
    """[1, 0, 0, 1], G = 4: the others' means are 1/3, 2/3, 2/3, 1/3, so A = ±2/3; equal
    rewards give 0."""
    A = baselines.leave_one_out_advantages(torch.tensor([1.0, 0, 0, 1]), 4)
    assert torch.allclose(A, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.equal(baselines.leave_one_out_advantages(torch.ones(6), 3), torch.zeros(6))
    with pytest.raises(ValueError, match="divisible by group_size=4"):
        baselines.leave_one_out_advantages(torch.ones(6), 4)


def test_leave_one_out_matches_a_slow_loop_and_is_the_centred_reward_times_g_over_g_minus_1():
    torch.manual_seed(0)
    r, G = torch.rand(12), 4
    slow = torch.tensor([r[i] - (r[(i // G) * G:(i // G + 1) * G].sum() - r[i]) / (G - 1)
                         for i in range(12)])
    fast = baselines.leave_one_out_advantages(r, G)
    assert torch.allclose(fast, slow)
    centred = (r.view(-1, G) - r.view(-1, G).mean(1, keepdim=True)).view(-1)
    assert torch.allclose(fast, centred * G / (G - 1))


def test_no_baseline_is_the_reward_itself():
    r = torch.tensor([1.0, 0, 0.5, 1])
    A = baselines.no_baseline_advantages(r, 2)
    assert torch.equal(A, r) and A.data_ptr() != r.data_ptr()


def test_cispo_by_hand_keeps_the_gradient_ppo_drops():
    """r = 1.5, ε_high = 0.2, A = +1, log π = -2: weight 1.2 (detached), surrogate -2.4, gradient
    in log π 1.2. PPO's clipped surrogate min(1.5, 1.2) = 1.2 has gradient 0 there."""
    logp_old = torch.tensor([[-2.0 - 0.4054651]])                  # so r = exp(0.405) = 1.5
    logp = torch.tensor([[-2.0]], requires_grad=True)
    ratio = torch.exp(logp - logp_old)
    s = baselines.cispo_surrogate(ratio, logp, torch.tensor([[1.0]]), 0.2, 0.2)
    s.sum().backward()
    assert torch.isclose(s, torch.tensor([[-2.4]])).all()
    assert torch.isclose(logp.grad, torch.tensor([[1.2]])).all()
    logp.grad = None
    ratio = torch.exp(logp - logp_old)
    ppo = torch.min(ratio * 1.0, torch.clamp(ratio, 0.8, 1.2) * 1.0)
    ppo.sum().backward()
    assert logp.grad.item() == 0.0


def test_cispo_at_mu_1_has_grpo_token_level_gradient():
    """At μ = 1 (logp_old = logp.detach(), ratio 1) CISPO's gradient equals GRPO's with token
    averaging: A ∇log π for every token. Their loss values differ: CISPO's holds log π itself."""
    torch.manual_seed(0)
    base = torch.randn(4, 5)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    A = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = grpo.GRPOConfig(beta=0.0, loss_type="token")
    grads, losses = [], []
    for cispo in (False, True):
        logp = base.clone().requires_grad_(True)
        if cispo:
            loss, _ = baselines.cispo_loss(logp, logp.detach(), None, A, mask, cfg)
        else:
            loss, _ = grpo.grpo_loss(logp, logp.detach(), None, A, mask, beta=0.0,
                                     loss_type="token")
        loss.backward()
        grads.append(logp.grad)
        losses.append(loss.item())
    assert torch.allclose(grads[0], grads[1]) and grads[0].abs().sum() > 0
    assert abs(losses[0] - losses[1]) > 0.1


def eq3_in_place_of_cispo(ratio, logp, A, clip_eps, clip_eps_high):
    """grpo.py's own clipped surrogate, with cispo_surrogate's arguments."""
    return grpo.clipped_surrogate(ratio, A, clip_eps, clip_eps_high)


@pytest.mark.parametrize("kw", [dict(num_iterations=2, micro_batch_size=3, beta=0.04),
                                dict(num_iterations=1, micro_batch_size=16, beta=0.0,
                                     sampler_is_cap=2.0, loss_type="token")],
                         ids=["mu2-micro-batches-kl", "mu1-tis-token"])
def test_cispo_update_with_eq3_put_back_is_policy_update_bit_for_bit(monkeypatch, kw):
    """cispo_update repeats grpo.policy_update's loop with CISPO's loss. With eq. 3's surrogate
    put back in cispo_surrogate's place, the two must give the same stats and the same weights,
    bit for bit, over μ updates, micro-batches, KL, TIS: the loop is the same loop. (With
    CISPO's own surrogate the loss differs, and at μ = 2 the weights, so the comparison can
    tell.)"""
    tok = tiny_world.char_tokenizer()
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=8, lr=1e-2, **kw)
    start = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    torch.manual_seed(0)
    batch = grpo.rollout(start, tok, ["Q1", "Q22"], None,
                         [lambda completions, **k: [float(len(c) % 3) for c in completions]], cfg)
    batch["completion_mask"][::3, 4:] = 0  # completions of unequal length: weights != shares
    assert batch["advantages"].abs().sum() > 0
    weights, shares = grpo.micro_batch_weights(batch["completion_mask"], 3, "grpo")
    assert weights != shares
    ref = grpo.make_reference(start)

    def update(fn):
        policy = grpo.make_reference(start).requires_grad_(True)
        old, ref_logp = grpo.fixed_logprobs(policy, ref, batch, cfg)
        stats = fn(policy, grpo.make_optimizer(policy, cfg), batch, old, ref_logp, cfg)
        return stats, [p.detach() for p in policy.parameters()]

    cispo_stats, cispo_weights = update(baselines.cispo_update)
    monkeypatch.setattr(baselines, "cispo_surrogate", eq3_in_place_of_cispo)
    (mine, w_mine), (page, w_page) = update(baselines.cispo_update), update(grpo.policy_update)
    assert mine == page
    assert all(torch.equal(a, b) for a, b in zip(w_mine, w_page))
    assert cispo_stats["loss"] != page["loss"]  # CISPO's own loss holds log π itself
    if cfg.num_iterations > 1:  # from the second update on, its gradient differs too
        assert not all(torch.equal(a, b) for a, b in zip(cispo_weights, w_page))


def test_config_checks_the_baseline():
    with pytest.raises(ValueError, match="baseline must be one of"):
        baselines.BaselineConfig(baseline="value_model")
    with pytest.raises(ValueError, match="surrogate must be one of"):
        baselines.BaselineConfig(surrogate="ppo")


def test_step_function_gives_grpo_step_itself_and_each_method_its_step():
    """GRPO's choices give grpo.grpo_step itself (the page's own step); PPO's critic its
    ppo.Critic; RLOO, REINFORCE and CISPO a ComparedStep. grpo.Seams has only the three speed
    and memory seams: the methods need none."""
    tok = tiny_world.char_tokenizer()
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    cfg = grpo.GRPOConfig()
    assert baselines.step_function(baselines.BaselineConfig(), policy, cfg) is grpo.grpo_step
    critic = baselines.step_function(baselines.BaselineConfig(baseline="critic"), policy, cfg)
    assert isinstance(critic, ppo.Critic)
    for setting in (dict(baseline="leave_one_out"), dict(baseline="none"),
                    dict(surrogate="cispo")):
        step = baselines.step_function(baselines.BaselineConfig(**setting), policy, cfg)
        assert isinstance(step, baselines.ComparedStep)
    assert [f.name for f in dataclasses.fields(grpo.Seams)] == ["sample", "score", "update"]


def test_a_replaced_baseline_refuses_process_supervision():
    tok = tiny_world.char_tokenizer()
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    cfg = grpo.GRPOConfig(group_size=2, max_new_tokens=4, supervision="process")
    step = baselines.ComparedStep(baselines.BaselineConfig(baseline="leave_one_out"))
    with pytest.raises(ValueError, match="process supervision sets its own advantages"):
        step(policy, None, None, tok, ["Q1"], [], dataclasses.replace(cfg, beta=0.0))


@pytest.mark.parametrize("setting", [dict(baseline="leave_one_out"), dict(baseline="none"),
                                     dict(surrogate="cispo")],
                         ids=["rloo", "reinforce", "cispo-mu2"])
def test_a_grpo_step_runs_with_each(setting):
    """A whole step with each choice: finite metrics; the logged advantages are the choice's."""
    tok = tiny_world.char_tokenizer()
    policy = tiny_world.tiny_llama(tok, hidden=32, layers=2, heads=2, seed=0)
    cispo = setting.get("surrogate") == "cispo"
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=8, lr=1e-2,
                          **(dict(loss_type="token", num_iterations=2) if cispo else {}))
    step = baselines.step_function(baselines.BaselineConfig(**setting), policy, cfg)
    torch.manual_seed(0)
    m = step(policy, grpo.make_reference(policy), grpo.make_optimizer(policy, cfg), tok,
             ["Q1", "Q22"], [lambda completions, **kw: [float("a" in c) + len(c) % 3
                                                        for c in completions]],
             cfg, return_samples=True)
    assert all(v == v for v in m.values() if isinstance(v, float))   # no NaN
    rewards = torch.tensor([s["reward"] for s in m["samples"]])
    A = torch.tensor([s["advantage"] for s in m["samples"]])
    if setting.get("baseline") == "none":
        assert torch.allclose(A, rewards)
    elif setting.get("baseline") == "leave_one_out":
        assert torch.allclose(A, baselines.leave_one_out_advantages(rewards, 4), atol=1e-6)
