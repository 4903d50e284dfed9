"""PPO with a learned critic (ppo.py): eq. 2's per-token reward, GAE against the usual backward
loop, whitening, the clipped value loss, all by hand; the value model's alignment with the
policy's logits; and whole PPO steps on the tiny Llama (finite, both networks move, a bad config
is refused).

Needs: torch, transformers (tiny_world builds the models). CPU, offline, ~10 s.
"""

import dataclasses

import pytest
import torch

from compare import baselines
import grpo
from compare import ppo
from recipe import tiny_world


def test_token_rewards_hand_worked():
    """β = 0.5, reward 1, length 2 (a pad after it), log π_old - log π_ref = [0.2, -0.4, 9]:
    r = [-0.5·0.2, -0.5·(-0.4) + 1, 0] = [-0.1, 1.2, 0]."""
    logp_old = torch.tensor([[-1.0, -2.0, -3.0]])
    logp_ref = logp_old - torch.tensor([[0.2, -0.4, 9.0]])
    r = ppo.token_rewards(torch.tensor([1.0]), logp_old, logp_ref, torch.tensor([[1, 1, 0]]), 0.5)
    assert torch.allclose(r, torch.tensor([[-0.1, 1.2, 0.0]]))


def test_gae_hand_worked():
    """γ = 1, λ = 0.5, rewards [0, 1], V = [0.5, 0.5]: δ = [0, 0.5], A = [0.25, 0.5],
    R = [0.75, 1.0]. With λ = 1 it is the Monte-Carlo return minus V: A = [0.5, 0.5]."""
    r, V, m = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2)
    A, R = ppo.gae(r, V, m, 1.0, 0.5)
    assert torch.allclose(A, torch.tensor([[0.25, 0.5]]))
    assert torch.allclose(R, torch.tensor([[0.75, 1.0]]))
    A1, _ = ppo.gae(r, V, m, 1.0, 1.0)
    assert torch.allclose(A1, torch.tensor([[0.5, 0.5]]))


def slow_gae(rewards, values, mask, gamma, lam):
    """The loop most PPO code writes: backwards over t, per row, stopping at the row's end."""
    N, T = rewards.shape
    A = torch.zeros(N, T)
    for n in range(N):
        L = int(mask[n].sum())
        last = 0.0
        for t in reversed(range(L)):
            next_v = values[n, t + 1] if t + 1 < L else 0.0
            delta = rewards[n, t] + gamma * next_v - values[n, t]
            last = delta + gamma * lam * last
            A[n, t] = last
    return A, (A + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_the_slow_loop(gamma, lam):
    torch.manual_seed(0)
    lengths = torch.tensor([1, 5, 9, 3])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).float()
    r, V = torch.randn(4, 9) * mask, torch.randn(4, 9)  # garbage V on pads must not leak in
    A, R = ppo.gae(r, V, mask, gamma, lam)
    A_slow, R_slow = slow_gae(r, V, mask, gamma, lam)
    assert torch.allclose(A, A_slow, atol=1e-5) and torch.allclose(R, R_slow, atol=1e-5)


def test_whiten_uses_real_tokens_only():
    """[1, 3 | pad 100]: mean 2, std 1 over the two real tokens -> [-1, 1, 0]."""
    w = ppo.whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]))
    assert torch.allclose(w, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-4)


def test_value_loss_clip_hand_worked():
    """V_old 0, V 1, R 1, ε_v 0.2: unclipped (1-1)^2 = 0, clipped (0.2-1)^2 = 0.64 -> 0.32, and
    the gradient flows only through... neither branch's V (the clipped one is flat in V): 0.
    V 0.1 (inside the clip): 1/2 (0.1-1)^2 = 0.405, gradient V - R = -0.9."""
    V = torch.tensor([[1.0]], requires_grad=True)
    loss = ppo.value_loss(V, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2)
    loss.backward()
    assert torch.isclose(loss, torch.tensor(0.32)) and V.grad.item() == 0.0
    V = torch.tensor([[0.1]], requires_grad=True)
    loss = ppo.value_loss(V, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2)
    loss.backward()
    assert torch.isclose(loss, torch.tensor(0.405)) and torch.isclose(V.grad, torch.tensor(-0.9))


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_world.char_tokenizer()
    torch.manual_seed(0)
    return grpo.disable_dropout(tiny_world.tiny_llama(tok)), tok


def test_value_model_reads_the_state_before_each_token(tiny):
    """V(s_t) must see tokens < t only: changing completion token t changes V at t+1 on, never at
    t or before (the same alignment as the logit that scores token t)."""
    policy, tok = tiny
    vm = ppo.ValueModel(policy)
    torch.nn.init.normal_(vm.head.weight)
    p = torch.tensor([[5, 6, 7]])
    c = torch.tensor([[8, 9, 10, 11]])
    c2 = c.clone()
    c2[0, 2] = 12
    v, v2 = (vm(p, torch.ones_like(p), x, torch.ones_like(x)) for x in (c, c2))
    assert v.shape == (1, 4)
    assert torch.allclose(v[:, :3], v2[:, :3]) and not torch.allclose(v[:, 3], v2[:, 3])
    assert sum(x.numel() for x in vm.backbone.parameters()) == \
        sum(x.numel() for x in policy.base_model.parameters())


def test_the_critic_refuses_what_it_cannot_run(tiny):
    """The critic is not an advantage function of grpo.py's seams (ppo.Critic replaces the whole
    step), and it refuses dynamic sampling and a bad λ."""
    policy, tok = tiny
    cfg = grpo.GRPOConfig(group_size=2, max_new_tokens=4, beta=0)
    assert "critic" not in baselines.ADVANTAGES
    with pytest.raises(ValueError, match="dynamic_sampling"):
        ppo.Critic(policy, dataclasses.replace(cfg, dynamic_sampling=1))
    with pytest.raises(ValueError, match="lam must be from 0 to 1"):
        ppo.PPOConfig(lam=1.5)


@pytest.mark.parametrize("mu", [1, 2])
def test_ppo_steps_move_both_networks_and_log_the_critic(tiny, mu):
    policy, tok = tiny
    policy = grpo.disable_dropout(tiny_world.tiny_llama(tok))
    ref = grpo.make_reference(policy)
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=6, lr=1e-3, num_iterations=mu,
                          micro_batch_size=3)
    critic = ppo.Critic(policy, cfg)
    opt = grpo.make_optimizer(policy, cfg)
    before = [p.detach().clone() for p in policy.parameters()]
    v_before = [p.detach().clone() for p in critic.value.parameters()]

    def reward(prompts, completions, **_):  # WHY: random text varies in it, so A is not 0
        return [len(set(c)) / 6 for c in completions]

    torch.manual_seed(1)
    for _ in range(2):
        m = critic(policy, ref, opt, tok, ["12+3=", "4+5="], [reward], cfg, return_samples=True)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in m.items()
               if isinstance(v, float)), m
    assert {"value/loss", "value/explained_variance", "value/mean", "kl", "reward"} <= set(m)
    assert len(m["samples"]) == 8
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(v_before, critic.value.parameters()))
    # the policy and the value model share no tensor: the critic is a second network
    assert not {p.data_ptr() for p in policy.parameters()} & \
        {p.data_ptr() for p in critic.value.parameters()}
