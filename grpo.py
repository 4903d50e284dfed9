"""
grpo.py -- Group Relative Policy Optimization in one file.

What this is
    The whole GRPO algorithm from DeepSeekMath (Shao et al. 2024, arXiv 2402.03300, §4.1 and
    Algorithm 1), for any Hugging Face causal LM and tokenizer, on one device. Read it next to
    the paper: each equation sits above the line that computes it, and tests/test_grpo.py pins it
    with hand-worked numbers. grpo_step, near the end, is Algorithm 1's inner loop as a short list
    of calls in the paper's order. It needs only Python and torch: copy this file alone into your
    project and it runs (tests/test_grpo_alone.py does exactly that).

The objective it maximises (outcome supervision, §4.1.1-4.1.2, eq. 3)
    J(θ) = E[ 1/G Σ_i 1/|o_i| Σ_t { min( r_it A_i , clip(r_it, 1-ε, 1+ε) A_i )
                                     - β D_KL[π_θ || π_ref] } ]
      r_it(θ) = π_θ(o_it | q, o_i<t) / π_old(o_it | q, o_i<t)   (a probability RATIO)
      A_i     = (r_i - mean(r)) / std(r)                          (r_i is completion i's REWARD)
      D_KL    ≈ π_ref/π_θ - log(π_ref/π_θ) - 1                    (k3 estimator, eq. 4)
    We minimise loss = -J. Process supervision (§4.1.3) replaces A_i by a per-token advantage
    built from step rewards (process_advantages).

How to run it
    python train_gsm8k.py --plain                 # exactly this file's code, the tiny world, a CPU
    python -m pytest tests/test_grpo.py -q        # every equation, pinned

What runs is what you read
    With Seams() (the default) grpo_step runs only the code below. Speed and memory machinery
    (a faster sampler, each prompt scored once, log-probs in chunks, AdamW inside backward) is
    handed in from outside through the three seams of Seams, the way nanoGPT's train.py makes its
    plain model.py fast with one line, torch.compile(model); each is tested to give this file's
    numbers. The methods GRPO is compared with (PPO, RLOO, REINFORCE, CISPO) live in compare/,
    built from this file's public functions: nothing here knows them.

What it leaves out, on purpose
    - the critic (that is the point of GRPO: the group mean is the baseline);
    - multi-GPU, vLLM, DeepSpeed (see docs/past_one_gpu.md);
    - the paper's iterative reward-model retraining and reference resets (Algorithm 1's outer loop);
    - learned reward models: process supervision uses a rule-based step reward (rewards.py).

Tensor dimensions used in shape comments
    B  prompts per step          G  completions per prompt (group_size)
    N  = B*G sequences           P  prompt tokens (left-padded)
    T  completion tokens         V  vocabulary size

Algorithm 1 of the paper (Iterative GRPO), line by line, and the step below that does each line
    policy π_θ ← π_init                          the model you pass in
    for iteration = 1..I:                        NOT HERE: this outer loop exists to retrain the
        π_ref ← π_θ                              reward model; one π_ref (Setup: make_reference)
        for step = 1..M:                         the caller's loop (train_gsm8k.py); one pass of
                                                 its body is 9. grpo_step
            sample a batch of questions D_b       the caller's prompts
            π_old ← π_θ                           implicit: π_old is π_θ before this step's update
            sample G outputs o_i ~ π_old(·|q)     1. sample_completions
            rewards r_i from the reward model     2. compute_rewards (rules, not a learned model)
            Â_i,t by group relative estimation    3. group_advantages (outcome, §4.1.2);
                                                     process_advantages (process, §4.1.3)
            for GRPO iteration = 1..μ:            8. policy_update, one AdamW step each:
                update π_θ by maximising J_GRPO      4. token_logprobs scores π_θ, 5-7. grpo_loss
                                                     (ratio and clip, k3 KL, averaging)
        (retrain the reward model from a replay buffer)  NOT HERE: the rewards are rules
    Before the loop: 0. GRPOConfig and Seams; Setup: make_reference, disable_dropout,
    make_optimizer. After the core: Variants (dynamic sampling from DAPO, GSPO's sequence ratio,
    truncated importance sampling, process supervision's plumbing), each one call from the core.

Comment tags, so you can grep for them
    PAPER:      what the paper says (an equation, a setting), above the line that computes it
    WHY:        our reasoning, where the paper leaves a choice open
    DEVIATION:  where we differ from the paper, and why; every variant is opt-in and off by default
    NOTE:       a known confusion, answered once, at the line where it bites. Where to find
                the common ones: the loss prints ~0 at μ = 1 while the gradient is not
                (grpo_loss); logp_old is logp.detach() at μ = 1 (micro_batch_loss); per-sequence
                vs per-token averaging (aggregate); which KL estimator, in which direction
                (k3_kl); which std, where ε goes, a group of equal rewards (group_advantages)
Variants since the paper are opt-in switches in GRPOConfig that cite their paper; each line that
differs from the paper is tagged DEVIATION.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, get_args, get_origin, get_type_hints

import torch

LossType = Literal["grpo", "token", "dr_grpo"]
LOSS_TYPES = get_args(LossType)


# ----------------------------------------------------------------------------------------------
# 0. Configuration, and the seams through which code from outside may take over a part
# ----------------------------------------------------------------------------------------------
# PAPER: §4.2 trains DeepSeekMath-Instruct 7B with lr 1e-6, β = 0.04, G = 64 outputs per question,
#        a maximum length of 1024 tokens, a batch of 1024, and one policy update per exploration
#        stage (μ = 1). Where a default here differs, its docstring says why.
@dataclass
class GRPOConfig:
    """Every knob of one GRPO step. Defaults follow the paper (§4.2) unless tagged."""

    group_size: int = 8
    """G, completions sampled per prompt. PAPER: 64; our default 8 fits one small GPU or a CPU."""
    beta: float = 0.04
    """β, weight of the KL penalty to the frozen reference. PAPER: 0.04. 0: no reference model."""
    clip_eps: float = 0.2
    """ε, PPO clip range: the ratio is clipped to [1-ε, 1+ε_high]. PPO's 0.2 (the paper gives
    none)."""
    clip_eps_high: float | None = None
    """ε_high, the upper clip; None means ε_high = ε. DAPO's clip-higher (arXiv 2503.14476) uses
    0.28."""
    num_iterations: int = 1
    """μ, policy updates per batch of samples (Algorithm 1). PAPER: 1."""
    loss_type: LossType = "grpo"
    """Averaging of per-token losses: 'grpo' (paper), 'token' (DAPO), 'dr_grpo' (Dr. GRPO)."""
    scale_rewards: bool = True
    """Divide centred rewards by the group std (paper). False: mean-centring only (Dr. GRPO)."""
    adv_eps: float = 1e-4
    """ε added to the group std before dividing. Our choice, as TRL's: A stays finite."""
    temperature: float = 1.0
    """Sampling temperature; the loss scores log-probs at the same one. 1.0: the true policy.
    draw_tokens and token_logprobs both divide the logits by it."""
    max_new_tokens: int = 256
    """Cap on completion length T. PAPER: 1024. Hitting it counts in completions/clipped_ratio;
    a cap that cuts answers off before their last line zeroes their reward."""
    lr: float = 1e-6
    """AdamW learning rate. PAPER: 1e-6 for a 7B model; tiny models want far more (see presets)."""
    weight_decay: float = 0.0
    """AdamW weight decay. Our choice: 0, so the only pull toward the start is the KL term."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this. Our choice, standard for LM fine-tuning (TRL: 1.0)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass. Smaller uses less memory; the gradient is the same
    (test_micro_batches_give_the_same_update)."""
    reward_weights: list[float] | None = None
    """One weight per reward function; None means all 1.0. The total reward is the weighted sum;
    a weight of 0 logs a function (rewards/<name>) without optimising it."""
    supervision: Literal["outcome", "process"] = "outcome"
    """'outcome' (§4.1.2: a reward per completion) or 'process' (§4.1.3: a reward per step, from
    one function that returns (end, reward) pairs per completion, such as
    rewards.calculator_process_reward)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """'token' (paper: a ratio per token) or 'sequence' (GSPO, arXiv 2507.18071: one length-
    normalised ratio per completion, clipped as a whole; GSPO pairs it with a tiny clip_eps)."""
    dynamic_sampling: int = 0
    """DAPO's dynamic sampling: drop groups whose rewards all agree and refill the batch from up to
    this many more rounds of fresh prompts (grpo_step's more_prompts). 0: off (paper)."""
    sampler_is_cap: float = 0.0
    """Truncated importance sampling (TIS; TRL's vllm_importance_sampling_correction): weight each
    token's surrogate by min(π_old/π_sampler, this cap), detached, for samplers that score tokens
    a little differently from the trainer (bf16, another engine). 0: off (paper). See Variants."""

    def __post_init__(self):
        """Settings that cannot work fail here, at construction, with one line naming the field."""
        # NOTE: each Literal field (loss_type, supervision, ...) takes only its values.
        for name, hint in get_type_hints(GRPOConfig).items():
            if get_origin(hint) is Literal:
                allowed = get_args(hint)
                self.require(name, getattr(self, name) in allowed, f"one of {allowed}")
        self.require("group_size", self.group_size >= 2, "at least 2 (a group baseline needs 2)")
        # NOTE: no batch size has to divide another: the last micro-batch may be smaller, and
        #       policy_update weights it so the summed gradient equals the full batch's (tested).
        for name, low in [("num_iterations", 1), ("max_new_tokens", 1), ("micro_batch_size", 1),
                          ("beta", 0), ("adv_eps", 0), ("weight_decay", 0),
                          ("dynamic_sampling", 0), ("sampler_is_cap", 0)]:
            self.require(name, getattr(self, name) >= low, f">= {low}")
        for name in ("clip_eps", "clip_eps_high", "temperature", "lr", "max_grad_norm"):
            value = getattr(self, name)
            self.require(name, value is None or value > 0, "> 0")
        weights = self.reward_weights
        self.require("reward_weights", weights is None or all(map(math.isfinite, weights)),
                     "finite numbers")

    def require(self, name: str, holds: bool, rule: str):
        """Raise ValueError naming the field, its rule and its value, unless the rule holds."""
        if not holds:
            raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")


# WHY: nanoGPT's model.py is plain PyTorch, and train.py makes it fast from outside. Here the
#      outside hands grpo_step a Seams: each field None runs this file's own code; a function (or,
#      for update, an object) put there runs instead, taking the same arguments and returning the
#      same kind of result. Three seams, no branch per trick, and each only for speed or memory
#      (machinery/engine.py, machinery/memory.py): tested to give this file's numbers.
@dataclass
class Seams:
    """The parts of a step that code outside grpo.py may replace. None: this file's own."""

    sample: Callable | None = None
    """The decode loop: (model, prompt_ids, prompt_mask (B, P), G, max_new_tokens, pick) ->
    (completion ids (N, T), the sampler's log-prob of each (N, T)). None: decode."""
    score: Callable | None = None
    """token_logprobs' arguments and results: (model, prompt_ids, prompt_mask, completion_ids,
    completion_mask, temperature, with_entropy) -> logp (n, T) [, entropy]. None: token_logprobs."""
    update: object | None = None
    """What ClippedStep does, in its two calls: backward(loss) for each micro-batch's weighted
    loss, then step(policy, optimizer, max_grad_norm, loss) -> (gradient norm, whether the
    weights moved). None: ClippedStep()."""


# ----------------------------------------------------------------------------------------------
# Setup: the reference, the policy without dropout, and the optimizer, once before training
# ----------------------------------------------------------------------------------------------
# PAPER: Algorithm 1 starts from π_θ ← π_init and π_ref ← π_θ, and updates π_θ with AdamW (§4.2).
def make_reference(policy):
    """A frozen copy of the policy: π_ref. PAPER: the reference is the initial (SFT) model.
    NOTE: it costs one more copy of the weights, but no gradients and no optimizer state; β = 0
          needs no reference at all."""
    ref = copy.deepcopy(policy).eval()
    ref.requires_grad_(False)
    return ref


def disable_dropout(model):
    """Set every dropout probability in `model` to 0, in place.

    WHY: with dropout on, π_θ in the ratio is a different random function from the π_old that
    sampled, so the ratio is not 1 at μ = 1 and the KL is noisy. TRL does the same. (Llama and
    Qwen configs already use 0; GPT-2 uses 0.1.) We zero it rather than call .eval(), because
    gradient checkpointing in transformers only runs in train mode.
    """
    # NOTE: some attention layers keep their dropout as a float attribute (Llama's and Qwen's
    #       attention_dropout), not as an nn.Dropout module; both are zeroed.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


def make_optimizer(policy, cfg: GRPOConfig):
    """AdamW over the trainable parameters. PAPER: AdamW (§4.2, lr 1e-6 for the 7B model; the
    tiny world's 0.5 M-parameter model wants 1e-4, see train_gsm8k.py's presets)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    # NOTE: AdamW's step on a bf16 or fp16 weight is lost below the dtype's resolution. bf16 keeps
    #       8 significant bits, so a weight near 0.02 moves in steps of about 1e-4, and an update
    #       of lr 1e-6 rounds to nothing, with no error. transformers loads a checkpoint in its own
    #       dtype (bf16 for Qwen2.5 and SmolLM2) unless given dtype=torch.float32.
    low = sorted({str(p.dtype) for p in params if p.dtype in (torch.bfloat16, torch.float16)})
    if low:
        warnings.warn(f"make_optimizer: trainable weights in {', '.join(low)}: AdamW's updates "
                      f"below that dtype's resolution are rounded away, so lr {cfg.lr:g} may "
                      f"move nothing; load the model with dtype=torch.float32 (and compute in "
                      f"bf16 with torch.autocast)", stacklevel=2)
    # WHY (memory, speed): the fused kernel updates each tensor in one pass: no model-sized
    #      temporaries (AdamW's foreach default makes them on a GPU; TRL fuses too), and on a CPU
    #      about twice as fast as the default plain loop (docs/speed.md).
    fused = all(p.device.type in ("cuda", "cpu") for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


# ----------------------------------------------------------------------------------------------
# 1. Sample a group of G completions per prompt
# ----------------------------------------------------------------------------------------------
# PAPER: for each question q, GRPO samples a group of outputs {o_1, ..., o_G} from the old policy
#        π_θold (§4.1.1). π_old is simply π_θ as it is before this step's update.
# WHY: every tensor below keeps a group's G rows together: rows gG .. gG+G-1 belong to prompt g,
#      so group statistics are a reshape to (B, G) away.
# NOTE: the sampler and the loss must agree on one distribution. Both use the same temperature,
#       no top-k and no top-p (test_sampling_distribution_is_the_one_the_loss_scores).
def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion: the model's generation_config's, else the
    tokenizer's. NOTE: a freshly initialised model's generation_config has no EOS id."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    if eos is None:
        raise ValueError("neither the model's generation_config nor the tokenizer has an EOS id")
    return [eos] if isinstance(eos, int) else list(eos)


def pad_token_id(model, tokenizer) -> int:
    """The id written after a completion's EOS: the tokenizer's pad token, else the first EOS id."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else eos_token_ids(model, tokenizer)[0]


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """1 for every completion token up to and including the first EOS, 0 after it: (N, T).

    Example, EOS id 2: [5, 2, 7, 2] -> [1, 1, 0, 0]; [5, 5, 5, 5] (no EOS, so truncated) ->
    [1, 1, 1, 1]. The mask's row sums are the |o_i| of eq. 3.
    """
    T = completion_ids.shape[1]
    eos = torch.tensor(list(eos_ids), device=completion_ids.device)                   # (E,)
    is_eos = torch.isin(completion_ids, eos)                                          # (N, T)
    # WHY: a sequence with no EOS hit the length cap; all T of its tokens count.
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), T)                 # (N,)
    positions = torch.arange(T, device=completion_ids.device)                         # (T,)
    # NOTE: the EOS itself is kept in the mask, so the model is credited (or blamed) for stopping.
    return (positions[None, :] <= first_eos[:, None]).long()                          # (N, T)


def draw_tokens(logits, t, done, *, eos, pad_id, temperature, greedy):
    """Token t of every completion, drawn from the policy: logits (N, V), done (N,) ->
    (ids (N,), done (N,), the log-prob of each id under the distribution it was drawn from (N,)).

    PAPER: o_i ~ π_old(· | q), one token at a time. A row that has ended gets pad_id from then on.
    Every sampler calls this (sample_completions binds the arguments after `done` and hands the
    sampler `pick`), so the distribution is defined here, once.
    """
    scaled = logits / temperature                                                     # (N, V)
    if greedy:
        next_ids = logits.argmax(-1)                                                  # (N,)
    else:
        # NOTE: no top-k / top-p: the samples must come from exactly the distribution whose
        #       log-probs the loss uses. (generate() would silently apply transformers' top_k=50.)
        next_ids = torch.multinomial(torch.softmax(scaled, dim=-1), 1).squeeze(1)     # (N,)
    next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)         # (N,)
    # PAPER: log softmax(l)[o] = l[o] - logsumexp(l), as token_logprobs computes it (step 4)
    logp = scaled.gather(-1, next_ids[:, None]).squeeze(1) - scaled.logsumexp(-1)     # (N,)
    return next_ids, done | torch.isin(next_ids, eos), logp                           # (N,) x3


def decode(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, pick):
    """The sampling loop: prompts (B, P), (B, P) -> (completion ids (N, T), the sampler's log-prob
    of each (N, T)), T <= max_new_tokens.

    The first forward reads the G copies of each prompt and keeps their keys and values (the KV
    cache, the model's own public `use_cache` API); each later one reads only the token just
    drawn. `pick` (draw_tokens) draws; the loop stops once every row has drawn an EOS.
    """
    ids = prompt_ids.repeat_interleave(group_size, 0)                             # (N, P) in groups
    mask = prompt_mask.repeat_interleave(group_size, 0)                               # (N, P)
    # WHY: number positions from each prompt's first real token, as generate() does.
    positions = (mask.cumsum(1) - 1).clamp(min=0)                                     # (N, P)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)             # (N,)
    tokens, logps, past = [], [], {}
    for t in range(max_new_tokens):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **past)
        # NOTE: transformers 5 names the KV cache `cache`, 4.x `past_key_values`; pass it back.
        kv = "cache" if "cache" in out else "past_key_values"
        past = {kv: out[kv]}
        next_ids, done, logp = pick(out.logits[:, -1, :].float(), t, done)          # (N,) x3
        tokens.append(next_ids)
        logps.append(logp)
        # WHY: stop as soon as every row has ended; T is then shorter than max_new_tokens.
        if done.all():
            break
        # The next forward reads only the new token; the cache holds everything before it.
        ids = next_ids[:, None]                                                       # (N, 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)                 # (N, P+t+1)
        positions = positions[:, -1:] + 1                                             # (N, 1)
    return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)                      # (N, T) x2


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], cfg: GRPOConfig, greedy: bool = False,
                       group_size: int | None = None, sample: Callable | None = None) -> dict:
    """G completions for each of B prompt strings, as a dict whose rows come in groups of G:
    prompt_ids, prompt_mask (N, P); completion_ids, completion_mask, sampler_logp (N, T);
    completions (N texts); truncated (N,), True where a completion hit max_new_tokens without EOS.

    greedy=True decodes the most likely completion instead (evaluation, with group_size=1).
    group_size overrides cfg.group_size; sample replaces decode (Seams.sample).
    """
    G, device = (cfg.group_size if group_size is None else group_size), model.device
    # WHY: left padding puts every prompt's last token in the same column, so decoding starts
    #      together.
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False)
    prompt_ids, prompt_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    eos_ids, pad_id = eos_token_ids(model, tokenizer), pad_token_id(model, tokenizer)
    eos = torch.tensor(eos_ids, device=device)                                        # (E,)
    pick = functools.partial(draw_tokens, eos=eos, pad_id=pad_id, temperature=cfg.temperature,
                             greedy=greedy)
    # WHY eval mode: under gradient checkpointing, train mode turns the KV cache off.
    training = model.training
    model.eval()
    try:
        completion_ids, sampler_logp = (sample or decode)(model, prompt_ids, prompt_mask, G,
                                                          cfg.max_new_tokens, pick)  # (N, T) x2
    finally:
        model.train(training)
    # NOTE: the rows come out grouped: completion n answers prompt n // G.
    completion_mask = completion_mask_from_ids(completion_ids, eos_ids)              # (N, T)
    # WHY: pads after EOS may equal a real token id; mask them out by position, not by id.
    kept = completion_ids * completion_mask + pad_id * (1 - completion_mask)          # (N, T)
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    # A completion with no EOS at all stopped because it hit max_new_tokens.
    truncated = ~torch.isin(completion_ids, eos).any(1)                               # (N,)
    return dict(prompt_ids=prompt_ids.repeat_interleave(G, 0),                        # (N, P)
                prompt_mask=prompt_mask.repeat_interleave(G, 0),                      # (N, P)
                completion_ids=completion_ids, completion_mask=completion_mask,       # (N, T)
                sampler_logp=sampler_logp, completions=texts, truncated=truncated)    # (N, T)


# ----------------------------------------------------------------------------------------------
# 2. Score each completion with rule-based reward functions
# ----------------------------------------------------------------------------------------------
# PAPER: the paper scores outputs with a learned reward model r_φ. DeepSeek-R1 and most GRPO work
#        since use rules instead (is the final answer right?), and so do we: rewards.py.
# WHY: a reward function has TRL's signature, f(prompts, completions, **columns) -> list[float],
#      so the same functions run here and in TRL's GRPOTrainer (train_trl.py).


def reward_name(fn) -> str:
    """The name a reward function is logged under: rewards/<name>."""
    return getattr(fn, "__name__", type(fn).__name__)


def compute_rewards(reward_funcs: Sequence[Callable], prompts: list[str], completions: list[str],
                    columns: dict | None = None, weights: Sequence[float] | None = None):
    """The total reward of each completion, from K reward functions with TRL's signature
    f(prompts, completions, **columns). Every list holds N entries (columns already repeated G
    times per prompt). Returns (rewards (N,) float32, {name: mean of that function's reward}).

    Example (test_compute_rewards_weights_and_means): weights [1, 0.5], f1 = [1, 0, 1, 0] and
    f2 = [2, 2, 0, 0] give r = [2, 1, 1, 0]; the logged means are f1 0.5 and f2 1.0.
    """
    N = len(completions)
    weights = [1.0] * len(reward_funcs) if weights is None else list(weights)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(reward_funcs)} functions")
    per_fn = torch.zeros(len(reward_funcs), N)                                        # (K, N)
    for k, fn in enumerate(reward_funcs):
        values = fn(prompts=prompts, completions=completions, **(columns or {}))
        name = reward_name(fn)
        if values is None or len(values) != N:
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"reward function {name!r} returned {got} for {N} completions")
        # WHY: a bool is an int in Python; refusing it catches a function that returns a comparison
        #      where a score was meant, or a list of numbers where one number was meant.
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"reward function {name!r} returned {v!r}; expected a number")
        per_fn[k] = torch.tensor(values, dtype=torch.float32)                         # (N,)
    # PAPER: r_i = Σ_k w_k f_k(prompt_i, completion_i)     (rule-based rewards, as DeepSeek-R1's)
    rewards = (torch.tensor(weights, dtype=torch.float32)[:, None] * per_fn).sum(0)   # (N,)
    return rewards, {reward_name(fn): per_fn[k].mean().item() for k, fn in enumerate(reward_funcs)}


# ----------------------------------------------------------------------------------------------
# 3. Group-relative advantages: the group mean replaces PPO's learned critic
# ----------------------------------------------------------------------------------------------
# PAPER: PPO learns a value function V(s) as its baseline: a second network the size of the
#        policy, with its own gradients and optimizer state. GRPO drops it and uses the average
#        reward of G outputs to the same question as the baseline (§4.1.1). That is the memory
#        claim: no critic.
# NOTE: a completion is pushed up when it beats its siblings, not when its reward is high. A group
#       whose rewards all agree (all right, all wrong) therefore teaches nothing: its A is 0.
def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """Standardise each reward within its group of G: rewards (N,), groups contiguous -> (N,).
    The baseline is the group's mean reward; dividing by the group's std puts every group's
    advantages on one scale, however easy or hard its prompt.

    Example (test_advantages_hand_worked): rewards [1, 0, 0, 1], one group of G = 4. Mean 0.5;
    sample std sqrt(4 · 0.25 / 3) = 0.57735; A = ±0.5 / (0.57735 + 1e-4), which is
    [+0.866, -0.866, -0.866, +0.866]. Rewards [1, 1, 1, 1] give A = [0, 0, 0, 0].
    """
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"which must be at least 2; got shape {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size).float()                                    # (B, G)
    mean = grouped.mean(dim=1, keepdim=True)                                          # (B, 1)
    # PAPER: Â_i,t = r̃_i = (r_i - mean(r)) / std(r)                (§4.1.2, outcome supervision)
    centred = grouped - mean                                                          # (B, G)
    if not scale_rewards:
        # DEVIATION (opt-in, Dr. GRPO arXiv 2503.20783): dividing by std up-weights groups whose
        # rewards barely differ (nearly all right or all wrong); centring keeps the reward's scale.
        return centred.view(-1)                                                       # (N,)
    # NOTE: std is the SAMPLE std (Bessel, divide by G-1), as torch.std and TRL use; the paper is
    #       silent on it.
    # NOTE: eps goes OUTSIDE the sqrt, added to std. A group whose rewards are all equal has
    #       centred == 0 exactly, so its advantage is 0/(0+eps) = 0, never NaN: no signal.
    std = grouped.std(dim=1, keepdim=True)                                            # (B, 1)
    return (centred / (std + eps)).view(-1)                                           # (N,)


def process_advantages(step_rewards: list[list[tuple[int, float]]], group_size: int,
                       num_tokens: int, eps: float = 1e-4) -> torch.Tensor:
    """Process supervision (§4.1.3). step_rewards[n] lists completion n's steps as (end token,
    reward). Returns per-token advantages (N, T): each token gets the sum of the normalised
    rewards of the steps that end at or after it.

    Example (test_process_advantages_hand_worked), G = 2, T = 4: completion 0 has right steps
    ending at tokens 1 and 3, completion 1 one wrong step ending at token 2. R = [1, 1, 0]
    normalises to [+0.577, +0.577, -1.155], so completion 0 gets [1.155, 1.155, 0.577, 0.577]
    and completion 1 [-1.155, -1.155, -1.155, 0]. One step per completion is outcome supervision.
    """
    N = len(step_rewards)
    if N % group_size:
        raise ValueError(f"{N} completions do not split into groups of {group_size}")
    advantages = torch.zeros(N, num_tokens)                                           # (N, T)
    for g in range(0, N, group_size):
        group = step_rewards[g:g + group_size]
        R = torch.tensor([r for steps in group for _, r in steps], dtype=torch.float32)  # (K,)
        # PAPER: r̃_i^index(j) = (r_i^index(j) - mean(R)) / std(R), R = every step reward of
        #        the group
        # NOTE: as for outcomes: the sample std, with eps added to it (equal step rewards give 0
        #       everywhere). A single step in the whole group has no spread: its advantage is 0.
        normalised = (R - R.mean()) / (R.std() + eps) if len(R) > 1 else 0 * R        # (K,)
        placed = iter(normalised.tolist())  # NOTE: R lists the group's steps in order, as here
        for i, steps in enumerate(group):
            for end, _ in steps:
                # WHY: an end outside the completion (from a careless reward) lands on its edge.
                advantages[g + i, min(max(end, 0), num_tokens - 1)] += next(placed)
    # PAPER: Â_i,t = Σ_{index(j) >= t} r̃_i^index(j)      (a reverse cumulative sum over positions)
    return advantages.flip(1).cumsum(1).flip(1)                                       # (N, T)


# ----------------------------------------------------------------------------------------------
# 4. Per-token log-probabilities of the completion tokens
# ----------------------------------------------------------------------------------------------
# PAPER: the objective needs log π(o_it | q, o_i<t) under three policies: π_θ (with gradients,
#        the one being trained), π_old (the sampler, for the ratio) and π_ref (the frozen start,
#        for the KL term).
# WHY: one function scores all three, so they see the same positions, masks and temperature.
def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                   temperature: float = 1.0, with_entropy: bool = False):
    """log π(o_t | q, o_<t) of each completion token: (n, P), (n, T) -> logp (n, T) [, entropy].

    Runs with gradients if the caller has them on; wrap it in torch.no_grad() for π_old and π_ref.
    NOTE: the logits are divided by the sampling temperature, so the loss scores the very
          distribution that drew the tokens; at any temperature but 1 that is not the raw softmax.
    """
    T = completion_ids.shape[1]
    input_ids, attention_mask, position_ids = joined_sequences(                      # (n, P+T) x3
        prompt_ids, prompt_mask, completion_ids, completion_mask)
    # WHY (memory): logits for the last T+1 positions only, where the model can skip the rest.
    keep = ({"logits_to_keep": T + 1}
            if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=False, **keep)
    # NOTE: the logit at position t predicts token t+1: the completion's are one to the left.
    return logprobs_of(out.logits[:, -(T + 1):-1, :], completion_ids, temperature,  # (n, T, V)
                       with_entropy)


def joined_sequences(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Prompts and completions as whole sequences: (n, P), (n, T) -> input_ids, attention_mask,
    position_ids, each (n, P+T). Every scorer of step 4 feeds the model these."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)                        # (n, P+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)                 # (n, P+T)
    # WHY: sampling numbers positions from the first real token of a left-padded prompt; so must
    #      we, or models with absolute position embeddings would score a different sequence.
    return input_ids, attention_mask, (attention_mask.cumsum(1) - 1).clamp(min=0)     # (n, P+T)


def logprobs_of(logits, completion_ids, temperature: float, with_entropy: bool):
    """From the logits that predict each completion token, (n, T, V), to logp (n, T) [, entropy]."""
    logits = logits.float() / temperature                                             # (n, T, V)
    # PAPER: log softmax(l)[o] = l[o] - logsumexp(l)
    # WHY (memory): gather + logsumexp never keeps a second (n, T, V) log_softmax tensor alive.
    chosen = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)              # (n, T)
    lse = torch.logsumexp(logits, dim=-1)                                             # (n, T)
    logp = chosen - lse                                                               # (n, T)
    if not with_entropy:
        return logp
    with torch.no_grad():
        # NOTE: H = -Σ_v p_v log p_v = logsumexp(l) - Σ_v p_v l_v     (logged as `entropy`)
        # WHY (memory): one sequence at a time, so the softmax is a (T, V) temporary.
        entropy = torch.stack([row_lse - (torch.softmax(row, dim=-1) * row).sum(-1)   # (T,) a row
                               for row, row_lse in zip(logits, lse)])                 # (n, T)
    return logp, entropy


# ----------------------------------------------------------------------------------------------
# 5-7. The GRPO loss: clipped ratio (5), k3 KL (6), aggregation (7)
# ----------------------------------------------------------------------------------------------
# PAPER: eq. 3 is PPO's clipped surrogate with two changes: A is the group advantage, and the KL
#        to π_ref is a term of the loss instead of a per-token penalty inside the reward.
# NOTE: r_it(θ) in this section is the probability RATIO π_θ/π_old, not a reward; A holds rewards.
def clipped_surrogate(ratio, A, clip_eps: float, clip_eps_high: float):
    """Eq. 3's per-token objective: ratio (N, T), A (N, 1) or (N, T) -> (N, T).

    Example (test_clip_binds_above_with_positive_advantage): ratio 1.3, ε = 0.2, A = +1 gives
    min(1.3, 1.2) = 1.2, and no gradient through the ratio: the update has gone far enough.
    """
    # PAPER: min( r·A , clip(r, 1-ε, 1+ε)·A )                       (eq. 3; ε_high is DAPO's)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)                     # (N, T)
    return torch.min(ratio * A, clipped * A)                                          # (N, T)


def grpo_loss(logp, logp_old, logp_ref, advantages, completion_mask, *, clip_eps=0.2,
              clip_eps_high=None, beta=0.04, loss_type="grpo", max_completion_length=None,
              importance_sampling_level="token"):
    """loss = -J(θ) for one batch, and its stats (kl, clip_ratio/low, /high, /region). logp,
    logp_old, logp_ref, completion_mask: (N, T); advantages (N,) (outcome) or (N, T) (process)."""
    if beta != 0 and logp_ref is None:
        raise ValueError("logp_ref is required when beta != 0")
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = completion_mask.to(logp.dtype)                                             # (N, T)
    # NOTE: an outcome advantage broadcasts over its completion's tokens: every token of o_i gets
    #       A_i (§4.1.2). A process advantage is already one per token.
    A = advantages.to(logp.dtype).reshape(logp.shape[0], -1)                     # (N, 1) or (N, T)

    # 5. PAPER: r_it(θ) = π_θ(o_it|q,o_i<t) / π_old(o_it|q,o_i<t), as exp of a log difference
    # NOTE: why the printed loss is ~0 at μ = 1 while the gradient is not. There logp_old is
    #       logp.detach() (micro_batch_loss), so the ratio is exactly 1 in value, yet its
    #       gradient is ∇ratio = ratio·∇logp = ∇logp. The loss is then about -mean(A) = 0
    #       (advantages are zero-mean in each group), while the gradient is REINFORCE's with the
    #       group baseline. Nothing is broken.
    log_ratio = logp - logp_old                                                       # (N, T)
    if importance_sampling_level == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask)  # DEVIATION (opt-in, GSPO): see Variants
    ratio = torch.exp(log_ratio)                                                      # (N, T)
    surrogate = clipped_surrogate(ratio, A, clip_eps, clip_eps_high)                  # (N, T)

    # 6. The KL penalty (k3_kl), weighted by β; β = 0 needs no π_ref at all.
    kl = k3_kl(logp, logp_ref) if beta != 0 else torch.zeros_like(logp)              # (N, T)
    # PAPER: the per-token term of eq. 3, negated: we minimise -J
    per_token = -(surrogate - beta * kl)                                              # (N, T)

    # 7. Average over tokens and completions (aggregate).
    loss = aggregate(per_token, mask, loss_type, max_completion_length)               # ()
    return loss, loss_stats(ratio, A, kl, mask, clip_eps, clip_eps_high)


def k3_kl(logp, logp_ref):
    """Step 6: the per-token KL estimate to the reference, logp and logp_ref (N, T) -> (N, T).

    Example (test_k3_kl_hand_worked): log(π_ref/π_θ) = ln 2 gives 2 - ln 2 - 1 = 0.3069;
    -ln 2 gives 0.5 + ln 2 - 1 = 0.1931.
    NOTE: k3 is an unbiased, always >= 0 estimate of the REVERSE KL(π_θ || π_ref) from tokens
          sampled from π_θ (here π_old, equal to π_θ when μ = 1). It is in the loss, not the
          reward.
    """
    log_ref_ratio = logp_ref - logp                                                   # (N, T)
    # PAPER: D_KL[π_θ||π_ref] = π_ref/π_θ - log(π_ref/π_θ) - 1        (eq. 4, Schulman's k3)
    return torch.exp(log_ref_ratio) - log_ref_ratio - 1                               # (N, T)


def aggregate(per_token, mask, loss_type: str = "grpo", max_completion_length=None):
    """Step 7: the batch's loss from per-token losses, per_token and mask (N, T) -> ().

    Example (test_loss_types_on_lengths_1_and_3): a per-token loss of -1 on a completion of 1
    token and +1 on each of another's 3 give 'grpo' (-1/1 + 3/3) / 2 = 0, 'token' (-1 + 3) / 4 =
    0.5 and 'dr_grpo', with L_max = 4, (-1 + 3) / (2 · 4) = 0.25.
    """
    # NOTE: per-sequence vs per-token averaging. 'grpo' gives every completion equal weight, so a
    #       token of a long completion weighs less than one of a short completion (a length bias,
    #       see Dr. GRPO); 'token' weighs all tokens alike. They differ when lengths differ.
    if loss_type == "grpo":
        # PAPER: 1/G Σ_i 1/|o_i| Σ_t                                                  (eq. 3)
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    if loss_type == "token":
        # DEVIATION (opt-in, DAPO arXiv 2503.14476): Σ_i Σ_t / Σ_i |o_i|
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        # DEVIATION (opt-in, Dr. GRPO arXiv 2503.20783): Σ_i Σ_t / (N · L_max), no length bias
        L = max_completion_length if max_completion_length is not None else mask.shape[1]
        return (per_token * mask).sum() / (mask.shape[0] * L)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


@torch.no_grad()
def loss_stats(ratio, A, kl, mask, clip_eps: float, clip_eps_high: float) -> dict:
    """Mean KL per token and the share of tokens where the clip binds (TRL's clip_ratio/* names)."""
    n_tok = mask.sum().clamp(min=1)                                                   # ()
    low = ((ratio < 1 - clip_eps) & (A < 0)).to(mask.dtype)                       # (N, T) binds low
    high = ((ratio > 1 + clip_eps_high) & (A > 0)).to(mask.dtype)                # (N, T) binds high
    # NOTE: at μ = 1 the ratio is exactly 1, so the clip never binds and all three shares are 0.
    #       They move only from the second update of a batch on (μ > 1), as π_θ drifts from π_old.
    # Each entry below is an (N, T) tensor; the stat is its mean over the real tokens.
    per_token = {"kl": kl, "clip_ratio/low": low, "clip_ratio/high": high,
                 "clip_ratio/region": low + high}
    return {k: ((v * mask).sum() / n_tok).item() for k, v in per_token.items()}


# ----------------------------------------------------------------------------------------------
# 8. The policy update: μ optimizer steps on one batch of samples
# ----------------------------------------------------------------------------------------------
# PAPER: Algorithm 1, "for GRPO iteration = 1..μ: update π_θ by maximising the GRPO objective".
#        With μ = 1 (the paper's setting) every batch is used for exactly one AdamW step.
# WHY: micro-batches bound memory; their weighted gradients add up to the full batch's exactly.
def policy_update(policy, optimizer, batch: dict, logp_old, logp_ref, cfg: GRPOConfig,
                  seams: Seams = Seams()) -> dict:
    """Algorithm 1's inner loop, as CleanRL's PPO writes it: for each of μ updates, for each
    micro-batch, score its tokens under π_θ (4), take its loss (5-7) and backward it; then clip
    the gradient and take one AdamW step. logp_old is None at μ = 1 (fixed_logprobs).
    Returns the loss, KL, clip and entropy stats, the gradient norm, how many updates were skipped
    (a loss or gradient that is not finite) and sampler_agreement's sampling/* stats.
    """
    mask, mu = batch["completion_mask"], cfg.num_iterations                           # (N, T)
    score, update = seams.score or token_logprobs, seams.update or ClippedStep()
    weights, shares = micro_batch_weights(mask, cfg.micro_batch_size, cfg.loss_type)
    stats, skipped = {"loss": 0.0}, 0
    first_logp, first_entropy = [], []  # the first update's, for sampler_agreement
    for it in range(mu):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0  # this update's loss, to skip it if it is not finite
        for k, (s, inputs) in enumerate(micro_batches(batch, cfg.micro_batch_size)):
            # 4. log π_θ of the micro-batch's tokens, with gradients (the entropy is only logged)
            logp, entropy = score(policy, *inputs, cfg.temperature, True)             # (n, T) x2
            # 5-7. its loss: ratio and clip, KL, averaging
            loss, parts = micro_batch_loss(logp, batch, s, logp_old, logp_ref, cfg)    # ()
            # its share of the batch's loss: backward adds its gradient to the others'
            update.backward(loss * weights[k])                                        # ()
            value = loss.item()  # one device sync a micro-batch
            loss_sum += value * weights[k]
            stats["loss"] += value * weights[k] / mu
            for key, v in parts.items():  # kl, clip_ratio/*: means over tokens, so weighed so
                stats[key] = stats.get(key, 0.0) + v * shares[k] / mu
            if it == 0:
                first_logp.append(logp.detach())
                first_entropy.append(entropy)
        # 8. clip the summed gradient, then one AdamW step
        grad_norm, stepped = update.step(policy, optimizer, cfg.max_grad_norm, loss_sum)
        skipped += not stepped
    agreement = sampler_agreement(torch.cat(first_logp), torch.cat(first_entropy),  # (N, T) x2
                                  batch["sampler_logp"], mask)
    return {**stats, **agreement, "grad_norm": grad_norm, "skipped_updates": skipped}


def micro_batches(batch: dict, size: int):
    """(slice, model inputs) for each micro-batch of `size` sequences; the last may be smaller.
    The inputs are token_logprobs' first four arguments, in order."""
    N = batch["completion_ids"].shape[0]
    # NOTE: slices, not copies: each micro-batch is a view of the batch's tensors.
    for i in range(0, N, size):
        s = slice(i, min(i + size, N))
        yield s, (batch["prompt_ids"][s], batch["prompt_mask"][s],                # (n, P), (n, P)
                  batch["completion_ids"][s], batch["completion_mask"][s])        # (n, T), (n, T)


def micro_batch_weights(mask, size: int, loss_type: str) -> tuple[list[float], list[float]]:
    """For each micro-batch of `size` rows of mask (N, T): (the weight of its mean loss, its share
    of the batch's real tokens).

    WHY: the weighted sum of the micro-batches' losses is then the whole batch's loss, and so is
    its gradient. 'grpo' and 'dr_grpo' average over sequences, so a micro-batch of n rows weighs
    n / N; 'token' averages over tokens, so it weighs its share of the tokens. The token shares
    also weigh the logged KL and clip ratios, which are means over tokens.
    Example: rows of 1 and 3 tokens in micro-batches of 1: weights [0.5, 0.5] ('grpo') or
    [0.25, 0.75] ('token'); shares [0.25, 0.75].
    """
    N, n_tok = mask.shape[0], max(1, mask.sum().item())
    weights, shares = [], []
    for i in range(0, N, size):
        rows = mask[i:i + size]                                                       # (n, T)
        shares.append(rows.sum().item() / n_tok)
        weights.append(shares[-1] if loss_type == "token" else rows.shape[0] / N)
    return weights, shares


def micro_batch_loss(logp, batch: dict, s: slice, logp_old, logp_ref, cfg: GRPOConfig):
    """Steps 5-7 for the micro-batch of rows s, whose log-probs under π_θ are logp (n, T):
    grpo_loss with its π_old, π_ref and advantages. Returns (loss, grpo_loss's stats)."""
    # NOTE: why logp_old is logp.detach() at μ = 1. No π_old pass ran (fixed_logprobs): π_old is
    #       π_θ before this update, and this is that very update, so π_θ's own log-probs are
    #       π_old's. Detached, they are constants, as π_old's must be: the gradient flows only
    #       through logp. (At μ > 1, π_θ has moved after the first update: π_old's were kept.)
    old = logp.detach() if logp_old is None else logp_old[s]                          # (n, T)
    ref = None if logp_ref is None else logp_ref[s]                                   # (n, T)
    A = batch["advantages"][s]                                                  # (n,) or (n, T)
    if cfg.sampler_is_cap:  # DEVIATION (opt-in, TIS): see sampler_weighted, Variants
        A = sampler_weighted(A, old, batch["sampler_logp"][s], cfg.sampler_is_cap)   # (n, T)
    return grpo_loss(logp, old, ref, A, batch["completion_mask"][s], clip_eps=cfg.clip_eps,
                     clip_eps_high=cfg.clip_eps_high, beta=cfg.beta, loss_type=cfg.loss_type,
                     max_completion_length=cfg.max_new_tokens,
                     importance_sampling_level=cfg.importance_sampling_level)


class ClippedStep:
    """The plain update, in the two calls DeepSpeed's engine and Accelerate make familiar:
    backward(loss) for each micro-batch, whose gradients add up, then step(), which clips the
    summed gradient and takes AdamW's step. Seams.update may put another object with these two
    calls in its place (memory.StepInsideBackward)."""

    def backward(self, loss):
        """Add this micro-batch's gradient to the others'; its graph is freed here."""
        loss.backward()

    def step(self, policy, optimizer, max_grad_norm: float, loss: float) -> tuple[float, bool]:
        """Clip the summed gradient, then AdamW's step, unless `loss` (this update's) or the
        gradient is not finite. Returns (the gradient norm before clipping, whether it stepped)."""
        # WHY: clip the norm of the summed gradient, as one whole batch would.
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm).item()
        # WHY: one non-finite gradient would poison every weight through Adam's moments; skip the
        #      update, leave weights and optimizer state untouched (policy_update counts it).
        stepped = math.isfinite(grad_norm) and math.isfinite(loss)
        if stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # WHY (memory): no gradient kept between steps
        return grad_norm, stepped


@torch.no_grad()
def sampler_agreement(logp, entropy, sampler_logp, mask) -> dict:
    """Mean entropy, and how far the trainer's log-probs (logp) are from the sampler's over the
    real tokens: (N, T) each. TRL's names: sampling/logp_difference/mean, .../ratio_outside...
    NOTE: the policy scores each token twice, once while sampling (token by token, KV cache) and
          once here: equal to rounding in fp32; bf16 or a separate inference engine drift apart."""
    real, n = mask.bool(), max(1.0, mask.sum().item())                                # (N, T)
    gap = torch.where(real, logp - sampler_logp, 0.0)                                 # (N, T)
    return {"entropy": torch.where(real, entropy, 0.0).sum().item() / n,
            "sampling/logp_difference/mean": gap.abs().sum().item() / n,
            "sampling/ratio_outside_0.9_1.1": ((gap.exp() - 1).abs() > 0.1).sum().item() / n}


# ----------------------------------------------------------------------------------------------
# 9. One GRPO step: Algorithm 1's inner loop, in the paper's order
# ----------------------------------------------------------------------------------------------
# grpo_step is the whole algorithm as a few calls: rollout (1-3), the dynamic-sampling variant if
# it is on, fixed_logprobs (4), policy_update (5-8), step_metrics. Everything else in this file is
# one of those calls, or a piece of one.
def rollout(policy, tokenizer, prompts: list[str], columns: dict | None,
            reward_funcs: Sequence[Callable], cfg: GRPOConfig, seams: Seams = Seams()) -> dict:
    """Steps 1-3 for B prompts: sample G completions each, score them, standardise in each group.
    Returns sample_completions' batch plus, per completion: prompts, columns, rewards (N,),
    advantages ((N,) outcome, (N, T) process) and reward_means (name -> mean).
    NOTE: this is all of GRPO that touches the reward; everything after it sees only advantages.
    """
    G = cfg.group_size
    # 1. Sample G completions per prompt from the current policy, which is π_old for this step.
    batch = sample_completions(policy, tokenizer, prompts, cfg, sample=seams.sample)
    assert batch["completion_ids"].shape[0] == len(prompts) * G
    # Every per-prompt column is repeated G times, so row n of every list belongs together.
    batch["prompts"] = [p for p in prompts for _ in range(G)]
    batch["columns"] = {k: [v for v in vs for _ in range(G)] for k, vs in (columns or {}).items()}
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
def fixed_logprobs(policy, ref_model, batch: dict, cfg: GRPOConfig, seams: Seams = Seams()):
    """Step 4's log-probs that stay fixed during the update: log π_old (only for μ > 1; at μ = 1
    see micro_batch_loss) and log π_ref (only for β != 0); each (N, T) or None.
    NOTE: π_old must be scored before the first update moves π_θ: after it, π_θ is no longer the
          policy that sampled."""
    score = seams.score or token_logprobs
    logp_old = batch_logprobs(policy, batch, cfg, score) if cfg.num_iterations > 1 else None
    logp_ref = batch_logprobs(ref_model, batch, cfg, score) if cfg.beta != 0 else None
    return logp_old, logp_ref


def batch_logprobs(model, batch: dict, cfg: GRPOConfig, score: Callable) -> torch.Tensor:
    """log π of every completion token of the batch under `model`, one micro-batch at a time:
    (N, T). score: token_logprobs, or the Seams.score that replaces it."""
    parts = []
    for _, inputs in micro_batches(batch, cfg.micro_batch_size):
        parts.append(score(model, *inputs, cfg.temperature))                          # (n, T)
    return torch.cat(parts)                                                           # (N, T)


def grpo_step(policy, ref_model, optimizer, tokenizer, prompts: list[str],
              reward_funcs: Sequence[Callable], cfg: GRPOConfig, columns: dict | None = None,
              return_samples: bool = False,
              more_prompts: Callable[[int], tuple[list[str], dict]] | None = None,
              seams: Seams = Seams()) -> dict:
    """One GRPO step on B prompts: sample, score, standardise, then μ clipped-ratio updates.

    columns: extra per-prompt data for the reward functions (e.g. {"answer": [...]}, B each).
    return_samples=True adds metrics["samples"]: per completion its prompt, text, reward, A.
    more_prompts(k) -> (k prompts, their columns): fresh prompts for cfg.dynamic_sampling.
    seams: code from outside that takes over a part (Seams); the default runs only this file.
    Returns the step's metrics, named as TRL names them.

        policy = disable_dropout(model); ref = make_reference(policy)
        optimizer = make_optimizer(policy, cfg)
        for prompts, answers in batches:          # Algorithm 1: for step = 1..M
            m = grpo_step(policy, ref, optimizer, tokenizer, prompts, [correctness_reward], cfg,
                          columns={"answer": answers})
    """
    t0 = time.perf_counter()  # WHY: step_time covers all of it: sampling, scoring and the update
    if cfg.beta != 0 and ref_model is None:
        raise ValueError("beta != 0 needs a reference model (make_reference(policy))")
    # 1-3. Sample G completions per prompt, score them, standardise the rewards within each group.
    batch = rollout(policy, tokenizer, prompts, columns, reward_funcs, cfg, seams)
    sampled = [batch]
    if cfg.dynamic_sampling:  # DEVIATION (opt-in, DAPO): keep only groups with signal, see Variants
        batch, sampled = dynamic_sampling(batch, len(prompts), more_prompts, policy, tokenizer,
                                          reward_funcs, cfg, seams)
    # 4. log π_old and log π_ref of the sampled tokens, fixed while the policy moves. (π_θ's own
    #    log-probs are taken inside the update, with gradients.)
    logp_old, logp_ref = fixed_logprobs(policy, ref_model, batch, cfg, seams)      # (N, T) or None
    # 5-8. μ updates: ratio, clip, KL, aggregation, backward, gradient clip, AdamW step.
    update = policy_update(policy, optimizer, batch, logp_old, logp_ref, cfg, seams)
    metrics = {**step_metrics(batch, sampled, update, cfg), "step_time": time.perf_counter() - t0}
    if return_samples:
        metrics["samples"] = samples_of(batch)
    return metrics


def step_metrics(batch: dict, sampled: list[dict], update: dict, cfg: GRPOConfig) -> dict:
    """The step's metrics, named as TRL names them. Rewards describe everything sampled this step
    (every dynamic-sampling round); the rest describes the batch that was trained on.

    What healthy looks like: reward rises; frac_reward_zero_std well below 1 (else the groups carry
    no signal: problems too easy or too hard for G samples); kl starts at 0 and grows slowly; the
    clip ratios are 0 at μ = 1; completions/clipped_ratio near 0 (else answers are cut off).
    """
    G = cfg.group_size
    all_rewards = torch.cat([b["rewards"] for b in sampled])                          # (all,)
    # NOTE: reward_std is the mean over groups of the within-group std (TRL's definition), not
    #       the std of all rewards: it is 0 exactly when no group carries a signal.
    group_std = all_rewards.view(-1, G).std(dim=1)                                    # (groups,)
    counts = [len(b["prompts"]) for b in sampled]  # WHY: each round's means weigh by its size
    reward_means = {k: sum(b["reward_means"][k] * n for b, n in zip(sampled, counts)) / sum(counts)
                    for k in sampled[0]["reward_means"]}
    metrics = {
        "reward": all_rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        **{f"rewards/{name}": v for name, v in reward_means.items()},
        "frac_reward_zero_std": (group_std < 1e-8).float().mean().item(),
        **update,  # loss, kl, clip_ratio/*, entropy, sampling/*, grad_norm, skipped_updates
        "completions/mean_length": batch["completion_mask"].sum(1).float().mean().item(),
        "completions/clipped_ratio": batch["truncated"].float().mean().item(),
    }
    if cfg.dynamic_sampling:
        metrics["dynamic_sampling/rounds"] = len(sampled) - 1
        metrics["dynamic_sampling/groups_trained"] = len(batch["prompts"]) // G
    return metrics


def samples_of(batch: dict) -> list[dict]:
    """One dict per completion: prompt, completion, reward, advantage (to spot reward hacking).
    NOTE: under process supervision the advantage is per token; the first token's, the sum of all
          the completion's normalised step rewards, is the one logged."""
    # WHY: a view as (N, 1) or (N, T); column 0 is A_i, or its first token's under process.
    first = batch["advantages"].view(len(batch["prompts"]), -1)[:, 0]                 # (N,)
    return [dict(prompt=p, completion=c, reward=r, advantage=a) for p, c, r, a in
            zip(batch["prompts"], batch["completions"], batch["rewards"].tolist(), first.tolist())]


# ----------------------------------------------------------------------------------------------
# Variants: each is one call from the core above
# ----------------------------------------------------------------------------------------------
# Process supervision is the paper's own (§4.1.3); GSPO and DAPO's dynamic sampling came after.
# Each is off by default, switched on by one GRPOConfig field, and tested with its own numbers.
def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (arXiv 2507.18071): one length-normalised log-ratio per completion, (N, T) -> (N, T).

    DEVIATION (opt-in): s_i(θ) = exp( 1/|o_i| Σ_t log(π_θ(o_it)/π_old(o_it)) ), shared by all
    the tokens of completion i, so the clip keeps or drops a completion as a whole.
    NOTE: at μ = 1 every ratio is 1 either way, so GSPO's gradient there equals GRPO's; it only
          differs from the second update of a batch on.
    """
    lengths = mask.sum(1, keepdim=True).clamp(min=1)                                  # (N, 1)
    return ((log_ratio * mask).sum(1, keepdim=True) / lengths).expand_as(log_ratio)   # (N, T)


def sampler_weighted(A, logp_old, sampler_logp, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS): A (n,) or (n, T), logp_old, sampler_logp (n, T) ->
    each token's advantage times its weight, (n, T). The tokens came from the sampler, whose
    log-probs may differ a little from the trainer's own π_old (bf16, another engine); the weight
    is w_it = min(π_old(o_it) / π_sampler(o_it), cap). Both log-probs come without gradients.

    Example (test_sampler_weighted_hand_worked): A = 1, π_old 0.5 and cap 2: π_sampler 0.25
    gives 2; 0.1 gives 5, truncated to 2; 1.0 gives 0.5.
    DEVIATION (opt-in; Yao et al. 2025, TRL's vllm_importance_sampling_correction): TRL weighs
    the surrogate, w·min(r·A, clip(r)·A). w is positive, so that is min(r·wA, clip(r)·wA): the
    same, by weighing A. The KL term is not weighted, as in TRL.
    NOTE: at μ = 1, π_old is π_θ itself (micro_batch_loss), so w only undoes how the sampler's
          log-probs differ from the trainer's: in fp32 w = 1 to ~1e-6, the plain update (tested).
    """
    # w_it = min( exp(log π_old - log π_sampler), C ),  Â_it = w_it · A_i
    return A.reshape(len(A), -1) * torch.exp(logp_old - sampler_logp).clamp(max=cap)  # (n, T)


def score_steps(batch: dict, tokenizer, reward_funcs: Sequence[Callable], cfg: GRPOConfig) -> dict:
    """Process supervision's steps 2-3 (§4.1.3): one reward per reasoning step, put on the token
    where the step ends, then process_advantages. The reward function returns, per completion, a
    list of (end character, reward) steps; the last step is the final answer's.
    NOTE: the paper's step rewards come from a learned process reward model; ours check each
          calculator annotation with rewards.evaluate_arithmetic, a rule."""
    N, T = batch["completion_ids"].shape
    if (n_funcs := len(reward_funcs)) != 1:
        raise ValueError(f"process supervision takes one step-reward function, got {n_funcs}")
    fn = reward_funcs[0]
    steps = fn(prompts=batch["prompts"], completions=batch["completions"], **batch["columns"])
    if len(steps) != N or not all(isinstance(s, (list, tuple)) and len(s) >= 1 for s in steps):
        raise ValueError(f"process reward {reward_name(fn)!r} must return, for each of the {N} "
                         f"completions, a non-empty list of (end, reward) steps")
    # A step ends at a character of the decoded text; its reward goes on the token holding that
    # character (step_token_index), so tokens after a wrong step are not blamed for it.
    lengths = batch["completion_mask"].sum(1)                                         # (N,)
    ends = step_token_index(tokenizer, batch["completion_ids"], lengths,
                            [[e for e, _ in s] for s in steps])
    token_steps = [list(zip(e, (float(r) for _, r in s))) for e, s in zip(ends, steps)]
    batch["rewards"] = torch.tensor([float(s[-1][1]) for s in steps])                 # (N,)
    batch["reward_means"] = {reward_name(fn): batch["rewards"].mean().item(), "steps_mean":
                             sum(r for s in steps for _, r in s) / sum(len(s) for s in steps)}
    A = process_advantages(token_steps, cfg.group_size, T, cfg.adv_eps)               # (N, T)
    batch["advantages"] = A.to(batch["completion_ids"].device)                        # (N, T)
    return batch


def step_token_index(tokenizer, completion_ids, lengths, step_ends: list[list[int]]):
    """Map each step's end, a character index into the decoded completion, to the token holding
    its last character; completion_ids (N, T), lengths (N,). A step ending at the text's end maps
    to the completion's last token (its EOS, if it has one), so the final step credits stopping."""
    out = []
    for ids, n, ends in zip(completion_ids.tolist(), lengths.tolist(), step_ends):
        ids = ids[:n]
        text_len = decoded_length(tokenizer, ids, n)
        out.append([n - 1 if e >= text_len else first_token_through(tokenizer, ids, e)
                    for e in ends])
    return out


def decoded_length(tokenizer, ids: list[int], k: int) -> int:
    """How many characters the first k tokens of ids decode to.
    WHY decode prefixes, not single tokens: a SentencePiece token decoded alone loses its leading
    space, and a byte-level token holding part of a character decodes to "\ufffd". A prefix
    decodes as the whole text does."""
    return len(tokenizer.decode(ids[:k], skip_special_tokens=True))


def first_token_through(tokenizer, ids: list[int], end: int) -> int:
    """The first token k whose prefix ids[:k+1] decodes to at least `end` characters, so holds
    character end-1: a binary search over k, as bisect.bisect_left would do it."""
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high) // 2
        if decoded_length(tokenizer, ids, mid + 1) < end:
            low = mid + 1
        else:
            high = mid
    return low


def dynamic_sampling(batch: dict, B: int, more_prompts, policy, tokenizer,
                     reward_funcs: Sequence[Callable], cfg: GRPOConfig, seams: Seams = Seams()):
    """DAPO's dynamic sampling (arXiv 2503.14476). Returns (the batch to train on, every rollout).

    DEVIATION (opt-in): a group whose rewards all agree has advantage 0 on every token, so it adds
    no policy gradient and only shrinks the step. Drop such groups and top the batch up with fresh
    prompts, for at most cfg.dynamic_sampling more rounds.
    NOTE: the price is sampling: on the tiny world DAPO drew about 3x the completions of GRPO.
    """
    G, sampled = cfg.group_size, [batch]
    parts = [(batch, groups_with_signal(batch, G))]  # (a rollout, the groups of it to keep)
    for _ in range(cfg.dynamic_sampling):
        missing = B - sum(len(groups) for _, groups in parts)
        if missing <= 0 or more_prompts is None:
            break
        extra = rollout(policy, tokenizer, *more_prompts(missing), reward_funcs, cfg, seams)
        sampled.append(extra)
        parts.append((extra, groups_with_signal(extra, G)[:missing]))
    if not any(groups for _, groups in parts):
        # WHY: if every group agreed, train on the first draw as plain GRPO would (A = 0).
        return batch, sampled
    return merge_groups(parts, G, pad_token_id(policy, tokenizer)), sampled


def groups_with_signal(batch: dict, G: int) -> list[int]:
    """The indices of the batch's groups with any non-zero advantage."""
    keep = []
    for g in range(len(batch["prompts"]) // G):
        if batch["advantages"][g * G:(g + 1) * G].abs().sum() > 0:
            keep.append(g)
    return keep


def merge_groups(parts: list[tuple[dict, list[int]]], G: int, pad_id: int) -> dict:
    """The chosen groups (each G consecutive rows) of several rollouts, as one rollout.
    WHY: each rollout was padded to its own longest prompt and completion; the merged one is
    re-padded to the longest of all, so the masks stay exact."""
    rows = []  # for each rollout, the rows of its chosen groups
    for _, groups in parts:
        rows.append([g * G + i for g in groups for i in range(G)])
    out = {"prompts": [], "completions": [], "columns": {k: [] for k in parts[0][0]["columns"]}}
    for (b, _), rs in zip(parts, rows):
        out["prompts"] += [b["prompts"][r] for r in rs]
        out["completions"] += [b["completions"][r] for r in rs]
        for k in out["columns"]:
            out["columns"][k] += [b["columns"][k][r] for r in rs]
    # Each tensor: (key, pad on the left?, pad value). Prompts are padded on the left, as
    # sample_completions pads them, completions on the right.
    padding = [("prompt_ids", True, pad_id), ("prompt_mask", True, 0),
               ("completion_ids", False, pad_id), ("completion_mask", False, 0),
               ("advantages", False, 0.0), ("sampler_logp", False, 0.0),
               ("rewards", False, 0), ("truncated", False, 0)]
    for key, left, value in padding:
        pieces = [b[key][torch.tensor(rs, dtype=torch.long, device=b[key].device)]  # (n_j, ...)
                  for (b, _), rs in zip(parts, rows)]
        width = max(x.shape[-1] for x in pieces)
        out[key] = torch.cat([padded(x, width, left, value) for x in pieces])        # (n_all, ...)
    return out


def padded(x: torch.Tensor, width: int, left: bool, value) -> torch.Tensor:
    """x (n, w) padded with `value` to (n, width), on the left or the right; 1-D x as it is."""
    if x.dim() == 1:
        return x                                                                      # (n,)
    pad = (width - x.shape[1], 0) if left else (0, width - x.shape[1])
    return torch.nn.functional.pad(x, pad, value=value)                               # (n, width)
