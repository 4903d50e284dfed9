"""
grpo.py -- Group Relative Policy Optimization in one file.

What this is
    The whole GRPO algorithm from DeepSeekMath (Shao et al. 2024, arXiv 2402.03300,
    §4.1 and Algorithm 1), for any Hugging Face causal LM and tokenizer, on one device.
    It is meant to be read next to the paper: each equation sits above the line
    that computes it, and a test in tests/test_grpo.py pins it with hand-worked numbers.

The objective it maximises (outcome supervision, §4.1.1-4.1.2, eq. 3)
    J(θ) = E[ 1/G Σ_i 1/|o_i| Σ_t { min( r_it(θ) A_i , clip(r_it(θ), 1-ε, 1+ε) A_i ) - β D_KL[π_θ || π_ref] } ]
      r_it(θ) = π_θ(o_it | q, o_i<t) / π_old(o_it | q, o_i<t)         (a probability RATIO, not a reward)
      A_i     = (r_i - mean(r)) / std(r)                                (r_i is the REWARD of completion i)
      D_KL    ≈ π_ref/π_θ - log(π_ref/π_θ) - 1                          (k3 estimator, eq. 4)
    We minimise loss = -J. Process supervision (§4.1.3) replaces A_i by a per-token advantage built from
    step rewards (process_advantages).

Variants since the paper, each an opt-in switch in GRPOConfig that cites its paper
    loss_type "token" (DAPO) / "dr_grpo", scale_rewards=False (Dr. GRPO), clip_eps_high (DAPO's clip-higher),
    dynamic_sampling (DAPO), importance_sampling_level="sequence" (GSPO). Each line that differs from the
    paper is tagged DEVIATION.

How to run it
    python -m pytest tests/test_grpo.py -q       # every equation, pinned
    python -m pytest tests/test_learning.py -q   # a tiny random model learns a rewarded behaviour

What it leaves out, on purpose
    - the critic (that is the point of GRPO: the group mean is the baseline);
    - multi-GPU, vLLM, DeepSpeed (see README, "Past one GPU");
    - the paper's iterative reward-model retraining and reference resets (Algorithm 1, outer loop);
    - learned reward models: process supervision here uses a rule-based step reward (rewards.py).

Tensor dimensions used in shape comments
    B  prompts per step          G  completions per prompt (group_size)
    N  = B*G sequences           P  prompt tokens (left-padded)
    T  completion tokens          V  vocabulary size

The steps below, in order
    0. GRPOConfig                  every knob, with the paper's defaults
    1. sample_completions          G completions per prompt from π_old (= π_θ before this step's update)
    2. compute_rewards             weighted rule-based reward functions, TRL signature
    3. group_advantages            A_i = (r_i - mean) / (std + eps) within each group
       process_advantages          process supervision: Â_i,t from normalised step rewards
    4. token_logprobs              log π(o_it) via gather + logsumexp, for π_θ, π_old, π_ref
    5-7. grpo_loss                 ratio + clip (5), k3 KL (6), aggregation over tokens (7)
    8. rollout, grpo_step          1-3 (plus dynamic sampling), then 4-7 and μ optimizer updates
"""

from __future__ import annotations

import bisect
import copy
import functools
import importlib.metadata
import inspect
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


# ----------------------------------------------------------------------------------------------
# 0. Configuration
# ----------------------------------------------------------------------------------------------
@dataclass
class GRPOConfig:
    """Every knob of one GRPO step. Defaults follow the paper (§4.2, "Training Setting") unless tagged."""

    group_size: int = 8
    """G, completions sampled per prompt. PAPER: 64; our default 8 fits one small GPU or a CPU."""
    beta: float = 0.04
    """β, weight of the KL penalty to the frozen reference model. PAPER: 0.04. 0 removes the reference model."""
    clip_eps: float = 0.2
    """ε, PPO clip range: the ratio is clipped to [1-ε, 1+ε_high]. PPO's usual 0.2 (the paper does not print its ε)."""
    clip_eps_high: float | None = None
    """ε_high, upper clip; None means ε_high = ε. DAPO's clip-higher (arXiv 2503.14476) uses 0.28."""
    num_iterations: int = 1
    """μ, policy updates per batch of samples (Algorithm 1). PAPER: 1 (a single update per exploration stage)."""
    loss_type: str = "grpo"
    """How per-token losses are averaged: 'grpo' (paper: 1/G Σ_i 1/|o_i| Σ_t), 'token' (DAPO), 'dr_grpo' (Dr. GRPO)."""
    scale_rewards: bool = True
    """Divide centred rewards by the group std (paper). False = mean-centring only (Dr. GRPO, arXiv 2503.20783)."""
    adv_eps: float = 1e-4
    """ε added to the group std before dividing. Our choice, same as TRL: keeps A finite when the std is tiny."""
    temperature: float = 1.0
    """Sampling temperature; the loss uses log-probs at the same temperature. Our choice: 1.0, the true policy."""
    max_new_tokens: int = 256
    """Cap on completion length T. PAPER: 1024. Completions that hit it count in completions/clipped_ratio."""
    min_new_tokens: int = 0
    """Force at least this many new tokens (0 = off). Only for benchmarks that need equal-length work."""
    lr: float = 1e-6
    """AdamW learning rate. PAPER: 1e-6 for a 7B model; tiny models want far larger (see train_gsm8k.py presets)."""
    weight_decay: float = 0.0
    """AdamW weight decay. Our choice: 0, so the only pull toward the start is the KL term."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this. Our choice, standard for LM fine-tuning (TRL default 1.0)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass. Smaller uses less memory; the gradient is the same (tested)."""
    reward_weights: list[float] | None = None
    """One weight per reward function; None means all 1.0. The total reward is the weighted sum."""
    supervision: str = "outcome"
    """'outcome' (§4.1.2: one reward per completion) or 'process' (§4.1.3: a reward per reasoning step, from one
    reward function returning (end, reward) pairs per completion, e.g. rewards.calculator_process_reward)."""
    importance_sampling_level: str = "token"
    """'token' (paper: one ratio per token) or 'sequence' (GSPO, arXiv 2507.18071: one length-normalised ratio
    per completion, clipped as a whole; GSPO pairs it with a far smaller clip_eps, e.g. 3e-4 / 4e-4)."""
    dynamic_sampling: int = 0
    """DAPO's dynamic sampling (arXiv 2503.14476): drop groups whose rewards all agree, and sample up to this many
    more rounds of fresh prompts (grpo_step's more_prompts) to top the batch up. 0: off (paper)."""

    def __post_init__(self):
        """Settings that cannot work fail here, at construction, with one line naming the field."""
        checks = [
            (self.group_size >= 2,
             f"group_size must be at least 2 (a group baseline needs 2), got {self.group_size}"),
            (self.beta >= 0, f"beta must be >= 0, got {self.beta}"),
            (self.clip_eps > 0, f"clip_eps must be > 0, got {self.clip_eps}"),
            (self.clip_eps_high is None or self.clip_eps_high > 0,
             f"clip_eps_high must be > 0, got {self.clip_eps_high}"),
            (self.num_iterations >= 1, f"num_iterations must be >= 1, got {self.num_iterations}"),
            (self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}"),
            (self.adv_eps >= 0, f"adv_eps must be >= 0, got {self.adv_eps}"),
            (self.temperature > 0, f"temperature must be > 0, got {self.temperature}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be from 0 to max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}"),
            # NOTE: no batch size has to divide another: the last micro-batch may be smaller, and
            #       micro_batch_weights keeps the summed gradient equal to the full-batch one (tested).
            (self.micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {self.micro_batch_size}"),
            (self.reward_weights is None or all(math.isfinite(w) for w in self.reward_weights),
             f"reward_weights must be finite numbers, got {self.reward_weights}"),
            (self.supervision in ("outcome", "process"),
             f"supervision must be 'outcome' or 'process', got {self.supervision!r}"),
            (self.importance_sampling_level in ("token", "sequence"),
             f"importance_sampling_level must be 'token' or 'sequence', got {self.importance_sampling_level!r}"),
            (self.dynamic_sampling >= 0, f"dynamic_sampling must be >= 0, got {self.dynamic_sampling}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


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


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """1 for every completion token up to and including the first EOS, 0 after it. Shape (N, T) -> (N, T)."""
    N, T = completion_ids.shape
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))  # (N, T)
    # WHY: a sequence with no EOS hit the length cap; all T of its tokens count.
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), T)                               # (N,)
    positions = torch.arange(T, device=completion_ids.device)                                       # (T,)
    # NOTE: the EOS itself is kept in the mask, so the model is credited (or blamed) for stopping.
    return (positions[None, :] <= first_eos[:, None]).long()                                        # (N, T)


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@functools.cache
def _transformers_major() -> int:
    return int(importlib.metadata.version("transformers").split(".")[0])  # WHY cached: a lookup takes ~2 ms


def _sdpa_full_attention(model) -> bool:
    """True when every layer runs PyTorch's SDPA kernel with full (not sliding-window) attention, under
    transformers 5, whose mask code hands a ready 4D mask to the kernel unchanged (4.x is not tested here)."""
    c = model.config
    return (_transformers_major() >= 5
            and getattr(c, "_attn_implementation", None) == "sdpa" and getattr(c, "sliding_window", None) is None
            and all(kind == "full_attention" for kind in getattr(c, "layer_types", None) or ["full_attention"]))


def _cache_kwarg(model) -> str:
    """The forward() argument that takes the KV cache: `cache` in transformers 5, `past_key_values` in 4.x."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], cfg: GRPOConfig, greedy: bool = False,
                       group_size: int | None = None) -> dict:
    """Sample G completions for each of B prompt strings. Returns a dict of tensors (rows grouped by prompt).

    greedy=True decodes the single most likely completion instead (for evaluation, with group_size=1).
    group_size overrides cfg.group_size (evaluation samples one completion per prompt).
    """
    G = cfg.group_size if group_size is None else group_size
    device = next(model.parameters()).device
    # WHY: left padding puts every prompt's last token at the same column, so generation starts together.
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    prompt_ids = enc["input_ids"].repeat_interleave(G, 0).to(device)             # (N, P)  group i = rows iG..iG+G-1
    prompt_mask = enc["attention_mask"].repeat_interleave(G, 0).to(device)       # (N, P)
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]

    N = prompt_ids.shape[0]
    eos = torch.tensor(eos_ids, device=device)                                   # (E,)

    # WHY a plain loop instead of model.generate: it does only what GRPO needs (temperature, EOS, a length
    # floor) and skips generate()'s per-token machinery (logits processors, stopping criteria, cache
    # bookkeeping). It draws the very tokens generate() draws from the same seed (tests/test_grpo.py);
    # benchmarks/vs_trl.py times the whole step against TRL, which samples with generate().
    # NOTE: no top-k / top-p: the samples must come from exactly the distribution whose log-probs the loss
    #       uses. (generate() would silently apply top_k=50 from transformers' defaults.)
    was_training = model.training
    model.eval()  # WHY: with gradient checkpointing, train mode turns the KV cache off and generation crawls.
    cache_kwarg = _cache_kwarg(model)
    # WHY (speed): inference_mode skips autograd's bookkeeping (version counters, views) on every op, which counts
    # when a small model's time is per-op overhead. Tensors made inside cannot be saved for backward, so the
    # outputs are built from them after the block, where ordinary ops return ordinary tensors.
    with torch.inference_mode():
        # Prefill: one pass over each distinct prompt. WHY (speed): the G copies of a prompt would compute the same
        # keys and values G times; compute them once and repeat the KV cache G times instead.
        unique_ids, unique_mask = prompt_ids[::G], prompt_mask[::G]                  # (B, P), (B, P)
        prefill = dict(input_ids=unique_ids, attention_mask=unique_mask, use_cache=True,
                       # WHY: number positions from each prompt's first real token, as token_logprobs does.
                       position_ids=(unique_mask.cumsum(1) - 1).clamp(min=0))      # (B, P)
        if _accepts_logits_to_keep(model):
            prefill["logits_to_keep"] = 1  # WHY (memory): only the last position's logits are needed
        out = model(**prefill)
        cache = out[cache_kwarg]
        cache.batch_repeat_interleave(G)                                             # (B, ...) -> (N, ...) in place
        logits = out.logits[:, -1, :].float().repeat_interleave(G, 0)                # (N, V)
        # WHY (speed): one mask for the whole loop, sliced each step, instead of growing it by a column per token.
        # Every generated column counts as real: a row that has finished only goes on to make pads nobody reads.
        P = prompt_mask.shape[1]
        seen = torch.cat([prompt_mask, prompt_mask.new_ones(N, cfg.max_new_tokens)], dim=1)  # (N, P+T)
        # WHY (speed): transformers rebuilds a causal mask from the 2D mask at every decode step, a pile of small
        # ops per token. For one new token under SDPA the mask is just "every real token so far", so we hand over a
        # ready 4D view and that work is skipped. Other kernels (eager, flash, sliding windows) get the 2D mask.
        sdpa = _sdpa_full_attention(model)
        if sdpa:
            seen = seen.bool()
        next_position = (prompt_mask.sum(1, keepdim=True) - 1).clamp(min=0) + 1      # (N, 1)
        done = torch.zeros(N, dtype=torch.bool, device=device)                       # (N,)
        tokens = []
        for t in range(cfg.max_new_tokens):
            if t < cfg.min_new_tokens:
                logits[:, eos] = -math.inf                                           # (N, V)  no EOS yet
            if greedy:
                next_ids = logits.argmax(-1)                                         # (N,)
            else:
                probs = torch.softmax(logits / cfg.temperature, dim=-1)              # (N, V)
                next_ids = torch.multinomial(probs, 1).squeeze(1)                    # (N,)
            next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)  # (N,)  pad after EOS
            tokens.append(next_ids)
            done |= torch.isin(next_ids, eos)
            if done.all() or t == cfg.max_new_tokens - 1:
                break
            # Decode: feed only the new token; the KV cache holds everything before it.
            mask = seen[:, :P + t + 1]                                               # (N, P+t+1)
            if sdpa:
                mask = mask[:, None, None, :]                                        # (N, 1, 1, P+t+1)
            out = model(input_ids=next_ids[:, None], attention_mask=mask,            # (N, 1)
                        position_ids=next_position + t, use_cache=True, **{cache_kwarg: cache})   # (N, 1)
            logits = out.logits[:, -1, :].float()                                    # (N, V)
    model.train(was_training)

    completion_ids = torch.stack(tokens, dim=1)                                  # (N, T)
    completion_mask = completion_mask_from_ids(completion_ids, eos_ids)          # (N, T)
    # WHY: pads after EOS may equal a real token id; zero them out of the way with the mask, not by id.
    texts = tokenizer.batch_decode(completion_ids * completion_mask + pad_id * (1 - completion_mask),
                                   skip_special_tokens=True)
    # A completion with no EOS at all stopped because it hit max_new_tokens.
    truncated = ~torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)  # (N,) bool
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, completions=texts, truncated=truncated)


# ----------------------------------------------------------------------------------------------
# 2. Score each completion with rule-based reward functions
# ----------------------------------------------------------------------------------------------
RewardFn = Callable[..., list]


def reward_name(fn) -> str:
    """The name a reward function is logged under: rewards/<name>."""
    return getattr(fn, "__name__", type(fn).__name__)


def compute_rewards(reward_funcs: Sequence[RewardFn], prompts: list[str], completions: list[str],
                    columns: dict | None = None, weights: Sequence[float] | None = None):
    """r_i = Σ_k w_k f_k(prompt_i, completion_i). Each f has TRL's signature f(prompts, completions, **columns).

    `prompts`, `completions` and each column hold N entries (already repeated G times per prompt).
    Returns (rewards (N,) float32, {name: mean of that function's raw reward}).
    """
    N = len(completions)
    weights = [1.0] * len(reward_funcs) if weights is None else list(weights)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(reward_funcs)} reward functions")
    per_fn = torch.zeros(len(reward_funcs), N)                                   # (K, N)
    for k, fn in enumerate(reward_funcs):
        values = fn(prompts=prompts, completions=completions, **(columns or {}))
        if values is None or len(values) != N:
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"reward function {reward_name(fn)!r} returned {got} for {N} completions")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"reward function {reward_name(fn)!r} returned {v!r}; expected a number")
        per_fn[k] = torch.tensor(values, dtype=torch.float32)
    rewards = (torch.tensor(weights, dtype=torch.float32)[:, None] * per_fn).sum(0)   # (N,)
    return rewards, {reward_name(fn): per_fn[k].mean().item() for k, fn in enumerate(reward_funcs)}


# ----------------------------------------------------------------------------------------------
# 3. Group-relative advantages: the group mean replaces PPO's learned critic
# ----------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """Standardise each reward within its group of G. rewards: (N,), each group's G entries contiguous -> (N,)."""
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 to have a group baseline, got {group_size}")
    grouped = rewards.view(-1, group_size).float()                               # (B, G)
    mean = grouped.mean(dim=1, keepdim=True)                                     # (B, 1)
    # PAPER: Â_i,t = r̃_i = (r_i - mean(r)) / std(r)                              (§4.1.2, outcome supervision)
    centred = grouped - mean                                                     # (B, G)
    if not scale_rewards:
        # DEVIATION (opt-in, Dr. GRPO): dividing by std up-weights groups whose rewards barely differ (nearly
        # all right or all wrong). Mean-centring alone keeps every group's advantages on the reward's scale.
        return centred.view(-1)                                                  # (N,)
    # NOTE: std is the SAMPLE std (Bessel, divide by G-1), as torch.std and TRL use; the paper does not say.
    # NOTE: eps goes OUTSIDE the sqrt, added to std. A group whose rewards are all equal has centred == 0
    #       exactly, so its advantage is 0/(0+eps) = 0, never NaN: such a group carries no learning signal.
    std = grouped.std(dim=1, keepdim=True)                                       # (B, 1)
    return (centred / (std + eps)).view(-1)                                      # (N,)


def process_advantages(step_rewards: list[list[tuple[int, float]]], group_size: int, num_tokens: int,
                       eps: float = 1e-4) -> torch.Tensor:
    """Process supervision (§4.1.3). step_rewards[n] lists completion n's steps as (end token index, reward).
    Returns per-token advantages (N, T): each token gets the sum of the normalised rewards of the steps that
    end at or after it.
    """
    N = len(step_rewards)
    if N % group_size:
        raise ValueError(f"{N} completions do not split into groups of {group_size}")
    advantages = torch.zeros(N, num_tokens)                                       # (N, T)
    for g in range(0, N, group_size):
        group = step_rewards[g:g + group_size]
        R = torch.tensor([r for steps in group for _, r in steps], dtype=torch.float32)   # (K,) all step rewards
        # PAPER: r̃_i^index(j) = (r_i^index(j) - mean(R)) / std(R), R = every step reward in the group
        # NOTE: as in outcome supervision: the sample std, with eps added to it (a group of equal step
        #       rewards gives 0 everywhere). One step in the whole group has no spread: advantages 0.
        std = R.std() if R.numel() > 1 else torch.tensor(0.0)
        normalised = (R - R.mean()) / (std + eps) if R.numel() > 1 else torch.zeros_like(R)   # (K,)
        k = 0
        for i, steps in enumerate(group):
            for end, _ in steps:
                advantages[g + i, min(max(end, 0), num_tokens - 1)] += normalised[k]
                k += 1
    # PAPER: Â_i,t = Σ_{index(j) >= t} r̃_i^index(j)   (a reverse cumulative sum over token positions)
    return advantages.flip(1).cumsum(1).flip(1)                                  # (N, T)


def step_token_index(tokenizer, completion_ids: torch.Tensor, lengths: torch.Tensor,
                     step_ends: list[list[int]]) -> list[list[int]]:
    """Map each step's end, a character index into the decoded completion, to the token that holds its last
    character. A step ending at the text's end maps to the completion's last token (its EOS, if it has one),
    so the final-answer step credits stopping too. completion_ids (N, T), lengths (N,)."""
    out = []
    for ids, n, ends in zip(completion_ids.tolist(), lengths.tolist(), step_ends):
        # WHY decode prefixes, not single tokens: a SentencePiece token decoded alone loses its leading space, and
        #     a byte-level token holding part of a character decodes to "�". A prefix decodes as the whole text does.
        def chars_through(k, ids=ids):  # length of the text that tokens 0..k decode to
            return len(tokenizer.decode(ids[:k + 1], skip_special_tokens=True))
        text_len = chars_through(n - 1) if n else 0
        # The first token whose prefix holds character e-1 (the step's last); a binary search, log2(n) decodes.
        out.append([n - 1 if e >= text_len else bisect.bisect_left(range(n), e, key=chars_through) for e in ends])
    return out


# ----------------------------------------------------------------------------------------------
# 4. Per-token log-probabilities of the completion tokens
# ----------------------------------------------------------------------------------------------


def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                   temperature: float = 1.0, with_entropy: bool = False):
    """log π(o_t | q, o_<t) for each completion token. Inputs (n, P) and (n, T) -> logp (n, T) [, entropy (n, T)].

    Runs with gradients if the caller has them enabled; wrap in torch.no_grad() for π_old and π_ref.
    """
    T = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)                   # (n, P+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)            # (n, P+T)
    # WHY: generate() numbers positions from the first real token of a left-padded prompt; do the same,
    #      or models with absolute position embeddings would score a different sequence than was sampled.
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)                   # (n, P+T)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = T + 1  # WHY (memory): skip the prompt's (n, P, V) logits entirely.
    logits = model(**kwargs).logits[:, -(T + 1):-1, :]                           # (n, T, V)  position t predicts o_t
    logits = logits.float() / temperature                                        # (n, T, V)
    # NOTE: log softmax(l)[o] = l[o] - logsumexp(l)
    # WHY (memory): gather + logsumexp never keeps a second (n, T, V) log_softmax tensor alive.
    chosen = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)         # (n, T)
    lse = torch.logsumexp(logits, dim=-1)                                        # (n, T)
    logp = chosen - lse                                                          # (n, T)
    if not with_entropy:
        return logp
    with torch.no_grad():
        # NOTE: H = -Σ_v p_v log p_v = logsumexp(l) - Σ_v p_v l_v     (logged as `entropy`; no gradient)
        # WHY (memory): one sequence at a time, so the softmax is a (T, V) temporary instead of (n, T, V). With
        #      Qwen's 151,936-token vocabulary, 16 completions of 512 tokens would need 5 GB for it in fp32.
        entropy = torch.stack([row_lse - (torch.softmax(row, dim=-1) * row).sum(-1)         # (T,) per row
                               for row, row_lse in zip(logits, lse)])                       # (n, T)
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# 5-7. The GRPO loss: clipped ratio (5), k3 KL (6), aggregation (7)
# ----------------------------------------------------------------------------------------------
LOSS_TYPES = ("grpo", "token", "dr_grpo")


def grpo_loss(logp, logp_old, logp_ref, advantages, completion_mask, *, clip_eps=0.2, clip_eps_high=None,
              beta=0.04, loss_type="grpo", max_completion_length=None, importance_sampling_level="token"):
    """loss = -J(θ) for one batch. logp, logp_old, logp_ref, completion_mask: (N, T); advantages: (N,) for
    outcome supervision (one per completion) or (N, T) for process supervision (one per token).

    Returns (scalar loss tensor, stats dict of floats: kl, clip_ratio/low, clip_ratio/high, clip_ratio/region).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta != 0 and logp_ref is None:
        raise ValueError("logp_ref is required when beta != 0")
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = completion_mask.to(logp.dtype)                                        # (N, T)
    A = advantages.to(logp.dtype)                                                # (N,) or (N, T)
    A = A[:, None] if A.dim() == 1 else A                                        # (N, 1) or (N, T)
    lengths = mask.sum(1).clamp(min=1)                                           # (N,)

    # 5. PAPER: r_it(θ) = π_θ(o_it|q,o_i<t) / π_old(o_it|q,o_i<t), computed as exp of a log difference
    # NOTE: with μ = 1, logp_old is logp.detach(): the ratio is exactly 1 in value, yet its gradient is
    #       ∇ratio = ratio·∇logp = ∇logp. So the printed policy loss is ~0 (advantages are zero-mean in each
    #       group) while the gradient is the REINFORCE-with-group-baseline gradient. Nothing is broken.
    log_ratio = logp - logp_old                                                  # (N, T)
    if importance_sampling_level == "sequence":
        # DEVIATION (opt-in, GSPO arXiv 2507.18071): s_i(θ) = exp( 1/|o_i| Σ_t log(π_θ(o_it)/π_old(o_it)) ),
        # one ratio per completion, shared by its tokens, so the clip keeps or drops a completion as a whole.
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / lengths[:, None]).expand_as(logp)   # (N, T)
    ratio = torch.exp(log_ratio)                                                 # (N, T)
    # PAPER: min( r·A , clip(r, 1-ε, 1+ε)·A )                                  (eq. 3; ε_high from DAPO)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)                # (N, T)
    surrogate = torch.min(ratio * A, clipped * A)                                # (N, T)

    # 6. PAPER: D_KL[π_θ||π_ref] = π_ref/π_θ - log(π_ref/π_θ) - 1               (eq. 4, Schulman's k3)
    # NOTE: k3 is an unbiased, always ≥ 0 estimate of the REVERSE KL(π_θ || π_ref) from tokens sampled
    #       from π_θ (here: from π_old, equal to π_θ when μ = 1). It is added to the loss, not to the reward.
    if beta != 0:
        log_ref_ratio = logp_ref - logp                                          # (N, T)  log(π_ref/π_θ)
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1                        # (N, T)
        per_token = -(surrogate - beta * kl)                                     # (N, T)
    else:
        kl = torch.zeros_like(logp)                                              # (N, T)
        per_token = -surrogate                                                   # (N, T)

    # 7. Aggregate the per-token losses.
    # NOTE: per-sequence vs per-token averaging. 'grpo' gives every completion equal weight, so each token
    #       of a long completion weighs less than a token of a short one (a length bias, see Dr. GRPO).
    #       'token' gives every token equal weight across the batch. They differ whenever lengths differ.
    if loss_type == "grpo":
        # PAPER: 1/G Σ_i 1/|o_i| Σ_t                                            (eq. 3)
        loss = ((per_token * mask).sum(1) / lengths).mean()
    elif loss_type == "token":
        # DEVIATION (opt-in, DAPO arXiv 2503.14476): Σ_i Σ_t / Σ_i |o_i|
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    else:
        # DEVIATION (opt-in, Dr. GRPO arXiv 2503.20783): Σ_i Σ_t / (N · L_max), a constant with no length bias
        L = max_completion_length if max_completion_length is not None else mask.shape[1]
        loss = (per_token * mask).sum() / (mask.shape[0] * L)

    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1)
        low = ((ratio < 1 - clip_eps) & (A < 0)).to(mask.dtype)                 # (N, T) clipping binds below
        high = ((ratio > 1 + clip_eps_high) & (A > 0)).to(mask.dtype)           # (N, T) clipping binds above
        stats = {
            "kl": ((kl * mask).sum() / n_tok).item(),
            "clip_ratio/low": ((low * mask).sum() / n_tok).item(),
            "clip_ratio/high": ((high * mask).sum() / n_tok).item(),
            "clip_ratio/region": (((low + high) * mask).sum() / n_tok).item(),
        }
    return loss, stats


# ----------------------------------------------------------------------------------------------
# 8. One GRPO step
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
    use 0; GPT-2 uses 0.1.) We disable it rather than call .eval(), because gradient checkpointing in
    transformers only runs in train mode.
    """
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


def make_optimizer(policy, cfg: GRPOConfig):
    """AdamW over the trainable parameters. PAPER: AdamW (DeepSeekMath §4.2 uses lr 1e-6)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    # WHY (GPU memory, speed): on a GPU, AdamW's default foreach path makes temporaries the size of the model at
    #      every step; the fused kernel updates each tensor in one pass without them (TRL uses it too). On the CPU
    #      the default is a plain loop with no such temporaries, and the optimizer is ~2% of a tiny-world step.
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def micro_batch_weights(completion_mask: torch.Tensor, slices: list[slice], loss_type: str) -> list[float]:
    """Weight of each micro-batch's mean loss so that the weighted sum equals the full-batch loss.

    'grpo' and 'dr_grpo' average over sequences, so a micro-batch weighs n_mb / N;
    'token' averages over tokens, so it weighs tokens_mb / tokens_total.
    """
    if loss_type == "token":
        total = completion_mask.sum().clamp(min=1).item()
        return [completion_mask[s].sum().item() / total for s in slices]
    N = completion_mask.shape[0]
    return [(s.stop - s.start) / N for s in slices]


def rollout(policy, tokenizer, prompts: list[str], columns: dict | None, reward_funcs: Sequence[RewardFn],
            cfg: GRPOConfig) -> dict:
    """Steps 1-3 for B prompts: sample G completions each, score them, and standardise within each group.
    Returns sample_completions' batch plus, per completion: prompts, columns, rewards (N,), advantages ((N,)
    for outcome supervision, (N, T) for process supervision) and reward_means (name -> mean)."""
    G = cfg.group_size
    # 1. Sample G completions per prompt from the current policy, which is π_old for this step.
    batch = sample_completions(policy, tokenizer, prompts, cfg)
    N, T = batch["completion_ids"].shape
    assert N == len(prompts) * G and batch["prompt_ids"].shape[0] == N

    # 2. Score. Every per-prompt column is repeated G times so row n of every list belongs together.
    batch["prompts"] = [p for p in prompts for _ in range(G)]
    batch["columns"] = {k: [v for v in vals for _ in range(G)] for k, vals in (columns or {}).items()}
    device = batch["completion_ids"].device
    if cfg.supervision == "outcome":
        batch["rewards"], batch["reward_means"] = compute_rewards(
            reward_funcs, batch["prompts"], batch["completions"], batch["columns"], cfg.reward_weights)  # (N,)
        # 3. Advantages, one per sequence, shared by all its tokens (outcome supervision, §4.1.2).
        batch["advantages"] = group_advantages(batch["rewards"], G, cfg.scale_rewards, cfg.adv_eps).to(device)
        return batch
    if len(reward_funcs) != 1:
        raise ValueError(f"process supervision takes one step-reward function, got {len(reward_funcs)}")
    steps = reward_funcs[0](prompts=batch["prompts"], completions=batch["completions"], **batch["columns"])
    if len(steps) != N or not all(isinstance(s, (list, tuple)) and len(s) >= 1 for s in steps):
        raise ValueError(f"process reward {reward_name(reward_funcs[0])!r} must return, for each of the {N} "
                         f"completions, a non-empty list of (end, reward) steps")
    lengths = batch["completion_mask"].sum(1)                                    # (N,)
    ends = step_token_index(tokenizer, batch["completion_ids"], lengths, [[e for e, _ in s] for s in steps])
    token_steps = [list(zip(e, (float(r) for _, r in s))) for e, s in zip(ends, steps)]
    batch["rewards"] = torch.tensor([float(s[-1][1]) for s in steps])           # (N,) the last step: the outcome
    batch["reward_means"] = {reward_name(reward_funcs[0]): batch["rewards"].mean().item(),
                             "steps_mean": sum(r for s in steps for _, r in s) / sum(len(s) for s in steps)}
    # 3. Advantages, one per token (process supervision, §4.1.3).
    batch["advantages"] = process_advantages(token_steps, G, T, cfg.adv_eps).to(device)      # (N, T)
    return batch


def _select_groups(batch: dict, groups: list[int], G: int) -> dict:
    """The rows of the given groups (each G consecutive rows) of a rollout batch."""
    rows = [g * G + i for g in groups for i in range(G)]
    idx = torch.tensor(rows, dtype=torch.long)
    out = {k: v[idx.to(v.device)] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out["completions"] = [batch["completions"][r] for r in rows]
    out["prompts"] = [batch["prompts"][r] for r in rows]
    out["columns"] = {k: [v[r] for r in rows] for k, v in batch["columns"].items()}
    return out


def _concat(a: dict, b: dict, pad_id: int) -> dict:
    """Two rollout batches as one: prompts re-padded on the left, completions on the right."""
    def pad(x, width, side, value):
        fill = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
        return torch.cat([fill, x] if side == "left" else [x, fill], dim=1)

    out = {"completions": a["completions"] + b["completions"], "prompts": a["prompts"] + b["prompts"],
           "columns": {k: a["columns"][k] + b["columns"][k] for k in a["columns"]}}
    P = max(a["prompt_ids"].shape[1], b["prompt_ids"].shape[1])
    T = max(a["completion_ids"].shape[1], b["completion_ids"].shape[1])
    for k, width, side, value in [("prompt_ids", P, "left", pad_id), ("prompt_mask", P, "left", 0),
                                  ("completion_ids", T, "right", pad_id), ("completion_mask", T, "right", 0)]:
        out[k] = torch.cat([pad(a[k], width, side, value), pad(b[k], width, side, value)])
    for k in ("rewards", "truncated"):
        out[k] = torch.cat([a[k], b[k]])
    adv = [a["advantages"], b["advantages"]]
    out["advantages"] = torch.cat(adv if adv[0].dim() == 1 else [pad(x, T, "right", 0.0) for x in adv])
    return out


def grpo_step(policy, ref_model, optimizer, tokenizer, prompts: list[str], reward_funcs: Sequence[RewardFn],
              cfg: GRPOConfig, columns: dict | None = None, return_samples: bool = False,
              more_prompts: Callable[[int], tuple[list[str], dict]] | None = None) -> dict:
    """One GRPO step on B prompts: sample, score, standardise, then μ clipped-ratio updates. Returns metrics.

    `columns` holds extra per-prompt data for the reward functions (e.g. {"answer": [...]}, B entries each).
    return_samples=True adds metrics["samples"]: one dict per completion (prompt, completion, reward, advantage).
    more_prompts(k) -> (k prompts, their columns): fresh prompts for dynamic sampling (cfg.dynamic_sampling).
    """
    t0 = time.perf_counter()
    G, mu, B = cfg.group_size, cfg.num_iterations, len(prompts)
    if cfg.beta != 0 and ref_model is None:
        raise ValueError("beta != 0 needs a reference model (make_reference(policy))")

    # 1-3. Sample, score, standardise.
    batch = rollout(policy, tokenizer, prompts, columns, reward_funcs, cfg)
    sampled = [batch]  # every rollout of this step, for the metrics
    if cfg.dynamic_sampling:
        # DEVIATION (opt-in, DAPO's dynamic sampling): a group whose rewards all agree has advantage 0 on every
        # token, so it adds no policy gradient and only shrinks the step. Drop such groups and top the batch up
        # with fresh prompts, for at most cfg.dynamic_sampling more rounds.
        def with_signal(b):
            return [g for g in range(len(b["prompts"]) // G) if b["advantages"][g * G:(g + 1) * G].abs().sum() > 0]

        kept = _select_groups(batch, with_signal(batch), G)
        for _ in range(cfg.dynamic_sampling):
            missing = B - len(kept["prompts"]) // G
            if missing <= 0 or more_prompts is None:
                break
            extra = rollout(policy, tokenizer, *more_prompts(missing), reward_funcs, cfg)
            sampled.append(extra)
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            kept = _concat(kept, _select_groups(extra, with_signal(extra)[:missing], G), pad_id)
        if kept["prompts"]:  # WHY: if every group agreed, train on the first draw as plain GRPO would (A = 0)
            batch = kept
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]    # (N, T), (N, T)
    advantages, rewards = batch["advantages"], batch["rewards"]                            # (N,) or (N, T), (N,)
    N, T = completion_ids.shape

    # 4. Log-probs that do not change during the update: π_old (only needed when μ > 1) and π_ref.
    slices = [slice(i, min(i + cfg.micro_batch_size, N)) for i in range(0, N, cfg.micro_batch_size)]
    args = lambda s: (batch["prompt_ids"][s], batch["prompt_mask"][s], completion_ids[s], completion_mask[s])
    with torch.no_grad():
        # NOTE: with μ = 1 we skip this forward pass: π_old = π_θ, so logp_old = logp.detach() below.
        logp_old = (torch.cat([token_logprobs(policy, *args(s), cfg.temperature) for s in slices])
                    if mu > 1 else None)                                                          # (N, T)
        logp_ref = (torch.cat([token_logprobs(ref_model, *args(s), cfg.temperature) for s in slices])
                    if cfg.beta != 0 else None)                                                   # (N, T)

    # 5-8. μ updates on this same batch (Algorithm 1, inner loop), each one optimizer step.
    weights = micro_batch_weights(completion_mask, slices, cfg.loss_type)
    tok_share = [completion_mask[s].sum().item() / max(1, completion_mask.sum().item()) for s in slices]
    sums = {"loss": 0.0, "kl": 0.0, "clip_ratio/low": 0.0, "clip_ratio/high": 0.0, "clip_ratio/region": 0.0}
    entropy_sum, grad_norm, skipped = 0.0, 0.0, 0
    for it in range(mu):
        optimizer.zero_grad(set_to_none=True)
        loss_this_update = 0.0
        for s, w, share in zip(slices, weights, tok_share):
            logp, entropy = token_logprobs(policy, *args(s), cfg.temperature, with_entropy=True)   # (n, T), (n, T)
            old = logp.detach() if logp_old is None else logp_old[s]                               # (n, T)
            ref = None if logp_ref is None else logp_ref[s]                                        # (n, T)
            loss, stats = grpo_loss(logp, old, ref, advantages[s], completion_mask[s],
                                    clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, beta=cfg.beta,
                                    loss_type=cfg.loss_type, max_completion_length=cfg.max_new_tokens,
                                    importance_sampling_level=cfg.importance_sampling_level)
            # WHY: weighting each micro-batch makes the summed gradient equal the full-batch gradient.
            (loss * w).backward()
            loss_this_update += loss.item() * w
            for k in ("kl", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region"):
                sums[k] += stats[k] * share / mu
            if it == 0:
                m = completion_mask[s].float()
                entropy_sum += (entropy * m).sum().item()
        sums["loss"] += loss_this_update / mu
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm).item()
        if math.isfinite(grad_norm) and math.isfinite(loss_this_update):
            optimizer.step()
        else:
            # WHY: one non-finite gradient would poison every weight through Adam's moments; skip the update,
            #      leave the weights and the optimizer state untouched, and count it (metric skipped_updates).
            skipped += 1
        optimizer.zero_grad(set_to_none=True)

    # Metrics, named as TRL names them where TRL has a name. Rewards describe everything sampled this step.
    all_rewards = torch.cat([b["rewards"] for b in sampled])                                      # (all,)
    group_std = all_rewards.view(-1, G).std(dim=1)                                                # (groups,)
    counts = [len(b["prompts"]) for b in sampled]
    reward_means = {k: sum(b["reward_means"][k] * n for b, n in zip(sampled, counts)) / sum(counts)
                    for k in sampled[0]["reward_means"]}
    lengths = completion_mask.sum(1).float()                                                      # (N,)
    metrics = {
        "reward": all_rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        **{f"rewards/{name}": v for name, v in reward_means.items()},
        "frac_reward_zero_std": (group_std < 1e-8).float().mean().item(),
        **sums,
        "entropy": entropy_sum / max(1.0, completion_mask.sum().item()),
        "completions/mean_length": lengths.mean().item(),
        "completions/clipped_ratio": batch["truncated"].float().mean().item(),
        "grad_norm": grad_norm,
        "skipped_updates": skipped,
        "step_time": time.perf_counter() - t0,
    }
    if cfg.dynamic_sampling:
        metrics["dynamic_sampling/rounds"] = len(sampled) - 1
        metrics["dynamic_sampling/groups_trained"] = N // G
    if return_samples:
        # NOTE: under process supervision a completion's advantage is per token; its first token's is the sum
        #       of all its normalised step rewards, and that is what is logged.
        first = advantages if advantages.dim() == 1 else advantages[:, 0]                     # (N,)
        metrics["samples"] = [dict(prompt=p, completion=c, reward=r, advantage=a) for p, c, r, a in
                              zip(batch["prompts"], batch["completions"], rewards.tolist(), first.tolist())]
    return metrics
