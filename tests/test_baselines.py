"""The teaching baselines (baselines.py): RLOO's leave-one-out advantage, REINFORCE's reward as
advantage, and CISPO's clipped, detached importance weight, each pinned by hand-worked numbers,
against a slow loop, and inside grpo_loss and a whole grpo_step.

Needs: torch (tiny_world and transformers for the step). CPU, offline, ~5 s.
"""

import pytest
import torch

from compare import baselines
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
    grads, losses = [], []
    for surrogate in (None, baselines.cispo_surrogate):
        logp = base.clone().requires_grad_(True)
        loss, _ = grpo.grpo_loss(logp, logp.detach(), None, A, mask, beta=0.0, loss_type="token",
                                 surrogate=surrogate)
        loss.backward()
        grads.append(logp.grad)
        losses.append(loss.item())
    assert torch.allclose(grads[0], grads[1]) and grads[0].abs().sum() > 0
    assert abs(losses[0] - losses[1]) > 0.1


def test_config_checks_the_baseline():
    with pytest.raises(ValueError, match="baseline must be one of"):
        baselines.BaselineConfig(baseline="value_model")
    with pytest.raises(ValueError, match="surrogate must be one of"):
        baselines.BaselineConfig(surrogate="ppo")


def test_grpo_is_the_pages_own_seams_and_each_method_takes_its_seam():
    """GRPO's choices leave grpo.Seams() as it is (the page's own code runs); RLOO and REINFORCE
    set the advantage seam, CISPO the surrogate seam; PPO's critic changes no seam (ppo.Critic
    replaces the whole step)."""
    assert baselines.apply(baselines.BaselineConfig(), grpo.Seams()) == grpo.Seams()
    assert baselines.apply(baselines.BaselineConfig(baseline="critic"), grpo.Seams()) == \
        grpo.Seams()
    rloo = baselines.apply(baselines.BaselineConfig(baseline="leave_one_out"), grpo.Seams())
    assert rloo.advantages is baselines.leave_one_out_advantages and rloo.surrogate is None
    cispo = baselines.apply(baselines.BaselineConfig(surrogate="cispo"), grpo.Seams())
    assert cispo.surrogate is baselines.cispo_surrogate and cispo.advantages is None


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
    seams = baselines.apply(baselines.BaselineConfig(**setting), grpo.Seams())
    torch.manual_seed(0)
    m = grpo.grpo_step(policy, grpo.make_reference(policy), grpo.make_optimizer(policy, cfg), tok,
                       ["Q1", "Q22"], [lambda completions, **kw: [float("a" in c) + len(c) % 3
                                                                  for c in completions]],
                       cfg, return_samples=True, seams=seams)
    assert all(v == v for v in m.values() if isinstance(v, float))   # no NaN
    rewards = torch.tensor([s["reward"] for s in m["samples"]])
    A = torch.tensor([s["advantage"] for s in m["samples"]])
    if setting.get("baseline") == "none":
        assert torch.allclose(A, rewards)
    elif setting.get("baseline") == "leave_one_out":
        assert torch.allclose(A, baselines.leave_one_out_advantages(rewards, 4), atol=1e-6)
