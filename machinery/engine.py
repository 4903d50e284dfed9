"""
engine.py -- speed machinery for grpo.py, handed in from outside through grpo.Seams.

    seams = engine.apply(EngineConfig(), grpo.Seams(), eos_ids, pad_id)   # sample= and score=
    grpo.grpo_step(..., seams=seams)

What this is
    grpo.py keeps a plain sampler (grpo.decode: a KV cache through the model's public API, the
    whole loop on one screen) and a plain scorer (grpo.token_logprobs: one forward). This file
    makes the same draws and the same log-probs faster, the way nanochat's engine.py sits beside
    its chat_rl.py. Nothing in grpo.py knows it exists. What it does:
      - one prefill per distinct prompt, its KV cache then repeated G times;
      - torch.inference_mode, and only the last position's logits at prefill;
      - under PyTorch's SDPA kernel, a ready 4D padding mask, so transformers does not rebuild a
        causal mask at every token;
      - the transformers-version probes that all this needs;
      - a compiled decode step over a static KV cache (decode_compiled, EngineConfig.sampler);
      - each distinct prompt scored once, its G completions after its KV cache (shared_logits),
        and with EngineConfig.skip_pads the output layer only at completion tokens;
      - at most EngineConfig.sample_batch_size rows decoded at a time (in_batches);
      - with EngineConfig.draw "inverse-cdf", each token drawn from N random numbers, not N x V.
    The distribution is not defined here: `pick` is grpo.draw_tokens (temperature, greedy), handed
    in by grpo.sample_completions (draw_by_inverse_cdf draws from it by other means).
    tests/test_engine.py checks that decode draws exactly the tokens of grpo.decode and of
    transformers' generate() from the same seed, that every decode step's logits equal one
    uncached forward pass, that shared_logits gives grpo.token_logprobs' log-probs and gradient
    within float tolerance, and draw_by_inverse_cdf against a slow walk, token for token.

What it buys, measured (docs/speed.md, the 2-core Intel Xeon CPU, torch 2.13): the quick start
(`python train_gsm8k.py`) took a median of 1.43 s a step with it and 2.09 s with --plain (the same
samples and rewards at every step, the same accuracy); at hidden 256, a training forward and
backward of 8 rows of 54 + 32 tokens took 114 ms with each prompt scored once against 182 ms
without; compiled decoding saved 0.4 to 1.6 ms a decode step, which pays from about 100,000
decode steps a run (AUTO_COMPILE_DECODE_STEPS). benchmarks/vs_trl.py runs with it against TRL
(docs/speed.md gives it with --compile off and --no-share-prompts too).

Shapes: B prompts, G completions per prompt, N = B*G, P prompt tokens, T completion tokens,
V vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import sys
import weakref

from dataclasses import dataclass, replace
from typing import Literal

import torch

import grpo
from machinery import lora


@dataclass
class EngineConfig:
    """The speed machinery's switches (train_gsm8k.py --help shows them in their own section).
    None changes the distribution sampled from or the numbers scored, beyond float rounding."""

    compile: str = "auto"
    """torch.compile for sampling and layers: on, off, auto (on where it pays: docs/speed.md);
    it sets sampler (sampler_for)."""
    sampler: Literal["engine", "compiled", "plain"] = "engine"
    """'engine': decode below (one prefill per prompt, inference mode, a ready mask); 'compiled':
    the same with a static KV cache and the decode step under torch.compile; 'plain': grpo.decode.
    All three draw the same tokens from the same seed (tests/test_engine.py)."""
    share_prompts: bool = True
    """Score each distinct prompt once and its G completions after it (shared_logits), not G whole
    sequences: the same log-probs and gradient to float rounding, less compute. Not with
    --logprob-chunk, nor in a checkpointed training pass (there it scores whole sequences)."""
    sample_batch_size: int = 0
    """Sample at most this many completions at a time (in_batches), so the KV cache holds only
    theirs; other draws from the same seed, the same distribution. 0: all N at once."""
    merge_adapters: bool = True
    """With LoRA: sample from the adapters merged into the weights (lora.merged_weights), one
    product a layer, not PEFT's three; the base weights are put back untouched after each call.
    The same distribution, the same tokens to float rounding (docs/real_model.md: what it buys)."""
    skip_pads: bool = False
    """With share_prompts: the output layer and the log-softmax only at completion tokens, not at
    the pads after each EOS (shared_token_logprobs): the same log-probs at every token to float
    rounding, 0 at the pads, which every loss term masks. What it saves: the pads' share of the
    (N, T, V) output-layer passes of a step and what follows them (docs/real_model.md). Not with
    --logprob-chunk, whose scorer replaces this one."""
    draw: Literal["multinomial", "inverse-cdf"] = "multinomial"
    """How a token is drawn from grpo.draw_tokens's distribution: 'multinomial', torch.multinomial
    as grpo.py draws it (the same tokens as --plain); 'inverse-cdf', one uniform number a row
    against the cumulative probabilities (draw_by_inverse_cdf): the same distribution, other
    draws from the same seed, and N random numbers a token, not N x V (docs/real_model.md)."""
    min_new_tokens: int = 0
    """Force at least this many new tokens (0 = off). Only for benchmarks that need equal work
    (benchmarks/vs_trl.py sets it to max_new_tokens on both sides). It changes the distribution."""

    def __post_init__(self):
        if self.draw not in ("multinomial", "inverse-cdf"):
            raise ValueError(f"draw must be 'multinomial' or 'inverse-cdf', got {self.draw!r}")
        if self.sampler not in ("engine", "compiled", "plain"):
            raise ValueError(f"sampler must be one of ('engine', 'compiled', 'plain'), got "
                             f"{self.sampler!r}")
        for name in ("sample_batch_size", "min_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def apply(cfg: EngineConfig, seams: grpo.Seams, eos_ids: list[int], pad_id: int) -> grpo.Seams:
    """`seams` with this file's sampler (cfg.sampler, in batches, with the EOS floor) and, with
    cfg.share_prompts, its scorer. eos_ids and pad_id: grpo.eos_token_ids and grpo.pad_token_id."""
    sample = {"engine": decode, "compiled": decode_compiled, "plain": grpo.decode}[cfg.sampler]
    if cfg.min_new_tokens:
        sample = at_least(sample, cfg.min_new_tokens, eos_ids)
    sample = in_batches(sample, cfg.sample_batch_size, pad_id)
    if cfg.draw == "inverse-cdf":
        sample = drawn_by_inverse_cdf(sample)
    if cfg.merge_adapters:  # NOTE: outermost, so that a step merges once for all its batches
        sample = lora.sample_merged(sample)
    score = seams.score
    if cfg.share_prompts:
        score = functools.partial(shared_token_logprobs, skip_pads=cfg.skip_pads)
    return replace(seams, sample=sample, score=score)


def base_model(model):
    """The transformers model inside a wrapper that exposes it (a PEFT model, lora.AdaptersOff),
    or `model` itself: its config and forward signature are the ones to probe."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ----------------------------------------------------------------------------------------------
# transformers plumbing: version probes, EOS and pad ids
# ----------------------------------------------------------------------------------------------
def accepts_logits_to_keep(model) -> bool:
    """Whether forward() can skip computing logits for all but the last positions.
    NOTE: a PEFT model's forward takes **kwargs and hands them on; its base model's decides."""
    return "logits_to_keep" in inspect.signature(base_model(model).forward).parameters


def last_logits_only(model, k: int) -> dict:
    """forward() keyword arguments that compute logits for the last `k` positions only, if it can.
    WHY (memory): a (n, P, V) block of prompt logits is never read, and at Qwen's 151,936-token
    vocabulary it is large."""
    return {"logits_to_keep": k} if accepts_logits_to_keep(model) else {}


@functools.cache
def transformers_major() -> int:
    """transformers' major version. WHY cached: a metadata lookup takes ~2 ms."""
    return int(importlib.metadata.version("transformers").split(".")[0])


def sdpa_full_attention(model) -> bool:
    """True when every layer runs PyTorch's SDPA kernel with full (not sliding-window) attention,
    under transformers 5, whose mask code hands a ready 4D mask to the kernel unchanged (4.x is
    not tested)."""
    c = model.config
    layer_types = getattr(c, "layer_types", None) or ["full_attention"]
    return (transformers_major() >= 5
            and getattr(c, "_attn_implementation", None) == "sdpa"
            and getattr(c, "sliding_window", None) is None
            and all(kind == "full_attention" for kind in layer_types))


def cache_kwarg(model) -> str:
    """forward()'s KV-cache argument: `cache` in transformers 5, `past_key_values` in 4.x.
    NOTE: a PEFT model's forward takes **kwargs and hands them on; its base model's decides."""
    params = inspect.signature(base_model(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def enable_activation_checkpointing(model, enabled: bool = True):
    """Recompute activations in backward to save memory, and turn the training forward's KV cache
    off (nothing when not enabled). NOTE: transformers 5 renamed gradient_checkpointing_enable to
    activation_checkpointing_enable; 4.x has the old name only."""
    if not enabled:
        return
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.config.use_cache = False


def checkpointed(model) -> bool:
    """Whether the model recomputes activations in backward (transformers 5 renamed the flag)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


# ----------------------------------------------------------------------------------------------
# The fast decode loop
# ----------------------------------------------------------------------------------------------
def decode(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
           max_new_tokens: int, pick):
    """G completions for each of B left-padded prompts: (B, P), (B, P) -> (completion ids, the
    sampler's log-prob of each), (N, T) each, T <= max_new_tokens.

    pick(logits (N, V), t, done (N,)) -> (ids (N,), done (N,), log-probs (N,)) draws token t:
    grpo.draw_tokens. Same contract as grpo.decode, which it matches token for token
    (tests/test_engine.py).
    """
    G, T = group_size, max_new_tokens
    kv_name = cache_kwarg(model)
    sdpa = sdpa_full_attention(model)
    # WHY (speed): inference_mode skips autograd's bookkeeping (version counters, views) on every
    #      op, which counts when a small model's time is per-op overhead. Its tensors cannot be
    #      saved for backward, so the ids are stacked after the block, as ordinary tensors.
    #      Under autocast, no_grad instead (sampling_mode).
    with sampling_mode(prompt_ids.device.type):
        empty = in_place_cache(model, prompt_ids.shape[1] + T)
        out, logits, prompt_mask, next_position = prefill(model, prompt_ids, prompt_mask, G,
                                                          empty)
        cache = out[kv_name]
        cache.batch_repeat_interleave(G)                                      # (B, ...) -> (N, ...)
        N, P = prompt_mask.shape
        # WHY (speed): one mask for the whole loop, sliced each step, not a new column per token.
        #      Every generated column counts as real: a finished row only goes on to make pads.
        seen = torch.cat([prompt_mask, prompt_mask.new_ones(N, T)], dim=1)       # (N, P+T)
        # WHY (speed): for one new token under SDPA the mask is just "every real token so far", so a
        #      ready 4D view skips transformers' per-token mask building. Eager attention, flash
        #      attention and sliding windows get the plain 2D mask.
        if sdpa:
            seen = seen.bool()                                                   # (N, P+T)

        def step(next_ids, t):
            # Decode: feed only the new token; the KV cache holds everything before it.
            mask = seen[:, :P + t + 1]                                           # (N, P+t+1)
            if sdpa:
                mask = mask[:, None, None, :]                                    # (N, 1, 1, P+t+1)
            out = model(input_ids=next_ids[:, None], attention_mask=mask,       # (N, 1)
                        position_ids=next_position + t, use_cache=True, **{kv_name: cache})
            return out.logits[:, -1, :].float()                                  # (N, V)

        tokens, logps = draw_loop(pick, logits, T, step)
    return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)                 # (N, T) x2


def sampling_mode(device_type: str):
    """The no-gradient mode decode() samples in: torch.inference_mode, or torch.no_grad under
    autocast. WHY: inside inference_mode autocast keeps no bf16 copy of a weight, so every decoded
    token would cast every fp32 Linear weight to bf16 again; under no_grad it casts each once for
    the whole decode (the autocast region precision.autocast_seams opens around it ends with it,
    and its copies with it). The same casts, so the same tokens (tests/test_precision.py). On the
    2-core AMD EPYC CPU (gpu_check.py bf16-sampling, benchmarks/results/bf16/) a decoded token
    took 140 against 168 ms at SmolLM2-135M's architecture (G=8 x 4), 194 against 300 at
    Qwen2.5-0.5B's; at the tiny world's 0.14 M parameters, 5.6 against 5.4 (autograd's
    bookkeeping, which inference_mode skips, costs more there than the casts).
    NOTE: the copies cost 2 bytes a Linear weight while sampling: planner.py's "autocast copies"."""
    if torch.is_autocast_enabled(device_type):
        return torch.no_grad()
    return torch.inference_mode()


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, G: int, cache=None):
    """One forward over B left-padded prompts (B, P), their KV cache kept (in `cache`, if given):
    (the model's output, next-token logits repeated G times (N, V), the prompt mask repeated
    (N, P), and each row's position for its first new token (N, 1)). Both decode loops start
    here, in inference mode.
    WHY (speed): the G copies of a prompt would compute the same keys and values G times; compute
    them once; the caller repeats the KV cache G times."""
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True,
                # WHY: number positions from each prompt's first real token, as generate() does.
                position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),           # (B, P)
                **last_logits_only(model, 1),
                **({} if cache is None else {cache_kwarg(model): cache}))
    logits = out.logits[:, -1, :].float().repeat_interleave(G, 0)                # (N, V)
    prompt_mask = prompt_mask.repeat_interleave(G, 0)                            # (N, P)
    next_position = (prompt_mask.sum(1, keepdim=True) - 1).clamp(min=0) + 1      # (N, 1)
    return out, logits, prompt_mask, next_position


def in_place_cache(model, length: int):
    """An empty KV cache whose layers each fill one buffer of `length` positions as tokens come,
    instead of making a new, one-longer copy of their keys and values at every token; None where
    the model's cache is not made of transformers 5's DynamicLayers (sliding windows, 4.x).
    Attention reads the same numbers (views of the buffer).
    WHY (memory, speed): growing by torch.cat copies the whole cache at every token, and on a CPU
    glibc keeps the freed copies: a greedy batch of 64 GSM8K prompts (170 + 320 tokens) on
    SmolLM2-135M peaked 2.6 GB over the weights for a 1.3 GB cache (docs/real_model.md)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # NOTE: transformers 4 takes no config here
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    for layer in layers:
        layer.__class__, layer.length = in_place_layer(), length
    return cache


@functools.cache
def in_place_layer():
    """The class of in_place_cache's layers, made on first use (transformers is imported late)."""
    from transformers.cache_utils import DynamicLayer

    class InPlaceLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are the first `filled` positions of one buffer of
        `length` positions, allocated at its first update."""

        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            N, H, _, D = key_states.shape
            self.buffers = [x.new_empty(N, H, self.length, D) for x in (key_states, value_states)]
            self.filled = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            f, new = self.filled, key_states.shape[-2]
            if f + new > self.length:  # NOTE: longer than planned: grow by copies from here on
                self.__class__ = DynamicLayer
                return DynamicLayer.update(self, key_states, value_states, *args, **kwargs)
            for buf, x in zip(self.buffers, (key_states, value_states)):
                buf[:, :, f:f + new] = x                                         # (N, H, new, D)
            self.filled = f + new
            self.keys, self.values = (b[:, :, :f + new] for b in self.buffers)  # (N, H, f+new, D)
            return self.keys, self.values

        def batch_repeat_interleave(self, repeats: int):
            if repeats == 1 or not self.filled:
                return
            f, old = self.filled, self.buffers
            B, H, L, D = old[0].shape
            self.buffers = [b.new_empty(B * repeats, H, L, D) for b in old]
            for buf, b in zip(self.buffers, old):  # WHY a broadcast: no (N, H, f, D) temporary
                buf.view(B, repeats, H, L, D)[:, :, :, :f] = b[:, None, :, :f]
            self.keys, self.values = (b[:, :, :f] for b in self.buffers)         # (N, H, f, D)

    return InPlaceLayer


def draw_loop(pick, logits: torch.Tensor, T: int, step):
    """Up to T tokens for every row: draw one from logits (N, V) with pick, then step(ids (N,), t)
    gives the next logits; stop once every row has ended. Returns the T' <= T drawn (N,) ids and
    their (N,) log-probs."""
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)  # (N,)
    tokens, logps = [], []
    for t in range(T):
        next_ids, done, logp = pick(logits, t, done)                             # (N,) x3
        tokens.append(next_ids)
        logps.append(logp)
        if done.all() or t == T - 1:
            break
        logits = step(next_ids, t)                                               # (N, V)
    return tokens, logps


def draw_by_inverse_cdf(logits, t, done, *, eos, pad_id, temperature, greedy):
    """grpo.draw_tokens, its random draw made by inverse transform: the same contract, the same
    distribution, other tokens from the same seed. Row i draws u ~ U[0, 1) and takes the first
    token whose cumulative probability exceeds u: softmax(logits / temperature), float64 sums.
    WHY (speed): torch.multinomial draws one exponential number for every token of the vocabulary
         (an (N, V) exponential_): at SmolLM2's 49,152 tokens, 10% of the smollm2-135m preset's
         step under torch.profiler (docs/real_model.md). This draws N numbers.
    NOTE: float64 cumulative sums, so no token is lost to rounding (float32 sums near 1 drop any
          p under ~6e-8); right=True, so a zero-probability token is never drawn."""
    if greedy:
        return grpo.draw_tokens(logits, t, done, eos=eos, pad_id=pad_id,
                                temperature=temperature, greedy=True)
    scaled = logits / temperature                                                # (N, V)
    log_z = scaled.logsumexp(-1, keepdim=True)                                   # (N, 1)
    cdf = (scaled - log_z).exp().cumsum(-1, dtype=torch.float64)                 # (N, V)
    u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device)      # (N, 1)
    # WHY the last column, not 1: the sums' own total, so u never falls past the last token.
    next_ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)   # (N,)
    next_ids = next_ids.clamp(max=cdf.shape[1] - 1)                              # (N,)
    next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)    # (N,)
    logp = scaled.gather(-1, next_ids[:, None]).squeeze(1) - log_z.squeeze(1)    # (N,)
    return next_ids, done | torch.isin(next_ids, eos), logp                      # (N,) x3


def drawn_by_inverse_cdf(sample):
    """`sample` (grpo.Seams.sample's signature), its `pick` (grpo.draw_tokens with the arguments
    grpo.sample_completions bound) swapped for draw_by_inverse_cdf with the same arguments."""
    def sampled(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, pick):
        if getattr(pick, "func", None) is not grpo.draw_tokens:
            raise TypeError("--draw inverse-cdf replaces grpo.draw_tokens; this sampler was handed "
                            f"{pick!r}")
        pick = functools.partial(draw_by_inverse_cdf, **pick.keywords)
        return sample(model, prompt_ids, prompt_mask, group_size, max_new_tokens, pick)
    return sampled


# ----------------------------------------------------------------------------------------------
# The compiled decode loop: a static KV cache, and the per-token step under torch.compile
# ----------------------------------------------------------------------------------------------
# WHY: at small sizes a decode step's time is per-op framework overhead (Python, dispatch, kernel
#      launches), not arithmetic. torch.compile fuses the step into a few kernels, and on CUDA
#      replays it as one CUDA graph (mode="reduce-overhead"), as gpt-fast does. Both need every
#      shape fixed from one token to the next, which a growing KV cache is not: so the cache is
#      transformers' StaticCache, allocated once at (N, heads, L, head_dim) and written in place.
PROMPT_BUCKET = 64
"""Prompt widths are rounded up to a multiple of this, so prompt lengths that vary from step to
step map to a few cache shapes, each compiled once (tests/test_engine.py)."""
RECOMPILE_LIMIT = 64
"""Compiled shapes (model x batch size x cache width) per process before decoding stays eager."""
_caches = weakref.WeakKeyDictionary()  # model -> {shape key: StaticCache}, reused across steps
_warned = set()                        # reasons for falling back, each printed once
_failed = weakref.WeakKeyDictionary()  # model -> why compiling it failed: not tried again


@functools.cache
def static_cache_api_blocker() -> str | None:
    """Why this transformers' StaticCache is not the one _decode_compiled writes into, or None.
    WHY: it fills the cache's layers by hand, through two internals (lazy_initialization(keys,
    values) and the cumulative_length counter); a version where they differ would fail at the
    first token, 10 to 20 times slower a token from then on, so it is named when the run starts."""
    import transformers
    from transformers.cache_utils import StaticLayer
    init = getattr(StaticLayer, "lazy_initialization", None)
    params = list(inspect.signature(init).parameters)[1:] if init else []
    if params != ["key_states", "value_states"]:
        return (f"transformers {transformers.__version__}'s StaticLayer.lazy_initialization takes "
                f"{params}, not (key_states, value_states)")
    if "cumulative_length" not in inspect.getsource(StaticLayer):
        return f"transformers {transformers.__version__}'s StaticLayer keeps no cumulative_length"
    return None


def compile_blocker(model) -> str | None:
    """Why compiled decoding cannot run on this model, or None if it can."""
    c = model.config
    if transformers_major() < 5 or cache_kwarg(model) != "cache":
        return "it needs transformers 5's StaticCache"
    if (api := static_cache_api_blocker()) is not None:
        return api
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not declare torch.compile support"
    layer_types = getattr(c, "layer_types", None) or ["full_attention"]
    if getattr(c, "sliding_window", None) is not None or set(layer_types) != {"full_attention"}:
        return "sliding-window attention keeps a rolling cache, which the slot layout here is not"
    return None


def _decode_step(model, cache, ids, mask, positions):
    """One token for every row: ids (N, 1) -> next-token logits (N, V). The compiled unit."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True)
    return out.logits[:, -1, :].float()                                          # (N, V)


@functools.cache
def compiled_step(device_type: str):
    """_decode_step under torch.compile; on CUDA replayed as a CUDA graph."""
    # NOTE: dynamic=False: every shape is fixed by construction (static cache, bucketed prompts),
    #       so one graph per shape is right, and no symbolic-shape guards are paid per call.
    mode = "reduce-overhead" if device_type == "cuda" else None
    return torch.compile(_decode_step, dynamic=False, mode=mode)


def static_cache(model, N: int, P: int, T: int, like: torch.Tensor):
    """(the model's StaticCache for N rows, Pb): prompts are left-padded to Pb >= P slots, then T
    slots follow. Made once and reused while prompts fit; replaced, wider, when one does not.
    WHY reused: a new cache shape means a new compile, and CUDA graphs replay on fixed addresses.
    WHY grow-only: after the longest prompt has been seen, no later step compiles again."""
    from transformers import StaticCache
    caches = _caches.setdefault(model, {})
    key = (N, T, like.dtype, like.device)
    if key not in caches or caches[key][1] < P:
        Pb = -(-P // PROMPT_BUCKET) * PROMPT_BUCKET                # P rounded up to the bucket
        caches[key] = StaticCache(config=model.config, max_cache_len=Pb + T), Pb
    return caches[key]


def decode_compiled(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                    max_new_tokens: int, pick):
    """decode() with a static KV cache and a compiled decode step; same contract, same tokens
    (tests/test_engine.py). Falls back to decode(), with the reason printed once, where it cannot
    run: see compile_blocker, and any error while compiling (no C++ compiler, an unsupported op),
    after which that model is not tried again.
    """
    reason = _failed.get(model) or compile_blocker(model)
    if reason is None:
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if prompt_ids.is_cuda else None
        try:
            return _decode_compiled(model, prompt_ids, prompt_mask, group_size, max_new_tokens,
                                    pick)
        except Exception as e:  # noqa: BLE001 -- any failure to compile means: run eagerly
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            # WHY: a failed compile costs seconds; retrying it at every step would repeat that.
            _failed[model] = reason
            # WHY: the failed attempt may have drawn tokens; rewind so the seed's draws repeat.
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
    if reason not in _warned:
        _warned.add(reason)
        print(f"NOTE: compiled decoding is off ({reason}); using the eager KV-cache loop",
              file=sys.stderr)
    return decode(model, prompt_ids, prompt_mask, group_size, max_new_tokens, pick)


def sampler_used(model, configured: str) -> dict:
    """Which decode loop sampled for `model` so far: {"configured": EngineConfig.sampler,
    "used": "compiled", "engine" (eager) or "plain", "fallback": why compiled decoding fell back
    to the eager loop, or None}. summary.json and the run's first step line carry it."""
    reason = (_failed.get(model) or compile_blocker(model)) if configured == "compiled" else None
    return {"configured": configured, "used": "engine" if reason else configured,
            "fallback": reason}


def sampler_line(used: dict) -> str:
    """sampler_used's dict in words: 'compiled', 'eager (engine)', 'eager (plain)', or 'eager
    (engine): compiled decoding fell back: <why>'."""
    if used["used"] == "compiled":
        return "compiled"
    why = f": compiled decoding fell back: {used['fallback']}" if used["fallback"] else ""
    return f"eager ({used['used']}){why}"


def _decode_compiled(model, prompt_ids, prompt_mask, group_size, max_new_tokens, pick):
    G, T = group_size, max_new_tokens
    B, P = prompt_ids.shape
    N = B * G
    step = compiled_step(prompt_ids.device.type)
    cuda_graphs = prompt_ids.is_cuda
    with torch.inference_mode():
        # Prefill eagerly, exactly as decode() does. WHY eager: prompt lengths vary, and a prefill
        # is one call per step, so compiling it would not pay.
        out, logits, prompt_mask, next_position = prefill(model, prompt_ids, prompt_mask, G)
        # Copy the prompt's keys and values into slots Pb-P .. Pb-1 of the static cache; the slots
        # before them stay zero and masked: extra left padding, which changes no logit.
        prefilled = out["cache"].layers
        cache, Pb = static_cache(model, N, P, T, prefilled[0].keys)     # Pb >= P prompt slots
        for layer, filled in zip(cache.layers, prefilled):
            k = filled.keys.repeat_interleave(G, 0)                              # (N, H, P, D)
            v = filled.values.repeat_interleave(G, 0)                            # (N, H, P, D)
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys.zero_()
            layer.values.zero_()
            layer.keys[:, :, Pb - P:Pb].copy_(k)
            layer.values[:, :, Pb - P:Pb].copy_(v)
            layer.cumulative_length.fill_(Pb)  # WHY: token t is written to slot Pb + t
        seen = torch.zeros(N, Pb + T, dtype=torch.bool, device=prompt_ids.device)  # (N, L)
        seen[:, Pb - P:Pb] = prompt_mask.bool()
        # WHY: one fixed-shape mask for the whole loop, a column switched on per token: a ready 4D
        #      view under SDPA (as in decode), the 2D mask for other attention kernels.
        mask = seen[:, None, None, :] if sdpa_full_attention(model) else seen    # (N, 1, 1, L)

        def one_token(next_ids, t):
            seen[:, Pb + t] = True
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            # WHY (speed): after two calls with the same shapes (the first may compile), dynamo's
            #      per-call guard evaluation, ~20% of a tiny model's step, is skipped: nothing it
            #      checks can change inside this loop.
            # WHY the limit: dynamo stops compiling a function after 8 shapes by default; here
            #      each model, batch size and cache width is one, and a process may train several.
            with (torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if t >= 2
                  else torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)):
                logits = step(model, cache, next_ids[:, None], mask, next_position + t)  # (N, V)
            # WHY: under CUDA graphs the next replay overwrites the graph's output.
            return logits.clone() if cuda_graphs else logits

        tokens, logps = draw_loop(pick, logits, T, one_token)
    return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)                 # (N, T) x2


def compile_seconds() -> float:
    """Wall seconds torch.compile has spent in this process so far, by dynamo's own timers: the
    tracing and code generation of each graph, and of each backward graph at its first use.
    benchmarks/vs_trl.py reports it as ours_compile_s. 0.0 where this torch keeps no such timers.
    """
    try:
        from torch._dynamo.utils import compilation_time_metrics as spent
    except ImportError:
        return 0.0
    return sum(sum(spent.get(k, [])) for k in ("_compile.compile_inner", "backward._backward_impl"))


def compile_layers(cfg: EngineConfig, update_in_backward: bool, *models) -> int:
    """With the 'compiled' sampler, also compile each model's decoder layers (regional
    compilation: one graph serves every layer of a model, forward and backward), so the training
    and reference passes run fused kernels too. Returns how many layers it compiled: none under
    cfg.share_prompts or update_in_backward (memory.py; the WHYs below).
    WHY dynamic=True: training sequences change length every step; one graph takes them all.
    NOTE: loss and gradients match eager within float tolerance (tests/test_engine.py)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    if cfg.sampler != "compiled":
        return 0
    if cfg.share_prompts:
        # WHY: scoring each prompt once hands the layers a KV cache, and a compiled layer then
        #      compiles again for each layer index and cache state (torch 2.13), past dynamo's
        #      limit. Eager layers with shared prompts were as fast as compiled ones without at
        #      hidden 64 and faster at hidden 256 (115 against 163 ms a training forward and
        #      backward, docs/speed.md).
        return 0
    if update_in_backward:
        # WHY: memory.step_in_backward runs backward twice over one graph. A compiled layer's
        #      backward refuses that (it reuses the buffers it saved), and with that reuse turned
        #      off its second pass gave wrong gradients for some weights here (torch 2.13, CPU;
        #      tests/test_engine.py). Decoding is still compiled; the layers stay eager.
        return 0
    # WHY a dict: lora.AdaptersOff(policy) as π_ref has the policy's own layers; each is compiled
    #      once.
    layers = list({id(m): m for model in models if model is not None for m in model.modules()
                   if isinstance(m, GradientCheckpointingLayer)}.values())
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


# ----------------------------------------------------------------------------------------------
# Scoring: one forward per distinct prompt
# ----------------------------------------------------------------------------------------------
# WHY (speed, memory): grpo.token_logprobs scores the G completions of a prompt as G whole
#      sequences, prompt included, so the prompt's layers run G times, forward and backward. Here
#      they run once per distinct prompt: its keys and values (with their autograd history) are
#      repeated G times, and only the completions run per row, the way prefill() serves sampling.
#      Autograd sums the G rows' gradients into the one prompt pass: the same gradient, summed in
#      another order (tests/test_engine.py). At hidden 256 this cut a training forward and
#      backward of 8 rows of 54 + 32 tokens from 182 to 114 ms (docs/speed.md).
def share_blocker(model) -> str | None:
    """Why shared_logits cannot run on this model, or None if it can."""
    base = base_model(model)  # NOTE: a LoRA π_ref (lora.AdaptersOff) unwraps to the policy's base
    c = base.config
    layer_types = getattr(c, "layer_types", None) or ["full_attention"]
    if transformers_major() < 5 or cache_kwarg(base) != "cache":
        return "it needs transformers 5's cache API"
    if getattr(c, "sliding_window", None) is not None or set(layer_types) != {"full_attention"}:
        return "a sliding-window cache drops keys a training forward still needs"
    # WHY: checkpointed layers drop the KV cache (a recompute in backward would write it twice),
    #      and with it the prompt this path hands them.
    if torch.is_grad_enabled() and base.training and checkpointed(base):
        return "gradient checkpointing drops the KV cache in training"
    return None


def shared_logits(model, input_ids, attention_mask, T: int, keep=None):
    """The logits that predict each of the last T tokens, (n, T, V), as grpo.token_logprobs' one
    forward over (n, P+T) left-padded prompts and completions computes them, but with each
    distinct prompt run once; None where that would not help (no prompt repeats) or cannot run
    (share_blocker). Rows share a prompt when they are neighbours with equal prompt ids and masks,
    as sample_completions lays out a group. keep (n, T) bool: only the logits where it is True,
    (k, V) in row-major order (output_layer_at)."""
    P = input_ids.shape[1] - T
    prompt_ids, prompt_mask = input_ids[:, :P], attention_mask[:, :P]                # (n, P)
    new = torch.ones(len(input_ids), dtype=torch.bool, device=input_ids.device)      # (n,)
    new[1:] = ((prompt_ids[1:] != prompt_ids[:-1]) | (prompt_mask[1:] != prompt_mask[:-1])).any(1)
    if new.all() or P < 2 or share_blocker(model) is not None:
        return None
    first = new.nonzero().squeeze(1)                                  # (u,) a row per prompt
    # Each distinct prompt but its last token, once: only its KV cache is kept.
    # WHY not the last token too: its logit (the first token's) would then come from another
    #      output-layer call than the rest, whose rounding differs between a policy whose weights
    #      need gradients and a frozen π_ref (torch's matmul takes another path): at step 1 their
    #      log-probs must be equal bit for bit, or the KL term's gradient is not exactly 0.
    mask = prompt_mask[first, :-1]                                                   # (u, P-1)
    out = model(input_ids=prompt_ids[first, :-1], attention_mask=mask, use_cache=True,
                # NOTE: positions count from each prompt's first real token, as in sampling.
                position_ids=(mask.cumsum(1) - 1).clamp(min=0), **last_logits_only(model, 1))
    cache = out["cache"]
    cache.batch_select_indices(new.cumsum(0) - 1)  # NOTE: differentiable: a copy for each row
    # Then per row: the prompt's last token and the completion but its last (which predicts
    # nothing), after the cached prompt.
    seen = attention_mask[:, :-1]                                                    # (n, P+T-1)
    positions = (seen.cumsum(1) - 1).clamp(min=0)[:, P - 1:]                         # (n, T)
    with output_layer_at(model, keep):
        return model(input_ids=input_ids[:, P - 1:-1], attention_mask=seen, use_cache=True,
                     position_ids=positions, cache=cache).logits          # (n, T, V) or (k, V)


@contextlib.contextmanager
def output_layer_at(model, keep):
    """Inside: the model's output layer reads only the positions where keep (n, T) is True, so a
    forward over (n, T) tokens returns logits (k, V), k = keep.sum(), in row-major order. keep
    None: every position, as outside.
    WHY a hook on the output layer: the transformer still runs every position (attention needs
    them), but the (n, T, V) product and what follows it are most of a small model's pass at a
    49,152-token vocabulary; a LoRA π_ref (lora.AdaptersOff) shares the policy's output layer."""
    if keep is None:
        yield
        return
    head = base_model(model).get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _, args: (args[0][keep],))      # (k, H)
    try:
        yield
    finally:
        hook.remove()


def shared_token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                          temperature: float = 1.0, with_entropy: bool = False, *,
                          skip_pads: bool = False):
    """grpo.token_logprobs with each distinct prompt run once (shared_logits): the same arguments,
    the same results to float rounding. Where shared_logits steps aside, grpo.token_logprobs runs.
    (n, P), (n, T) -> logp (n, T) [, entropy (n, T)]. skip_pads: the output layer and the
    log-softmax only where completion_mask is 1; logp and entropy are 0 at the pads."""
    T = completion_ids.shape[1]
    input_ids, attention_mask, _ = grpo.joined_sequences(prompt_ids, prompt_mask, completion_ids,
                                                         completion_mask)             # (n, P+T)
    keep = completion_mask.bool() if skip_pads else None                          # (n, T) or None
    logits = shared_logits(model, input_ids, attention_mask, T, keep)       # (n|k, [T,] V) or None
    if logits is None:
        return grpo.token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                   temperature, with_entropy)
    if keep is None:
        return grpo.logprobs_of(logits, completion_ids, temperature, with_entropy)
    # One completion at a time, as grpo.logprobs_of would see it unpadded: (1, |o_i|, V) each.
    counts = keep.sum(1).tolist()
    logps, entropies = [], []
    for rows, ids in zip(logits.split(counts), completion_ids[keep].split(counts)):
        scored = grpo.logprobs_of(rows[None], ids[None], temperature, with_entropy)  # (1, |o_i|)
        if with_entropy:
            logps.append(scored[0])
            entropies.append(scored[1])
        else:
            logps.append(scored)
    logp = padded(keep, logps)                                                    # (n, T)
    return (logp, padded(keep, entropies)) if with_entropy else logp


def padded(keep, pieces):
    """One (1, |o_i|) piece a row, in order -> (n, T), the pieces where keep (n, T) is True, 0
    elsewhere (the pads)."""
    zeros = torch.zeros(keep.shape, dtype=pieces[0].dtype, device=keep.device)      # (n, T)
    return zeros.masked_scatter(keep, torch.cat(pieces, dim=1))                      # (n, T)


AUTO_COMPILE_DECODE_STEPS = 100_000
"""--compile auto turns compiling on from this many decode steps in a run (steps x max_new_tokens).
Measured on a 2-core CPU (docs/speed.md): the quick start (5,760 decode steps) ran 37 s slower
end to end with compiling on, from cold caches, so compiling costs about 40 s up front at that
size, and it saved 0.4 to 1.6 ms per decode step in two runs of gpu_check.py speed: it pays from
25,000 to 100,000 decode steps. auto takes the upper end."""


def sampler_for(compile_mode: str, sampler: str, decode_steps: int) -> str:
    """EngineConfig.sampler for a run: 'compiled' in place of the default 'engine' when
    --compile is on, or auto with at least AUTO_COMPILE_DECODE_STEPS decode steps ahead; 'engine'
    in place of 'compiled' when it is off (a resumed run can turn it off). 'plain' stays."""
    if compile_mode == "off":
        return "engine" if sampler == "compiled" else sampler
    on = compile_mode == "on" or decode_steps >= AUTO_COMPILE_DECODE_STEPS
    return "compiled" if on and sampler == "engine" else sampler


def at_least(decode, min_new_tokens: int, eos_ids: list[int]):
    """`decode` in which no row may draw an EOS before token `min_new_tokens` (benchmarks that need
    equal work on both sides). NOTE: this changes the distribution sampled from; grpo.py's loss
    still scores the unmasked one, so use it for timing, never for training."""
    def floored(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, pick):
        def pick_later_eos(logits, t, done):
            if t < min_new_tokens:
                logits[:, eos_ids] = -float("inf")                                   # (N, V)
            return pick(logits, t, done)
        return decode(model, prompt_ids, prompt_mask, group_size, max_new_tokens, pick_later_eos)
    return floored


def in_batches(decode, rows: int, pad_id: int):
    """`decode`, run on at most `rows` completions at a time (0: all at once): whole prompts'
    groups while a group fits, else each group in pieces. The pieces' completions are padded with
    pad_id (their log-probs with 0) to the longest and stacked in order, so the rows still come in
    groups. Same contract as grpo.decode.
    WHY: the KV cache grows with the rows decoded together; at 7B, 64 completions of 768 tokens
         hold 24 GB of it (planner.py). NOTE: the draws differ from one batch from the same seed
         (the random numbers fall to other rows), but each row is drawn from the same policy."""
    def batched(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, pick):
        B, G = prompt_ids.shape[0], group_size
        if not rows or B * G <= rows:
            return decode(model, prompt_ids, prompt_mask, G, max_new_tokens, pick)
        per = max(1, rows // G)                              # whole prompts in one piece
        pieces = [decode(model, prompt_ids[b:b + per], prompt_mask[b:b + per], g,
                         max_new_tokens, pick)                                        # (n, T_i) x2
                  for b in range(0, B, per)
                  for g in ([G] if G <= rows else [min(rows, G - k) for k in range(0, G, rows)])]
        T = max(ids.shape[1] for ids, _ in pieces)

        def pad(x, value):
            return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)      # (n, T)
        return (torch.cat([pad(ids, pad_id) for ids, _ in pieces]),                  # (N, T)
                torch.cat([pad(logp, 0.0) for _, logp in pieces]))                    # (N, T)
    return batched
