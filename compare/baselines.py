"""
baselines.py -- the teaching baselines GRPO is compared with: RLOO's and REINFORCE's advantages,
and CISPO's surrogate. grpo.py does not know them: each method's step is built here from
grpo.py's public functions, in grpo.grpo_step's order, as ppo.py builds PPO's.

    step = baselines.step_function(BaselineConfig(baseline="leave_one_out"), policy, gcfg)  # RLOO
    step = baselines.step_function(BaselineConfig(baseline="none"), policy, gcfg)  # REINFORCE
    step = baselines.step_function(BaselineConfig(surrogate="cispo"), policy, gcfg)  # CISPO
    step = baselines.step_function(BaselineConfig(baseline="critic"), policy, gcfg)  # PPO
    m = step(policy, ref, optimizer, tokenizer, prompts, reward_funcs, gcfg, seams=seams)
    # BaselineConfig() gives grpo.grpo_step itself: GRPO, the paper's.

What GRPO changes, side by side (advantage of completion i in a group of G, rewards r):
    GRPO       A_i = (r_i - mean(r)) / std(r)                      grpo.group_advantages (paper)
    RLOO       A_i = r_i - 1/(G-1) Σ_{j≠i} r_j                     leave_one_out_advantages
    REINFORCE  A_i = r_i                                           no_baseline_advantages
A baseline that does not depend on o_i leaves the gradient unbiased and lowers its variance; the
group mean includes r_i itself, which RLOO's leave-one-out mean avoids (it equals the group-mean
advantage times G/(G-1)). REINFORCE has no baseline at all: with 0/1 rewards every right answer
is pushed up and nothing is pushed down. CISPO keeps GRPO's advantages and changes the per-token
objective (cispo_surrogate). tests/test_baselines.py pins each with hand-worked numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

import grpo
from compare import ppo


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


def step_function(cfg: BaselineConfig, policy, gcfg: grpo.GRPOConfig,
                  pcfg: ppo.PPOConfig = ppo.PPOConfig()):
    """The step of cfg's method, taking grpo.grpo_step's arguments: grpo.grpo_step itself for
    GRPO (the defaults), ppo.Critic (which builds PPO's value model from the policy) for
    'critic', a ComparedStep for RLOO, REINFORCE and CISPO."""
    if cfg.baseline == "critic":
        return ppo.Critic(policy, gcfg, pcfg)
    if cfg == BaselineConfig():
        return grpo.grpo_step
    return ComparedStep(cfg)


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


def cispo_loss(logp, logp_old, logp_ref, advantages, completion_mask, cfg: grpo.GRPOConfig):
    """grpo.grpo_loss with CISPO's per-token objective (cispo_surrogate) in place of eq. 3's
    clipped one; the same KL (grpo.k3_kl), averaging (grpo.aggregate) and stats (grpo.loss_stats).
    logp, logp_old, logp_ref, completion_mask (n, T); advantages (n,) or (n, T)."""
    clip_eps_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    mask = completion_mask.to(logp.dtype)                                             # (n, T)
    A = advantages.to(logp.dtype).reshape(logp.shape[0], -1)                     # (n, 1) or (n, T)
    log_ratio = logp - logp_old                                                       # (n, T)
    if cfg.importance_sampling_level == "sequence":  # GSPO's ratio, as grpo_loss allows it
        log_ratio = grpo.sequence_log_ratio(log_ratio, mask)                          # (n, T)
    ratio = torch.exp(log_ratio)                                                      # (n, T)
    surrogate = cispo_surrogate(ratio, logp, A, cfg.clip_eps, clip_eps_high)          # (n, T)
    kl = grpo.k3_kl(logp, logp_ref) if cfg.beta != 0 else torch.zeros_like(logp)     # (n, T)
    per_token = -(surrogate - cfg.beta * kl)                                          # (n, T)
    loss = grpo.aggregate(per_token, mask, cfg.loss_type, cfg.max_new_tokens)         # ()
    return loss, grpo.loss_stats(ratio, A, kl, mask, cfg.clip_eps, clip_eps_high)


def cispo_update(policy, optimizer, batch: dict, logp_old, logp_ref, cfg: grpo.GRPOConfig,
                 seams: grpo.Seams = grpo.Seams()) -> dict:
    """grpo.policy_update's loop, line for line, with cispo_loss in place of grpo.grpo_loss: for
    each of μ updates, for each micro-batch, score, loss, backward; then clip and step. Returns
    policy_update's stats. (tests/test_baselines.py: with eq. 3's surrogate put back, it gives
    policy_update's weights and stats bit for bit.)"""
    mask, mu = batch["completion_mask"], cfg.num_iterations                           # (N, T)
    score = seams.score or grpo.token_logprobs
    update = seams.update or grpo.ClippedStep()
    weights, shares = grpo.micro_batch_weights(mask, cfg.micro_batch_size, cfg.loss_type)
    stats, skipped = {"loss": 0.0}, 0
    first_logp, first_entropy = [], []
    for it in range(mu):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for k, (s, inputs) in enumerate(grpo.micro_batches(batch, cfg.micro_batch_size)):
            logp, entropy = score(policy, *inputs, cfg.temperature, True)             # (n, T) x2
            # μ = 1: π_old is π_θ before this update (grpo.micro_batch_loss's NOTE)
            old = logp.detach() if logp_old is None else logp_old[s]                  # (n, T)
            A = batch["advantages"][s]                                            # (n,) or (n, T)
            if cfg.sampler_is_cap:
                A = grpo.sampler_weighted(A, old, batch["sampler_logp"][s], cfg.sampler_is_cap)
            loss, parts = cispo_loss(logp, old, None if logp_ref is None else logp_ref[s], A,
                                     mask[s], cfg)
            update.backward(loss * weights[k])
            value = loss.item()  # one device sync a micro-batch
            loss_sum += value * weights[k]
            stats["loss"] += value * weights[k] / mu
            for key, v in parts.items():
                stats[key] = stats.get(key, 0.0) + v * shares[k] / mu
            if it == 0:
                first_logp.append(logp.detach())
                first_entropy.append(entropy)
        grad_norm, stepped = update.step(policy, optimizer, cfg.max_grad_norm, loss_sum)
        skipped += not stepped
    agreement = grpo.sampler_agreement(torch.cat(first_logp), torch.cat(first_entropy),  # (N, T)
                                       batch["sampler_logp"], mask)
    return {**stats, **agreement, "grad_norm": grad_norm, "skipped_updates": skipped}


class ComparedStep:
    """One step of RLOO, REINFORCE or CISPO, taking grpo.grpo_step's arguments: grpo_step's calls
    in its order, with the method's advantages in place of the group's (RLOO, REINFORCE) and
    cispo_update in place of grpo.policy_update (CISPO)."""

    def __init__(self, cfg: BaselineConfig):
        if cfg.baseline == "critic":
            raise ValueError("baseline 'critic' is PPO's step: ppo.Critic (step_function)")
        self.cfg = cfg

    def __call__(self, policy, ref_model, optimizer, tokenizer, prompts, reward_funcs, cfg,
                 columns=None, return_samples=False, more_prompts=None,
                 seams: grpo.Seams = grpo.Seams()) -> dict:
        t0 = time.perf_counter()
        if cfg.beta != 0 and ref_model is None:
            raise ValueError("beta != 0 needs a reference model (make_reference(policy))")
        replaces_advantages = self.cfg.baseline in ADVANTAGES
        if replaces_advantages and cfg.supervision == "process":
            raise ValueError("process supervision sets its own advantages (§4.1.3): baseline "
                             "'group'")
        # 1-3. Sample and score as GRPO does, with its dynamic sampling if it is on (which keeps
        #      the groups whose rewards differ, DAPO's rule, whatever the baseline).
        batch = grpo.rollout(policy, tokenizer, prompts, columns, reward_funcs, cfg, seams)
        sampled = [batch]
        if cfg.dynamic_sampling:
            batch, sampled = grpo.dynamic_sampling(batch, len(prompts), more_prompts, policy,
                                                   tokenizer, reward_funcs, cfg, seams)
        if replaces_advantages:  # 3. this method's advantages in place of the group's
            A = ADVANTAGES[self.cfg.baseline](batch["rewards"], cfg.group_size)       # (N,)
            batch["advantages"] = A.to(batch["completion_ids"].device)                # (N,)
        # 4. log π_old and log π_ref, as GRPO takes them; 5-8. the update, CISPO's or GRPO's
        logp_old, logp_ref = grpo.fixed_logprobs(policy, ref_model, batch, cfg, seams)
        update_fn = cispo_update if self.cfg.surrogate == "cispo" else grpo.policy_update
        update = update_fn(policy, optimizer, batch, logp_old, logp_ref, cfg, seams)
        metrics = {**grpo.step_metrics(batch, sampled, update, cfg),
                   "step_time": time.perf_counter() - t0}
        if return_samples:
            metrics["samples"] = grpo.samples_of(batch)
        return metrics
