"""
engine.py -- the fast sampling path behind grpo.sample_completions.

What this is
    grpo.py keeps a short reference sampler (grpo.reference_decode) that shows the whole loop: run
    the model over the sequence, draw a token, append it, stop at EOS. This file makes the same
    draws faster, the way nanochat's engine.py sits beside its chat_rl.py:
      - a KV cache, so each new token costs one position, not the whole sequence;
      - one prefill per distinct prompt, its KV cache then repeated G times;
      - torch.inference_mode, and only the last position's logits at prefill;
      - under PyTorch's SDPA kernel, a ready 4D padding mask, so transformers does not rebuild a
        causal mask at every token;
      - the transformers-version probes that all this needs.
    The distribution is not defined here: `pick` is grpo.draw_tokens (temperature, greedy, the EOS
    floor), handed in by grpo.sample_completions. tests/test_engine.py checks that decode draws
    exactly the tokens of grpo.reference_decode and of transformers' generate() from the same seed,
    and that every decode step's logits equal one uncached forward pass.

Shapes: B prompts, G completions per prompt, N = B*G, P prompt tokens, T completion tokens,
V vocabulary.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect

import torch


# ----------------------------------------------------------------------------------------------
# transformers plumbing: version probes, EOS and pad ids
# ----------------------------------------------------------------------------------------------
def accepts_logits_to_keep(model) -> bool:
    """Whether forward() can skip computing logits for all but the last positions."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


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
    """forward()'s KV-cache argument: `cache` in transformers 5, `past_key_values` in 4.x."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion: the model's generation_config eos ids, else the
    tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        # NOTE: a freshly initialised model's generation_config has no eos/pad/bos ids.
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("neither the model's generation_config nor the tokenizer has an EOS id")
    return [eos] if isinstance(eos, int) else list(eos)


def pad_token_id(model, tokenizer) -> int:
    """The id written after a completion's EOS: the tokenizer's pad token, else the first EOS id."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else eos_token_ids(model, tokenizer)[0]


def enable_activation_checkpointing(model):
    """Recompute activations in backward to save memory, and turn the training forward's KV cache
    off. NOTE: transformers 5 renamed gradient_checkpointing_enable to
    activation_checkpointing_enable; 4.x has the old name only."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.config.use_cache = False


# ----------------------------------------------------------------------------------------------
# The fast decode loop
# ----------------------------------------------------------------------------------------------
def decode(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
           max_new_tokens: int, pick) -> torch.Tensor:
    """G completions for each of B left-padded prompts: (B, P), (B, P) -> completion ids (N, T),
    T <= max_new_tokens.

    pick(logits (N, V), t, done (N,)) -> (next ids (N,), done (N,)) draws token t: grpo.draw_tokens.
    Same contract as grpo.reference_decode, which it matches token for token (tests/test_engine.py).
    """
    G, T = group_size, max_new_tokens
    kv_name = cache_kwarg(model)
    sdpa = sdpa_full_attention(model)
    # WHY (speed): inference_mode skips autograd's bookkeeping (version counters, views) on every
    #      op, which counts when a small model's time is per-op overhead. Its tensors cannot be
    #      saved for backward, so the ids are stacked after the block, as ordinary tensors.
    with torch.inference_mode():
        # Prefill once per distinct prompt. WHY (speed): the G copies of a prompt would compute the
        # same keys and values G times; compute them once and repeat the KV cache G times instead.
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True,
                    # WHY: number positions from each prompt's first real token, as generate() does.
                    position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),       # (B, P)
                    **last_logits_only(model, 1))
        cache = out[kv_name]
        cache.batch_repeat_interleave(G)                                      # (B, ...) -> (N, ...)
        logits = out.logits[:, -1, :].float().repeat_interleave(G, 0)            # (N, V)
        prompt_mask = prompt_mask.repeat_interleave(G, 0)                        # (N, P)
        N, P = prompt_mask.shape
        # WHY (speed): one mask for the whole loop, sliced each step, not a new column per token.
        #      Every generated column counts as real: a finished row only goes on to make pads.
        seen = torch.cat([prompt_mask, prompt_mask.new_ones(N, T)], dim=1)       # (N, P+T)
        # WHY (speed): for one new token under SDPA the mask is just "every real token so far", so a
        #      ready 4D view skips transformers' per-token mask building. Eager attention, flash
        #      attention and sliding windows get the plain 2D mask.
        if sdpa:
            seen = seen.bool()                                                   # (N, P+T)
        next_position = (prompt_mask.sum(1, keepdim=True) - 1).clamp(min=0) + 1  # (N, 1)
        done = torch.zeros(N, dtype=torch.bool, device=prompt_ids.device)        # (N,)
        tokens = []
        for t in range(T):
            next_ids, done = pick(logits, t, done)                               # (N,), (N,)
            tokens.append(next_ids)
            if done.all() or t == T - 1:
                break
            # Decode: feed only the new token; the KV cache holds everything before it.
            mask = seen[:, :P + t + 1]                                           # (N, P+t+1)
            if sdpa:
                mask = mask[:, None, None, :]                                    # (N, 1, 1, P+t+1)
            out = model(input_ids=next_ids[:, None], attention_mask=mask,       # (N, 1)
                        position_ids=next_position + t, use_cache=True, **{kv_name: cache})
            logits = out.logits[:, -1, :].float()                                # (N, V)
    return torch.stack(tokens, dim=1)                                            # (N, T)
