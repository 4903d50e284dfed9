"""
ppo.py -- PPO with a learned critic: the baseline GRPO removes (DeepSeekMath §4.1.1, eq. 1-2).

    python train_gsm8k.py --baseline critic          # PPO on the tiny world, GRPO's budget
    python ablation.py --variants grpo ppo rloo reinforce    # side by side, 3 seeds

What PPO does that GRPO does not (the paper's eq. 1-2; GAE is Schulman et al. 2016, arXiv
1506.02438), for one completion o of length T, tokens t = 0..T-1:
    per-token reward   r_t = -β log(π_old(o_t) / π_ref(o_t))  + [t = T-1] r(q, o)      (eq. 2)
    TD error           δ_t = r_t + γ V(s_{t+1}) - V(s_t),      V(s_T) = 0 (the episode ended)
    GAE advantage      A_t = Σ_{l>=0} (γλ)^l δ_{t+l}
    return             R_t = A_t + V(s_t)                       (the value model's target)
    value loss         L_V = 1/2 max( (V - R)^2 , (clip(V, V_old - ε_v, V_old + ε_v) - R)^2 )
The policy then takes eq. 1's clipped step, min(r_t A_t, clip(r_t, 1-ε, 1+ε) A_t), and the KL
sits in the reward above, not in the loss.

The value model V_ψ is the paper's: "a value function ... trained alongside the policy model",
here a copy of the policy's own backbone (the warm start) with a scalar head: as many weights as
the policy, with their own gradients and AdamW state. That is the memory GRPO saves.

Everything else is GRPO's, on purpose, so the comparison changes one thing: the same sampler,
rewards, reference, micro-batches, loss aggregation (cfg.loss_type), μ, gradient clipping and
AdamW settings (grpo.rollout, grpo.fixed_logprobs, grpo.policy_update, called with β = 0 since the
KL is in the reward). The defaults γ = 1 and λ = 0.95, the value clip 0.2 and whitened advantages
are TRL's PPOTrainer defaults; the paper states none. tests/test_ppo.py pins each equation.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass

import torch

import grpo


@dataclass
class PPOConfig:
    """PPO's own knobs, beside grpo.GRPOConfig (used only with --baseline critic)."""

    gamma: float = 1.0
    """γ, the discount in GAE. TRL's default 1: the reward comes once, at the end."""
    lam: float = 0.95
    """λ of GAE: 1 is the Monte-Carlo return (unbiased, noisy); 0 bootstraps one step. TRL: 0.95."""
    value_clip_eps: float = 0.2
    """ε_v: the value prediction may move at most this far from V_old in one step. TRL: 0.2."""
    value_lr: float = 0.0
    """AdamW learning rate of the value model. 0: the policy's lr."""
    whiten_advantages: bool = True
    """Standardise A_t over the batch's real tokens (TRL's PPO does). The paper is silent."""

    def __post_init__(self):
        for name, low, high in [("gamma", 0, 1), ("lam", 0, 1)]:
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be from {low} to {high}, got {getattr(self, name)}")
        for name in ("value_clip_eps", "value_lr"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


# ----------------------------------------------------------------------------------------------
# The value model: the policy's backbone with a scalar head
# ----------------------------------------------------------------------------------------------
class ValueModel(torch.nn.Module):
    """V_ψ(s_t): a copy of `policy`'s transformer body (no LM head) and a linear head to 1.
    WHY: the paper's PPO value model is as large as the policy; starting it from the same weights
         is what TRL's PPO and most RLHF code do when no reward model is at hand."""

    def __init__(self, policy):
        super().__init__()
        self.backbone = copy.deepcopy(policy.base_model)
        self.backbone.requires_grad_(True)
        self.head = torch.nn.Linear(policy.config.hidden_size, 1)
        # WHY: V starts at 0 everywhere; the first steps then fit the head before the body moves.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        """V(s_t) for each completion token t, the state before o_t is drawn: (n, P), (n, T) ->
        (n, T). The state before token t ends at position P+t-1, as its logit does."""
        P, T = prompt_ids.shape[1], completion_ids.shape[1]
        input_ids, attention_mask, position_ids = grpo.joined_sequences(              # (n, P+T) x3
            prompt_ids, prompt_mask, completion_ids, completion_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        states = hidden[:, P - 1:P + T - 1]                                           # (n, T, H)
        return self.head(states.float()).squeeze(-1)                                  # (n, T)


# ----------------------------------------------------------------------------------------------
# The equations: per-token rewards, GAE, whitening, the clipped value loss
# ----------------------------------------------------------------------------------------------
def token_rewards(rewards, logp_old, logp_ref, mask, beta: float) -> torch.Tensor:
    """Eq. 2's per-token reward: rewards (N,), logp_old, logp_ref, mask (N, T) -> (N, T).

    Example (test_token_rewards_hand_worked): β = 0.5, reward 1, length 2, log π_old - log π_ref
    = [0.2, -0.4] gives [-0.1, +0.2 + 1] = [-0.1, 1.2]; a pad position gets 0.
    """
    mask = mask.to(logp_old.dtype)                                                    # (N, T)
    # PAPER: r_t = r_φ(q, o_≤t) - β log(π_θ(o_t|q,o_<t) / π_ref(o_t|q,o_<t))           (eq. 2)
    # NOTE: the KL here is the plain log-ratio (k1) of the sampled token, as eq. 2 writes it and
    #       TRL's PPO computes it, not GRPO's k3 in the loss (eq. 4).
    per_token = -beta * (logp_old - logp_ref) * mask                                  # (N, T)
    last = (mask.sum(1).long() - 1).clamp(min=0)                                      # (N,)
    # WHY: the rule-based reward judges the whole completion, so it arrives at its last token.
    return per_token.scatter_add(1, last[:, None], rewards.to(per_token)[:, None])    # (N, T)


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation: token rewards, values V(s_t), mask (N, T) ->
    (advantages A_t, returns R_t), each (N, T); 0 on pad positions.

    Example (test_gae_hand_worked): γ = 1, λ = 0.5, rewards [0, 1], values [0.5, 0.5] give
    δ = [0 + 0.5 - 0.5, 1 + 0 - 0.5] = [0, 0.5], A = [0 + 0.5·0.5, 0.5] = [0.25, 0.5] and
    R = A + V = [0.75, 1.0]. tests/test_ppo.py checks it against the usual backward loop.
    """
    mask = mask.to(values.dtype)                                                      # (N, T)
    T = values.shape[1]
    V = values * mask                                                                 # (N, T)
    # WHY: V(s_{t+1}) is 0 past the last real token: the episode has ended there.
    next_V = torch.cat([V[:, 1:], torch.zeros_like(V[:, :1])], dim=1)                 # (N, T)
    # PAPER (GAE): δ_t = r_t + γ V(s_{t+1}) - V(s_t)
    delta = (rewards + gamma * next_V - V) * mask                                     # (N, T)
    # PAPER (GAE): A_t = Σ_{l>=0} (γλ)^l δ_{t+l}, as one matrix product instead of a loop over t:
    #              D[s, t] = (γλ)^(s-t) for s >= t, else 0.
    steps = torch.arange(T, device=values.device)                                     # (T,)
    gap = (steps[:, None] - steps[None, :]).to(values.dtype)                          # (T, T) s-t
    D = torch.where(gap >= 0, (gamma * lam) ** gap.clamp(min=0), 0.0)                 # (T, T)
    advantages = (delta @ D) * mask                                                   # (N, T)
    return advantages, (advantages + V) * mask                                        # (N, T) x2


def whiten(x, mask, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the real tokens of the whole batch, as TRL's PPO does: (N, T) ->
    (N, T), 0 on pads. WHY: puts every batch's advantages on one scale, as GRPO's std does."""
    m = mask.to(x.dtype)                                                              # (N, T)
    n = m.sum().clamp(min=1)                                                          # ()
    mean = (x * m).sum() / n                                                          # ()
    var = (((x - mean) * m) ** 2).sum() / n                                           # ()
    return (x - mean) * torch.rsqrt(var + eps) * m                                    # (N, T)


def value_loss(values, values_old, returns, mask, clip_eps: float):
    """PPO's clipped value loss, summed over real tokens (the caller divides): all (n, T).

    PAPER (PPO, as TRL's PPOTrainer): L_V = 1/2 max((V - R)^2, (clip(V, V_old ± ε_v) - R)^2).
    Example (test_value_loss_clip_hand_worked): V_old 0, V 1, R 1, ε_v 0.2: unclipped 0, clipped
    (0.2 - 1)^2 = 0.64, so the loss is 0.32: the clip keeps V from jumping to the target at once.
    """
    clipped = values_old + torch.clamp(values - values_old, -clip_eps, clip_eps)      # (n, T)
    worst = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)          # (n, T)
    return 0.5 * (worst * mask.to(worst.dtype)).sum()                                 # ()


# ----------------------------------------------------------------------------------------------
# One PPO step, with grpo_step's signature
# ----------------------------------------------------------------------------------------------
class Critic:
    """PPO's value model and its optimizer. Calling it runs one PPO step and takes the arguments
    grpo.grpo_step takes, so train_gsm8k.py swaps one for the other:

        step = ppo.Critic(policy, gcfg, pcfg) if bcfg.baseline == "critic" else grpo.grpo_step
        m = step(policy, ref, optimizer, tokenizer, prompts, reward_funcs, gcfg, columns=...)
    """

    def __init__(self, policy, cfg: grpo.GRPOConfig, pcfg: PPOConfig = PPOConfig()):
        if cfg.dynamic_sampling or hasattr(policy, "peft_config"):
            raise ValueError("baseline 'critic' (PPO) runs full fine-tuning without "
                             "dynamic_sampling; LoRA and dynamic sampling are GRPO's here")
        self.pcfg = pcfg
        self.value = ValueModel(policy).to(policy.device)
        # WHY: the same AdamW as the policy's (grpo.make_optimizer), at value_lr if it is set.
        self.optimizer = grpo.make_optimizer(
            self.value, dataclasses.replace(cfg, lr=pcfg.value_lr or cfg.lr))

    def __call__(self, policy, ref_model, optimizer, tokenizer, prompts, reward_funcs, cfg,
                 columns=None, return_samples=False, more_prompts=None,
                 seams: grpo.Seams = grpo.Seams()) -> dict:
        t0, pcfg = time.perf_counter(), self.pcfg
        if cfg.beta != 0 and ref_model is None:
            raise ValueError("beta != 0 needs a reference model (make_reference(policy))")
        # 1-2. Sample and score exactly as GRPO does, through the same seams. NOTE: rollout's
        #      group advantages are replaced below by GAE's.
        batch = grpo.rollout(policy, tokenizer, prompts, columns, reward_funcs, cfg, seams)
        mask = batch["completion_mask"]                                               # (N, T)
        logp_old, logp_ref = grpo.fixed_logprobs(policy, ref_model, batch, cfg, seams)  # (N, T)
        # NOTE: at μ = 1 no π_old pass runs: the sampler's own log-probs are π_old's (equal to
        #       rounding in fp32, grpo.policy_update's sampling/* metrics say how close).
        old = batch["sampler_logp"] if logp_old is None else logp_old                 # (N, T)
        ref = old if logp_ref is None else logp_ref                        # (N, T) β = 0: no KL
        with torch.no_grad():
            values_old = torch.cat([self.value(*inputs) for _, inputs in                # (N, T)
                                    grpo.micro_batches(batch, cfg.micro_batch_size)])
        r = token_rewards(batch["rewards"].to(old.device), old, ref, mask, cfg.beta)  # (N, T)
        A, returns = gae(r, values_old, mask, pcfg.gamma, pcfg.lam)                   # (N, T) x2
        batch["advantages"] = whiten(A, mask) if pcfg.whiten_advantages else A        # (N, T)
        # 3. The policy's clipped step: GRPO's update, with the KL already in the reward (β = 0).
        update = grpo.policy_update(policy, optimizer, batch, logp_old, None,
                                    dataclasses.replace(cfg, beta=0.0), seams)
        # NOTE: logged as GRPO logs it (k3 of π_ref against π_old), so the two runs compare.
        k3 = grpo.k3_kl(old, ref)                                                     # (N, T)
        update["kl"] = ((k3 * mask).sum() / mask.sum().clamp(min=1)).item()
        update.update(self.value_update(batch, values_old, returns, cfg))
        metrics = {**grpo.step_metrics(batch, [batch], update, cfg),
                   "step_time": time.perf_counter() - t0}
        if return_samples:
            metrics["samples"] = grpo.samples_of(batch)
        return metrics

    def value_update(self, batch, values_old, returns, cfg) -> dict:
        """μ AdamW steps of the value model on L_V, averaged over the batch's real tokens."""
        mask = batch["completion_mask"]                                               # (N, T)
        n_tok, stats = mask.sum().clamp(min=1).item(), {}
        for _ in range(cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for s, inputs in grpo.micro_batches(batch, cfg.micro_batch_size):
                loss = value_loss(self.value(*inputs), values_old[s], returns[s], mask[s],
                                  self.pcfg.value_clip_eps) / n_tok
                loss.backward()
                total += loss.item()
            norm = torch.nn.utils.clip_grad_norm_(self.value.parameters(), cfg.max_grad_norm)
            if torch.isfinite(norm):  # WHY: as the policy's update, a non-finite one is skipped
                self.optimizer.step()
            # WHY (memory): free the gradients now, not at the next step: a model-sized buffer
            self.optimizer.zero_grad(set_to_none=True)
        m = mask.bool()
        err = (returns - values_old)[m]                                               # (tokens,)
        # NOTE: explained variance 1 - Var(R - V_old) / Var(R): 1 is a perfect critic, 0 one no
        #       better than a constant, below 0 worse than one.
        ev = 1 - err.var() / returns[m].var().clamp(min=1e-8)
        stats.update({"value/loss": total, "value/grad_norm": norm.item(),
                      "value/mean": values_old[m].mean().item(),
                      "value/explained_variance": ev.item()})
        return stats
