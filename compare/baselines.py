"""
baselines.py -- the teaching baselines GRPO is compared with: RLOO's and REINFORCE's advantages,
and CISPO's surrogate. grpo.py does not import this file: each plugs into one of its seams.

    seams = baselines.apply(BaselineConfig(baseline="leave_one_out"), grpo.Seams())   # RLOO
    seams = baselines.apply(BaselineConfig(baseline="none"), grpo.Seams())   # REINFORCE: A_i = r_i
    seams = baselines.apply(BaselineConfig(surrogate="cispo"), grpo.Seams())  # CISPO (token loss)
    grpo.grpo_step(..., seams=seams)
    # PPO's learned critic (baseline="critic") replaces the whole step: ppo.Critic.

What GRPO changes, side by side (advantage of completion i in a group of G, rewards r):
    GRPO       A_i = (r_i - mean(r)) / std(r)                      grpo.group_advantages (paper)
    RLOO       A_i = r_i - 1/(G-1) Σ_{j≠i} r_j                     leave_one_out_advantages
    REINFORCE  A_i = r_i                                           no_baseline_advantages
A baseline that does not depend on o_i leaves the gradient unbiased and lowers its variance; the
group mean includes r_i itself, which RLOO's leave-one-out mean avoids (it equals the group-mean
advantage times G/(G-1)). REINFORCE has no baseline at all: with 0/1 rewards every right answer
is pushed up and nothing is pushed down. tests/test_baselines.py pins each with hand-worked numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

import grpo


@dataclass
class BaselineConfig:
    """Which method the run trains with: GRPO (the defaults) or one it is compared with."""

    baseline: Literal["group", "leave_one_out", "none", "critic"] = "group"
    """'group': the group's mean and std (GRPO, the paper); 'leave_one_out': RLOO; 'none':
    REINFORCE; 'critic': PPO's learned value model and GAE, which ppo.Critic runs in grpo_step's
    place."""
    surrogate: Literal["clip", "cispo"] = "clip"
    """'clip': eq. 3's clipped ratio (GRPO, PPO); 'cispo': MiniMax-M1's clipped, detached weight
    times log π (cispo_surrogate), averaged over tokens (--loss-type token)."""

    def __post_init__(self):
        for name, allowed in [("baseline", ("group", "leave_one_out", "none", "critic")),
                              ("surrogate", ("clip", "cispo"))]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")


def apply(cfg: BaselineConfig, seams: grpo.Seams) -> grpo.Seams:
    """`seams` with the advantage function and surrogate of cfg's method; GRPO's leaves it as is.
    NOTE: 'critic' changes no seam: ppo.Critic runs the whole step in grpo.grpo_step's place."""
    if cfg.baseline in ("leave_one_out", "none"):
        seams = replace(seams, advantages=ADVANTAGES[cfg.baseline])
    return replace(seams, surrogate=cispo_surrogate) if cfg.surrogate == "cispo" else seams


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): rewards (N,), groups contiguous -> (N,).

    Example: rewards [1, 0, 0, 1], G = 4: the others' means are 1/3, 2/3, 2/3, 1/3, so
    A = [+2/3, -2/3, -2/3, +2/3]; all equal rewards give A = 0.
    """
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"which must be at least 2; got shape {tuple(rewards.shape)}")
    r = rewards.view(-1, group_size)                                                  # (B, G)
    # DEVIATION (opt-in, RLOO): A_i = r_i - 1/(G-1) Σ_{j≠i} r_j
    others = (r.sum(1, keepdim=True) - r) / (group_size - 1)                          # (B, G)
    return (r - others).view(-1)                                                      # (N,)


def no_baseline_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE (Williams 1992) with no baseline: A_i = r_i, rewards (N,) -> (N,)."""
    # DEVIATION (opt-in, REINFORCE): A_i = r_i
    return rewards.clone()                                                            # (N,)


ADVANTAGES = {"leave_one_out": leave_one_out_advantages, "none": no_baseline_advantages}


def cispo_surrogate(ratio: torch.Tensor, logp: torch.Tensor, A: torch.Tensor, clip_eps: float,
                    clip_eps_high: float) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585), per token: ratio, logp (N, T), A (N, 1) or (N, T).

    DEVIATION (opt-in): J = Σ_t sg(min(r_t, 1+ε_high)) · A · log π_θ(o_t). The importance weight is
    clipped and detached, and multiplies the log-prob, so no token's gradient is dropped: where
    PPO's clip zeroes a token's gradient, CISPO only caps its weight. The paper sets no lower
    bound on the weight, and neither do we (clip_eps is unused). It pairs with loss_type 'token'.

    Example: r = 1.5, ε_high = 0.2, A = +1, log π = -2: the weight is 1.2 (detached), the
    surrogate 1.2 · 1 · -2 = -2.4, and its gradient in log π is 1.2, where PPO's would be 0.
    NOTE: at μ = 1 the ratio is 1, so the gradient is A ∇log π: GRPO's, at μ = 1.
    """
    weight = torch.clamp(ratio, max=1 + clip_eps_high).detach()                       # (N, T)
    return weight * A * logp                                                          # (N, T)
