"""
grpo.py -- Group Relative Policy Optimization in one file.

What this is
    The whole GRPO algorithm from DeepSeekMath (Shao et al. 2024, arXiv 2402.03300, §4.1 and
    Algorithm 1), for any Hugging Face causal LM and tokenizer, on one device. Read it next to the paper:
    each equation sits above the line that computes it, and tests/test_grpo.py pins it with hand-worked
    numbers. grpo_step, near the end, is Algorithm 1's inner loop as a list of calls in the paper's order.

The objective it maximises (outcome supervision, §4.1.1-4.1.2, eq. 3)
    J(θ) = E[ 1/G Σ_i 1/|o_i| Σ_t { min( r_it A_i , clip(r_it, 1-ε, 1+ε) A_i ) - β D_KL[π_θ||π_ref] } ]
      r_it(θ) = π_θ(o_it | q, o_i<t) / π_old(o_it | q, o_i<t)   (a probability RATIO, not a reward)
      A_i     = (r_i - mean(r)) / std(r)                          (r_i is the REWARD of completion i)
      D_KL    ≈ π_ref/π_θ - log(π_ref/π_θ) - 1                    (k3 estimator, eq. 4)
    We minimise loss = -J. Process supervision (§4.1.3) replaces A_i by a per-token advantage built
    from step rewards (process_advantages).

How to run it
    python train_gsm8k.py                         # the tiny offline world, on a CPU, in minutes
    python -m pytest tests/test_grpo.py -q        # every equation, pinned

What it leaves out, on purpose
    - the critic (that is the point of GRPO: the group mean is the baseline);
    - multi-GPU, vLLM, DeepSpeed (see docs/past_one_gpu.md);
    - the paper's iterative reward-model retraining and reference resets (Algorithm 1, outer loop);
    - learned reward models: process supervision uses a rule-based step reward (rewards.py);
    - speed machinery: the fast sampler lives in engine.py and draws the same tokens as the one here.

Tensor dimensions used in shape comments
    B  prompts per step          G  completions per prompt (group_size)
    N  = B*G sequences           P  prompt tokens (left-padded)
    T  completion tokens         V  vocabulary size

The steps below, in order
    0. GRPOConfig            every knob, with the paper's defaults
    1. sample_completions    G completions per prompt from π_old (= π_θ before this step's update)
    2. compute_rewards       weighted rule-based reward functions, TRL's signature
    3. group_advantages      A_i = (r_i - mean) / (std + eps) within each group (outcome)
       process_advantages    Â_i,t from normalised step rewards (process)
    4. token_logprobs        log π(o_it) via gather + logsumexp, for π_θ, π_old and π_ref
    5-7. grpo_loss           ratio and clip (5), k3 KL (6), aggregation over tokens (7)
    8. policy_update         μ optimizer steps: backward, gradient clip, AdamW
    9. grpo_step             1-8 in order, then step_metrics
    Variants                 dynamic sampling (DAPO), GSPO's sequence ratio, process supervision's
                             plumbing: each is one call from the core above
Variants since the paper are opt-in switches in GRPOConfig that cite their paper; each line that
differs from the paper is tagged DEVIATION.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, get_args

import torch

import engine
import rewards

LossType = Literal["grpo", "token", "dr_grpo"]
LOSS_TYPES = get_args(LossType)


# ----------------------------------------------------------------------------------------------
# 0. Configuration
# ----------------------------------------------------------------------------------------------
@dataclass
class GRPOConfig:
    """Every knob of one GRPO step. Defaults follow the paper (§4.2, "Training Setting") unless tagged."""

    group_size: int = 8
    """G, completions sampled per prompt. PAPER: 64; our default 8 fits one small GPU or a CPU."""
    beta: float = 0.04
    """β, weight of the KL penalty to the frozen reference. PAPER: 0.04. 0 drops the reference model."""
    clip_eps: float = 0.2
    """ε, PPO clip range: the ratio is clipped to [1-ε, 1+ε_high]. PPO's 0.2; the paper prints none."""
    clip_eps_high: float | None = None
    """ε_high, upper clip; None means ε_high = ε. DAPO's clip-higher (arXiv 2503.14476) uses 0.28."""
    num_iterations: int = 1
    """μ, policy updates per batch of samples (Algorithm 1). PAPER: 1 (one update per exploration)."""
    loss_type: LossType = "grpo"
    """Averaging of per-token losses: 'grpo' (paper), 'token' (DAPO), 'dr_grpo' (Dr. GRPO)."""
    scale_rewards: bool = True
    """Divide centred rewards by the group std (paper). False: mean-centring only (Dr. GRPO)."""
    adv_eps: float = 1e-4
    """ε added to the group std before dividing. Our choice, as TRL: A stays finite when std is tiny."""
    temperature: float = 1.0
    """Sampling temperature; the loss scores log-probs at the same temperature. 1.0: the true policy."""
    max_new_tokens: int = 256
    """Cap on completion length T. PAPER: 1024. Hitting it counts in completions/clipped_ratio."""
    min_new_tokens: int = 0
    """Force at least this many new tokens (0 = off). Only for benchmarks that need equal work."""
    lr: float = 1e-6
    """AdamW learning rate. PAPER: 1e-6 for a 7B model; tiny models want far more (see the presets)."""
    weight_decay: float = 0.0
    """AdamW weight decay. Our choice: 0, so the only pull toward the start is the KL term."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this. Our choice, standard for LM fine-tuning (TRL: 1.0)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass. Smaller uses less memory; the gradient is the same."""
    reward_weights: list[float] | None = None
    """One weight per reward function; None means all 1.0. The total reward is the weighted sum."""
    supervision: Literal["outcome", "process"] = "outcome"
    """'outcome' (§4.1.2: a reward per completion) or 'process' (§4.1.3: a reward per step, from one
    function returning (end, reward) pairs per completion, e.g. rewards.calculator_process_reward)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """'token' (paper: a ratio per token) or 'sequence' (GSPO, arXiv 2507.18071: one length-normalised
    ratio per completion, clipped as a whole; GSPO pairs it with a tiny clip_eps, e.g. 3e-4 / 4e-4)."""
    dynamic_sampling: int = 0
    """DAPO's dynamic sampling: drop groups whose rewards all agree and refill the batch from up to
    this many more rounds of fresh prompts (grpo_step's more_prompts). 0: off (paper)."""
    sampler: Literal["engine", "reference"] = "engine"
    """'engine': engine.py's fast loop; 'reference': reference_decode below. Both draw the same tokens."""

    def __post_init__(self):
        """Settings that cannot work fail here, at construction, with one line naming the field."""
        choices = {"loss_type": LOSS_TYPES, "supervision": ("outcome", "process"),
                   "importance_sampling_level": ("token", "sequence"),
                   "sampler": ("engine", "reference")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        # NOTE: no batch size has to divide another: the last micro-batch may be smaller, and
        #       micro_batch_weights keeps the summed gradient equal to the full-batch one (tested).
        checks = [
            (self.group_size >= 2, "group_size must be at least 2 (a group baseline needs 2)"),
            (self.beta >= 0, "beta must be >= 0"), (self.clip_eps > 0, "clip_eps must be > 0"),
            (self.clip_eps_high is None or self.clip_eps_high > 0, "clip_eps_high must be > 0"),
            (self.num_iterations >= 1, "num_iterations must be >= 1"),
            (self.adv_eps >= 0, "adv_eps must be >= 0"),
            (self.temperature > 0, "temperature must be > 0"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be from 0 to max_new_tokens ({self.max_new_tokens})"),
            (self.lr > 0, "lr must be > 0"), (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.max_grad_norm > 0, "max_grad_norm must be > 0"),
            (self.micro_batch_size >= 1, "micro_batch_size must be >= 1"),
            (self.reward_weights is None or all(math.isfinite(w) for w in self.reward_weights),
             "reward_weights must be finite numbers"),
            (self.dynamic_sampling >= 0, "dynamic_sampling must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                field = message.split()[0]
                raise ValueError(f"{message}, got {getattr(self, field)!r}")


# ----------------------------------------------------------------------------------------------
# 1. Sample a group of G completions per prompt
# ----------------------------------------------------------------------------------------------
def eos_token_ids(model, tokenizer) -> list[int]:
    """All token ids that end a completion: the model's generation_config eos ids, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        # NOTE: a freshly initialised model's generation_config has no eos/pad/bos ids; use the tokenizer's.
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("neither the model's generation_config nor the tokenizer defines an eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos)


def pad_token_id(model, tokenizer) -> int:
    """The id written after a completion's EOS: the tokenizer's pad token, else the first EOS id."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids(model, tokenizer)[0]


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """1 for every completion token up to and including the first EOS, 0 after it. (N, T) -> (N, T)."""
    N, T = completion_ids.shape
    eos = torch.tensor(list(eos_ids), device=completion_ids.device)                   # (E,)
    is_eos = torch.isin(completion_ids, eos)                                          # (N, T)
    # WHY: a sequence with no EOS hit the length cap; all T of its tokens count.
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), T)                 # (N,)
    positions = torch.arange(T, device=completion_ids.device)                         # (T,)
    # NOTE: the EOS itself is kept in the mask, so the model is credited (or blamed) for stopping.
    return (positions[None, :] <= first_eos[:, None]).long()                          # (N, T)


def draw_tokens(logits, t, done, *, eos, pad_id, temperature, min_new_tokens, greedy):
    """Token t of every completion, drawn from the policy: logits (N, V), done (N,) -> (ids, done).

    PAPER: o_i ~ π_old(· | q), one token at a time. Rows that have ended get pad_id from then on.
    """
    if t < min_new_tokens:
        logits[:, eos] = -math.inf                                                    # (N, V) no EOS yet
    if greedy:
        next_ids = logits.argmax(-1)                                                  # (N,)
    else:
        # NOTE: no top-k / top-p: the samples must come from exactly the distribution whose log-probs
        #       the loss uses. (generate() would silently apply top_k=50 from transformers' defaults.)
        probs = torch.softmax(logits / temperature, dim=-1)                           # (N, V)
        next_ids = torch.multinomial(probs, 1).squeeze(1)                             # (N,)
    next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)         # (N,)
    return next_ids, done | torch.isin(next_ids, eos)                                 # (N,), (N,)


def reference_decode(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, pick):
    """The plain sampling loop: prompts (B, P), (B, P) -> completion ids (N, T), T <= max_new_tokens.

    Each step runs the model over the whole sequence so far, draws one token per row with `pick`
    (draw_tokens), appends it, and stops once every row has drawn an EOS.
    NOTE: there is no KV cache, so step t re-reads all P+t tokens. engine.decode keeps one (and more
          tricks) and draws exactly these tokens from the same seed (tests/test_engine.py).
    """
    ids = prompt_ids.repeat_interleave(group_size, 0)                                 # (N, P) in groups
    mask = prompt_mask.repeat_interleave(group_size, 0)                               # (N, P)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)             # (N,)
    for t in range(max_new_tokens):
        # WHY: number positions from each prompt's first real token, as generate() does.
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)                              # (N, P+t)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
        next_ids, done = pick(out.logits[:, -1, :].float(), t, done)                  # (N,), (N,)
        ids = torch.cat([ids, next_ids[:, None]], dim=1)                              # (N, P+t+1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)                 # (N, P+t+1)
        if done.all():
            break
    return ids[:, prompt_ids.shape[1]:]                                               # (N, T)


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], cfg: GRPOConfig, greedy: bool = False,
                       group_size: int | None = None) -> dict:
    """G completions for each of B prompt strings, as a dict of tensors whose rows come in groups.

    greedy=True decodes the most likely completion instead (evaluation, with group_size=1).
    group_size overrides cfg.group_size (evaluation samples one completion per prompt).
    """
    G = cfg.group_size if group_size is None else group_size
    device = next(model.parameters()).device
    # WHY: left padding puts every prompt's last token at the same column, so decoding starts together.
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False)
    prompt_ids, prompt_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)  # (B, P)
    eos_ids, pad_id = eos_token_ids(model, tokenizer), pad_token_id(model, tokenizer)
    pick = functools.partial(draw_tokens, eos=torch.tensor(eos_ids, device=device), pad_id=pad_id,
                             temperature=cfg.temperature, min_new_tokens=cfg.min_new_tokens,
                             greedy=greedy)
    decode = engine.decode if cfg.sampler == "engine" else reference_decode
    was_training = model.training
    model.eval()  # WHY: under gradient checkpointing, train mode turns the KV cache off.
    completion_ids = decode(model, prompt_ids, prompt_mask, G, cfg.max_new_tokens, pick)  # (N, T)
    model.train(was_training)

    completion_mask = completion_mask_from_ids(completion_ids, eos_ids)              # (N, T)
    # WHY: pads after EOS may equal a real token id; zero them out of the way with the mask, not by id.
    texts = tokenizer.batch_decode(completion_ids * completion_mask + pad_id * (1 - completion_mask),
                                   skip_special_tokens=True)
    # A completion with no EOS at all stopped because it hit max_new_tokens.
    truncated = ~torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)  # (N,)
    return dict(prompt_ids=prompt_ids.repeat_interleave(G, 0),                        # (N, P)
                prompt_mask=prompt_mask.repeat_interleave(G, 0),                      # (N, P)
                completion_ids=completion_ids, completion_mask=completion_mask,       # (N, T)
                completions=texts, truncated=truncated)


# ----------------------------------------------------------------------------------------------
# 2. Score each completion with rule-based reward functions
# ----------------------------------------------------------------------------------------------
RewardFn = Callable[..., list]


def reward_name(fn) -> str:
    """The name a reward function is logged under: rewards/<name>."""
    return getattr(fn, "__name__", type(fn).__name__)


def compute_rewards(reward_funcs: Sequence[RewardFn], prompts: list[str], completions: list[str],
                    columns: dict | None = None, weights: Sequence[float] | None = None):
    """r_i = Σ_k w_k f_k(prompt_i, completion_i), each f with TRL's signature f(prompts, completions,
    **columns). Every list holds N entries (columns already repeated G times per prompt).

    Returns (rewards (N,) float32, {name: mean of that function's raw reward}).
    """
    N = len(completions)
    weights = [1.0] * len(reward_funcs) if weights is None else list(weights)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(reward_funcs)} reward functions")
    per_fn = torch.zeros(len(reward_funcs), N)                                        # (K, N)
    for k, fn in enumerate(reward_funcs):
        values = fn(prompts=prompts, completions=completions, **(columns or {}))
        if values is None or len(values) != N:
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"reward function {reward_name(fn)!r} returned {got} for {N} completions")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"reward function {reward_name(fn)!r} returned {v!r}; expected a number")
        per_fn[k] = torch.tensor(values, dtype=torch.float32)                         # (N,)
    # PAPER: r_i = Σ_k w_k f_k(prompt_i, completion_i)       (rule-based rewards, §4.1 and DeepSeek-R1)
    rewards = (torch.tensor(weights, dtype=torch.float32)[:, None] * per_fn).sum(0)   # (N,)
    return rewards, {reward_name(fn): per_fn[k].mean().item() for k, fn in enumerate(reward_funcs)}


# ----------------------------------------------------------------------------------------------
# 3. Group-relative advantages: the group mean replaces PPO's learned critic
# ----------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """Standardise each reward within its group of G: rewards (N,), groups contiguous -> (N,)."""
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 to have a group baseline, got {group_size}")
    grouped = rewards.view(-1, group_size).float()                                    # (B, G)
    mean = grouped.mean(dim=1, keepdim=True)                                          # (B, 1)
    # PAPER: Â_i,t = r̃_i = (r_i - mean(r)) / std(r)                   (§4.1.2, outcome supervision)
    centred = grouped - mean                                                          # (B, G)
    if not scale_rewards:
        # DEVIATION (opt-in, Dr. GRPO arXiv 2503.20783): dividing by std up-weights groups whose rewards
        # barely differ (nearly all right or all wrong); mean-centring keeps the reward's scale.
        return centred.view(-1)                                                       # (N,)
    # NOTE: std is the SAMPLE std (Bessel, divide by G-1), as torch.std and TRL use; the paper is silent.
    # NOTE: eps goes OUTSIDE the sqrt, added to std. A group whose rewards are all equal has centred == 0
    #       exactly, so its advantage is 0/(0+eps) = 0, never NaN: such a group carries no signal.
    std = grouped.std(dim=1, keepdim=True)                                            # (B, 1)
    return (centred / (std + eps)).view(-1)                                           # (N,)


def process_advantages(step_rewards: list[list[tuple[int, float]]], group_size: int, num_tokens: int,
                       eps: float = 1e-4) -> torch.Tensor:
    """Process supervision (§4.1.3). step_rewards[n] lists completion n's steps as (end token, reward).
    Returns per-token advantages (N, T): each token gets the sum of the normalised rewards of the steps
    that end at or after it.
    """
    N = len(step_rewards)
    if N % group_size:
        raise ValueError(f"{N} completions do not split into groups of {group_size}")
    advantages = torch.zeros(N, num_tokens)                                           # (N, T)
    for g in range(0, N, group_size):
        group = step_rewards[g:g + group_size]
        R = torch.tensor([r for steps in group for _, r in steps], dtype=torch.float32)  # (K,) all steps
        # PAPER: r̃_i^index(j) = (r_i^index(j) - mean(R)) / std(R), R = every step reward in the group
        # NOTE: as for outcomes: the sample std, eps added to it (equal step rewards give 0 everywhere).
        #       A single step in the whole group has no spread: its advantage is 0.
        std = R.std() if R.numel() > 1 else torch.tensor(0.0)                         # ()
        normalised = (R - R.mean()) / (std + eps) if R.numel() > 1 else torch.zeros_like(R)  # (K,)
        k = 0
        for i, steps in enumerate(group):
            for end, _ in steps:
                advantages[g + i, min(max(end, 0), num_tokens - 1)] += normalised[k]
                k += 1
    # PAPER: Â_i,t = Σ_{index(j) >= t} r̃_i^index(j)      (a reverse cumulative sum over positions)
    return advantages.flip(1).cumsum(1).flip(1)                                       # (N, T)


# ----------------------------------------------------------------------------------------------
# 4. Per-token log-probabilities of the completion tokens
# ----------------------------------------------------------------------------------------------
def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                   temperature: float = 1.0, with_entropy: bool = False):
    """log π(o_t | q, o_<t) of each completion token: (n, P) and (n, T) -> logp (n, T) [, entropy].

    Runs with gradients if the caller has them on; wrap it in torch.no_grad() for π_old and π_ref.
    """
    T = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)                        # (n, P+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)                 # (n, P+T)
    # WHY: sampling numbers positions from the first real token of a left-padded prompt; so must we,
    #      or models with absolute position embeddings would score a different sequence.
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)                        # (n, P+T)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=False, **engine.last_logits_only(model, T + 1))  # WHY (memory): no prompt logits
    logits = out.logits[:, -(T + 1):-1, :]                                            # (n, T, V)
    logits = logits.float() / temperature                                             # (n, T, V)
    # PAPER: log softmax(l)[o] = l[o] - logsumexp(l)
    # WHY (memory): gather + logsumexp never keeps a second (n, T, V) log_softmax tensor alive.
    chosen = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)              # (n, T)
    lse = torch.logsumexp(logits, dim=-1)                                             # (n, T)
    logp = chosen - lse                                                               # (n, T)
    if not with_entropy:
        return logp
    with torch.no_grad():
        # NOTE: H = -Σ_v p_v log p_v = logsumexp(l) - Σ_v p_v l_v       (logged as `entropy`; no gradient)
        # WHY (memory): one sequence at a time, so the softmax is a (T, V) temporary, not (n, T, V).
        entropy = torch.stack([row_lse - (torch.softmax(row, dim=-1) * row).sum(-1)   # (T,) per row
                               for row, row_lse in zip(logits, lse)])                 # (n, T)
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# 5-7. The GRPO loss: clipped ratio (5), k3 KL (6), aggregation (7)
# ----------------------------------------------------------------------------------------------
def grpo_loss(logp, logp_old, logp_ref, advantages, completion_mask, *, clip_eps=0.2,
              clip_eps_high=None, beta=0.04, loss_type="grpo", max_completion_length=None,
              importance_sampling_level="token"):
    """loss = -J(θ) for one batch. logp, logp_old, logp_ref, completion_mask: (N, T); advantages (N,)
    for outcome supervision (one per completion) or (N, T) for process supervision (one per token).
    Returns (scalar loss, stats: kl, clip_ratio/low, clip_ratio/high, clip_ratio/region).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta != 0 and logp_ref is None:
        raise ValueError("logp_ref is required when beta != 0")
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = completion_mask.to(logp.dtype)                                             # (N, T)
    A = advantages.to(logp.dtype)                                                     # (N,) or (N, T)
    A = A[:, None] if A.dim() == 1 else A                                             # (N, 1) or (N, T)

    # 5. PAPER: r_it(θ) = π_θ(o_it|q,o_i<t) / π_old(o_it|q,o_i<t), as exp of a log difference
    # NOTE: with μ = 1, logp_old is logp.detach(): the ratio is exactly 1 in value, yet its gradient is
    #       ∇ratio = ratio·∇logp = ∇logp. So the printed loss is ~0 (advantages are zero-mean in each
    #       group) while the gradient is REINFORCE's with the group baseline. Nothing is broken.
    log_ratio = logp - logp_old                                                       # (N, T)
    if importance_sampling_level == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask)  # DEVIATION (opt-in, GSPO): see Variants
    ratio = torch.exp(log_ratio)                                                      # (N, T)
    # PAPER: min( r·A , clip(r, 1-ε, 1+ε)·A )                       (eq. 3; ε_high is DAPO's)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)                     # (N, T)
    surrogate = torch.min(ratio * A, clipped * A)                                     # (N, T)

    # 6. PAPER: D_KL[π_θ||π_ref] = π_ref/π_θ - log(π_ref/π_θ) - 1         (eq. 4, Schulman's k3)
    # NOTE: k3 is an unbiased, always >= 0 estimate of the REVERSE KL(π_θ || π_ref) from tokens sampled
    #       from π_θ (here: π_old, equal to π_θ when μ = 1). It is added to the loss, not the reward.
    if beta != 0:
        log_ref_ratio = logp_ref - logp                                               # (N, T)
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1                             # (N, T)
        per_token = -(surrogate - beta * kl)                                          # (N, T)
    else:
        kl = torch.zeros_like(logp)                                                   # (N, T)
        per_token = -surrogate                                                        # (N, T)

    # 7. NOTE: per-sequence vs per-token averaging. 'grpo' gives every completion equal weight, so a
    #       token of a long completion weighs less than one of a short completion (a length bias, see
    #       Dr. GRPO); 'token' weighs every token in the batch alike. They differ when lengths differ.
    if loss_type == "grpo":
        # PAPER: 1/G Σ_i 1/|o_i| Σ_t                                                  (eq. 3)
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif loss_type == "token":
        # DEVIATION (opt-in, DAPO arXiv 2503.14476): Σ_i Σ_t / Σ_i |o_i|
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    else:
        # DEVIATION (opt-in, Dr. GRPO arXiv 2503.20783): Σ_i Σ_t / (N · L_max), no length bias
        L = max_completion_length if max_completion_length is not None else mask.shape[1]
        loss = (per_token * mask).sum() / (mask.shape[0] * L)
    return loss, loss_stats(ratio, A, kl, mask, clip_eps, clip_eps_high)


@torch.no_grad()
def loss_stats(ratio, A, kl, mask, clip_eps: float, clip_eps_high: float) -> dict:
    """Mean KL per token and the share of tokens where the clip binds (TRL's clip_ratio/* names)."""
    n_tok = mask.sum().clamp(min=1)                                                   # ()
    low = ((ratio < 1 - clip_eps) & (A < 0)).to(mask.dtype)                           # (N, T) binds below
    high = ((ratio > 1 + clip_eps_high) & (A > 0)).to(mask.dtype)                     # (N, T) binds above
    return {"kl": ((kl * mask).sum() / n_tok).item(),
            "clip_ratio/low": ((low * mask).sum() / n_tok).item(),
            "clip_ratio/high": ((high * mask).sum() / n_tok).item(),
            "clip_ratio/region": (((low + high) * mask).sum() / n_tok).item()}


# ----------------------------------------------------------------------------------------------
# 8. The policy update: μ optimizer steps on one batch of samples
# ----------------------------------------------------------------------------------------------
def make_reference(policy):
    """A frozen copy of the policy: π_ref. PAPER: the reference is the initial (SFT) model."""
    ref = copy.deepcopy(policy).eval()
    ref.requires_grad_(False)
    return ref


def disable_dropout(model):
    """Set every dropout probability in `model` to 0, in place.

    WHY: with dropout on, π_θ in the ratio is a different random function from the π_old that sampled,
    so the ratio is not 1 at μ = 1 and the KL is noisy. TRL does the same. (Llama/Qwen configs already
    use 0; GPT-2 uses 0.1.) We zero it rather than call .eval(), because gradient checkpointing in
    transformers only runs in train mode.
    """
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


def make_optimizer(policy, cfg: GRPOConfig):
    """AdamW over the trainable parameters. PAPER: AdamW (§4.2, lr 1e-6)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    # WHY (GPU memory, speed): AdamW's default foreach path makes model-sized temporaries at every step
    #      on a GPU; the fused kernel does without them (TRL uses it too). The CPU keeps the default.
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def micro_batch_weights(completion_mask: torch.Tensor, slices: list[slice], loss_type: str) -> list:
    """Weight of each micro-batch's mean loss so that the weighted sum equals the full-batch loss:
    'grpo' and 'dr_grpo' average over sequences (n_mb / N), 'token' over tokens (tokens_mb / total)."""
    if loss_type == "token":
        total = completion_mask.sum().clamp(min=1).item()
        return [completion_mask[s].sum().item() / total for s in slices]
    N = completion_mask.shape[0]
    return [(s.stop - s.start) / N for s in slices]


def micro_batches(batch: dict, size: int):
    """(slice, model inputs) for each micro-batch of `size` sequences; the last one may be smaller."""
    N = batch["completion_ids"].shape[0]
    for i in range(0, N, size):
        s = slice(i, min(i + size, N))
        yield s, (batch["prompt_ids"][s], batch["prompt_mask"][s],                    # (n, P), (n, P)
                  batch["completion_ids"][s], batch["completion_mask"][s])            # (n, T), (n, T)


def policy_update(policy, optimizer, batch: dict, logp_old, logp_ref, cfg: GRPOConfig) -> dict:
    """Algorithm 1's inner loop: μ optimizer steps on this batch, each over every micro-batch.
    logp_old is None when μ = 1 (then π_old = π_θ). Returns the loss, KL, clip, entropy and grad stats."""
    mask, mu = batch["completion_mask"], cfg.num_iterations                           # (N, T)
    slices = [s for s, _ in micro_batches(batch, cfg.micro_batch_size)]
    weights = micro_batch_weights(mask, slices, cfg.loss_type)
    tok_share = [mask[s].sum().item() / max(1, mask.sum().item()) for s in slices]
    stats = dict.fromkeys(["loss", "kl", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region"], 0.0)
    entropy_sum, grad_norm, skipped = 0.0, 0.0, 0
    for it in range(mu):
        optimizer.zero_grad(set_to_none=True)
        loss_this_update = 0.0
        for (s, inputs), w, share in zip(micro_batches(batch, cfg.micro_batch_size), weights, tok_share):
            logp, entropy = token_logprobs(policy, *inputs, cfg.temperature, with_entropy=True)  # (n, T)
            # NOTE: with μ = 1 there is no π_old forward pass: π_old = π_θ, so logp_old = logp.detach().
            old = logp.detach() if logp_old is None else logp_old[s]                  # (n, T)
            ref = None if logp_ref is None else logp_ref[s]                           # (n, T)
            loss, loss_parts = grpo_loss(
                logp, old, ref, batch["advantages"][s], mask[s], clip_eps=cfg.clip_eps,
                clip_eps_high=cfg.clip_eps_high, beta=cfg.beta, loss_type=cfg.loss_type,
                max_completion_length=cfg.max_new_tokens,
                importance_sampling_level=cfg.importance_sampling_level)
            # WHY: weighting each micro-batch makes the summed gradient equal the full-batch gradient.
            (loss * w).backward()
            loss_this_update += loss.item() * w
            for k in ("kl", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region"):
                stats[k] += loss_parts[k] * share / mu
            if it == 0:
                entropy_sum += (entropy * mask[s].float()).sum().item()
        stats["loss"] += loss_this_update / mu
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm).item()
        if math.isfinite(grad_norm) and math.isfinite(loss_this_update):
            optimizer.step()
        else:
            # WHY: one non-finite gradient would poison every weight through Adam's moments; skip the
            #      update, leave weights and optimizer state untouched, and count it (skipped_updates).
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    stats["entropy"] = entropy_sum / max(1.0, mask.sum().item())
    return {**stats, "grad_norm": grad_norm, "skipped_updates": skipped}


# ----------------------------------------------------------------------------------------------
# 9. One GRPO step: Algorithm 1's inner loop, in the paper's order
# ----------------------------------------------------------------------------------------------
def rollout(policy, tokenizer, prompts: list[str], columns: dict | None,
            reward_funcs: Sequence[RewardFn], cfg: GRPOConfig) -> dict:
    """Steps 1-3 for B prompts: sample G completions each, score them, standardise within each group.
    Returns sample_completions' batch plus, per completion: prompts, columns, rewards (N,),
    advantages ((N,) outcome, (N, T) process) and reward_means (name -> mean)."""
    G = cfg.group_size
    # 1. Sample G completions per prompt from the current policy, which is π_old for this step.
    batch = sample_completions(policy, tokenizer, prompts, cfg)
    assert batch["completion_ids"].shape[0] == len(prompts) * G
    # Every per-prompt column is repeated G times, so row n of every list belongs together.
    batch["prompts"] = [p for p in prompts for _ in range(G)]
    batch["columns"] = {k: [v for v in vals for _ in range(G)] for k, vals in (columns or {}).items()}
    if cfg.supervision == "process":
        return score_steps(batch, tokenizer, reward_funcs, cfg)  # 2-3 per step: see Variants
    # 2. Score: one reward per completion.
    batch["rewards"], batch["reward_means"] = compute_rewards(
        reward_funcs, batch["prompts"], batch["completions"], batch["columns"], cfg.reward_weights)
    # 3. Advantages: one per completion, shared by all its tokens (outcome supervision, §4.1.2).
    A = group_advantages(batch["rewards"], G, cfg.scale_rewards, cfg.adv_eps)         # (N,)
    batch["advantages"] = A.to(batch["completion_ids"].device)                        # (N,)
    return batch


@torch.no_grad()
def fixed_logprobs(policy, ref_model, batch: dict, cfg: GRPOConfig):
    """Step 4's log-probs that stay fixed during the update: log π_old (only for μ > 1) and log π_ref
    (only for β != 0); each (N, T) or None."""
    def over_batch(model):
        return torch.cat([token_logprobs(model, *inputs, cfg.temperature)               # (n, T)
                          for _, inputs in micro_batches(batch, cfg.micro_batch_size)])  # (N, T)

    # NOTE: with μ = 1 this forward pass is skipped: π_old = π_θ, and policy_update uses logp.detach().
    logp_old = over_batch(policy) if cfg.num_iterations > 1 else None
    logp_ref = over_batch(ref_model) if cfg.beta != 0 else None
    return logp_old, logp_ref


def grpo_step(policy, ref_model, optimizer, tokenizer, prompts: list[str],
              reward_funcs: Sequence[RewardFn], cfg: GRPOConfig, columns: dict | None = None,
              return_samples: bool = False,
              more_prompts: Callable[[int], tuple[list[str], dict]] | None = None) -> dict:
    """One GRPO step on B prompts: sample, score, standardise, then μ clipped-ratio updates.

    columns: extra per-prompt data for the reward functions (e.g. {"answer": [...]}, B entries each).
    return_samples=True adds metrics["samples"]: per completion its prompt, text, reward, advantage.
    more_prompts(k) -> (k prompts, their columns): fresh prompts for cfg.dynamic_sampling.
    Returns the step's metrics, named as TRL names them.
    """
    t0 = time.perf_counter()
    if cfg.beta != 0 and ref_model is None:
        raise ValueError("beta != 0 needs a reference model (make_reference(policy))")
    # 1-3. Sample G completions per prompt, score them, standardise the rewards within each group.
    batch = rollout(policy, tokenizer, prompts, columns, reward_funcs, cfg)
    sampled = [batch]
    if cfg.dynamic_sampling:  # DEVIATION (opt-in, DAPO): keep only groups with signal, see Variants
        batch, sampled = dynamic_sampling(batch, len(prompts), more_prompts, policy, tokenizer,
                                          reward_funcs, cfg)
    # 4. log π_old and log π_ref of the sampled tokens, fixed while the policy moves.
    logp_old, logp_ref = fixed_logprobs(policy, ref_model, batch, cfg)                # (N, T) or None
    # 5-8. μ updates: ratio, clip, KL, aggregation, backward, gradient clip, AdamW step.
    update = policy_update(policy, optimizer, batch, logp_old, logp_ref, cfg)
    metrics = step_metrics(batch, sampled, update, cfg)
    metrics["step_time"] = time.perf_counter() - t0
    if return_samples:
        metrics["samples"] = samples_of(batch)
    return metrics


def step_metrics(batch: dict, sampled: list[dict], update: dict, cfg: GRPOConfig) -> dict:
    """The step's metrics, named as TRL names them. Rewards describe everything sampled this step
    (every dynamic-sampling round); the rest describes the batch that was trained on."""
    G = cfg.group_size
    all_rewards = torch.cat([b["rewards"] for b in sampled])                          # (all,)
    group_std = all_rewards.view(-1, G).std(dim=1)                                    # (groups,)
    counts = [len(b["prompts"]) for b in sampled]
    reward_means = {k: sum(b["reward_means"][k] * n for b, n in zip(sampled, counts)) / sum(counts)
                    for k in sampled[0]["reward_means"]}
    lengths = batch["completion_mask"].sum(1).float()                                 # (N,)
    metrics = {
        "reward": all_rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        **{f"rewards/{name}": v for name, v in reward_means.items()},
        "frac_reward_zero_std": (group_std < 1e-8).float().mean().item(),
        **{k: update[k] for k in ("loss", "kl", "clip_ratio/low", "clip_ratio/high",
                                  "clip_ratio/region", "entropy")},
        "completions/mean_length": lengths.mean().item(),
        "completions/clipped_ratio": batch["truncated"].float().mean().item(),
        "grad_norm": update["grad_norm"],
        "skipped_updates": update["skipped_updates"],
    }
    if cfg.dynamic_sampling:
        metrics["dynamic_sampling/rounds"] = len(sampled) - 1
        metrics["dynamic_sampling/groups_trained"] = len(batch["prompts"]) // G
    return metrics


def samples_of(batch: dict) -> list[dict]:
    """One dict per completion: prompt, completion, reward, advantage (to spot reward hacking).
    NOTE: under process supervision the advantage is per token; the first token's, the sum of every
          normalised step reward of the completion, is the one logged."""
    A = batch["advantages"]
    first = A if A.dim() == 1 else A[:, 0]                                            # (N,)
    return [dict(prompt=p, completion=c, reward=r, advantage=a) for p, c, r, a in
            zip(batch["prompts"], batch["completions"], batch["rewards"].tolist(), first.tolist())]


# ----------------------------------------------------------------------------------------------
# Variants: each is one call from the core above
# ----------------------------------------------------------------------------------------------
def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (arXiv 2507.18071): one length-normalised log-ratio per completion, (N, T) -> (N, T).

    DEVIATION (opt-in): s_i(θ) = exp( 1/|o_i| Σ_t log(π_θ(o_it)/π_old(o_it)) ), shared by all the
    tokens of completion i, so the clip keeps or drops a completion as a whole.
    """
    lengths = mask.sum(1, keepdim=True).clamp(min=1)                                  # (N, 1)
    return ((log_ratio * mask).sum(1, keepdim=True) / lengths).expand_as(log_ratio)   # (N, T)


def score_steps(batch: dict, tokenizer, reward_funcs: Sequence[RewardFn], cfg: GRPOConfig) -> dict:
    """Process supervision's steps 2-3 (§4.1.3): one reward per reasoning step, mapped to the token
    where the step ends, then process_advantages. The reward function returns, per completion, a list
    of (end character, reward) steps; the last step is the final answer's."""
    N, T = batch["completion_ids"].shape
    if len(reward_funcs) != 1:
        raise ValueError(f"process supervision takes one step-reward function, got {len(reward_funcs)}")
    fn = reward_funcs[0]
    steps = fn(prompts=batch["prompts"], completions=batch["completions"], **batch["columns"])
    if len(steps) != N or not all(isinstance(s, (list, tuple)) and len(s) >= 1 for s in steps):
        raise ValueError(f"process reward {reward_name(fn)!r} must return, for each of the {N} "
                         f"completions, a non-empty list of (end, reward) steps")
    lengths = batch["completion_mask"].sum(1)                                         # (N,)
    ends = rewards.step_token_index(tokenizer, batch["completion_ids"], lengths,
                                    [[e for e, _ in s] for s in steps])
    token_steps = [list(zip(e, (float(r) for _, r in s))) for e, s in zip(ends, steps)]
    batch["rewards"] = torch.tensor([float(s[-1][1]) for s in steps])                 # (N,) outcome
    batch["reward_means"] = {reward_name(fn): batch["rewards"].mean().item(), "steps_mean":
                             sum(r for s in steps for _, r in s) / sum(len(s) for s in steps)}
    A = process_advantages(token_steps, cfg.group_size, T, cfg.adv_eps)               # (N, T)
    batch["advantages"] = A.to(batch["completion_ids"].device)                        # (N, T)
    return batch


def dynamic_sampling(batch: dict, B: int, more_prompts, policy, tokenizer,
                     reward_funcs: Sequence[RewardFn], cfg: GRPOConfig):
    """DAPO's dynamic sampling (arXiv 2503.14476). Returns (the batch to train on, every rollout).

    DEVIATION (opt-in): a group whose rewards all agree has advantage 0 on every token, so it adds no
    policy gradient and only shrinks the step. Drop such groups and top the batch up with fresh prompts,
    for at most cfg.dynamic_sampling more rounds.
    """
    G, sampled = cfg.group_size, [batch]
    pad_id = pad_token_id(policy, tokenizer)

    def with_signal(b):
        return [g for g in range(len(b["prompts"]) // G)
                if b["advantages"][g * G:(g + 1) * G].abs().sum() > 0]

    kept = select_groups(batch, with_signal(batch), G)
    for _ in range(cfg.dynamic_sampling):
        missing = B - len(kept["prompts"]) // G
        if missing <= 0 or more_prompts is None:
            break
        extra = rollout(policy, tokenizer, *more_prompts(missing), reward_funcs, cfg)
        sampled.append(extra)
        kept = concat_batches(kept, select_groups(extra, with_signal(extra)[:missing], G), pad_id)
    # WHY: if every group agreed, train on the first draw as plain GRPO would (A = 0 everywhere).
    return (kept if kept["prompts"] else batch), sampled


def select_groups(batch: dict, groups: list[int], G: int) -> dict:
    """The rows of the given groups (each G consecutive rows) of a rollout batch."""
    rows = [g * G + i for g in groups for i in range(G)]
    idx = torch.tensor(rows, dtype=torch.long)                                        # (n,)
    out = {k: v[idx.to(v.device)] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out["completions"] = [batch["completions"][r] for r in rows]
    out["prompts"] = [batch["prompts"][r] for r in rows]
    out["columns"] = {k: [v[r] for r in rows] for k, v in batch["columns"].items()}
    return out


def concat_batches(a: dict, b: dict, pad_id: int) -> dict:
    """Two rollout batches as one: prompts re-padded on the left, completions on the right."""
    def pad(x, width, side, value):
        fill = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
        return torch.cat([fill, x] if side == "left" else [x, fill], dim=1)

    out = {"completions": a["completions"] + b["completions"], "prompts": a["prompts"] + b["prompts"],
           "columns": {k: a["columns"][k] + b["columns"][k] for k in a["columns"]}}
    P = max(a["prompt_ids"].shape[1], b["prompt_ids"].shape[1])
    T = max(a["completion_ids"].shape[1], b["completion_ids"].shape[1])
    for k, width, side, value in [("prompt_ids", P, "left", pad_id), ("prompt_mask", P, "left", 0),
                                  ("completion_ids", T, "right", pad_id),
                                  ("completion_mask", T, "right", 0)]:
        out[k] = torch.cat([pad(a[k], width, side, value), pad(b[k], width, side, value)])
    for k in ("rewards", "truncated"):
        out[k] = torch.cat([a[k], b[k]])
    adv = [a["advantages"], b["advantages"]]
    out["advantages"] = torch.cat(adv if adv[0].dim() == 1 else [pad(x, T, "right", 0.0) for x in adv])
    return out
