"""
memory.py -- memory machinery beside grpo.py: log-probs in chunks, activations kept in CPU RAM.

    logp = token_logprobs_chunked(model, ids, mask, positions, completion_ids, 1.0, False, 1024)
    with offloaded(True):            # tensors saved for backward go to CPU RAM (on a GPU)
        grpo.grpo_step(...)

Both give the same numbers as the plain code, within float tolerance (tests/test_memory.py), and
both are switches: GRPOConfig.logprob_chunk (grpo.token_logprobs calls the chunked version when it
is set) and train_gsm8k.py --offload-activations.

WHY chunks: the plain grpo.token_logprobs materialises a micro-batch's logits, (n, T, V) in fp32,
keeps them for backward and builds their gradient, as large again. At Qwen's 151,936-entry
vocabulary one 512-token completion's logits are 311 MB. Here the hidden states go through the
output layer `chunk` tokens at a time, each chunk's logits are reduced to log-probs at once, and
in backward each chunk is recomputed (activation checkpointing per chunk), so at most one chunk's
logits and their gradient exist at any moment. Unsloth's and Liger's fused cross-entropy do the
same thing in fused kernels; this is the plain-PyTorch version of the idea.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

import lora


def backbone_and_head(model):
    """(the transformer without its output layer, the output layer) of a causal LM, PEFT-wrapped
    or not. NOTE: LoRA layers sit inside the backbone's modules, so they run, and switch off,
    as in the full forward."""
    base = lora.unwrap(model)
    return base.base_model, base.get_output_embeddings()


def _chunk_logp(head, h, ids, temperature: float, with_entropy: bool):
    """log-probs (and, without gradient, entropies) of `ids` from hidden states h: (c, H), (c,)."""
    logits = head(h).float() / temperature                                           # (c, V)
    lse = torch.logsumexp(logits, dim=-1)                                             # (c,)
    logp = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse                     # (c,)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        # NOTE: H = logsumexp(l) - Σ_v p_v l_v, as in grpo.token_logprobs
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)              # (c,)
    return logp, entropy


def token_logprobs_chunked(model, input_ids, attention_mask, position_ids, completion_ids,
                           temperature: float, with_entropy: bool, chunk: int):
    """grpo.token_logprobs' numbers without its (n, T, V) logits: the output layer, log-softmax
    and gather run over `chunk` completion tokens at a time (n * T of them, flattened).
    (n, P+T) inputs, (n, T) completion_ids -> logp (n, T) [, entropy (n, T)]."""
    n, T = completion_ids.shape
    if isinstance(model, lora.AdaptersOff):  # π_ref of a LoRA policy: the policy, adapters off
        with model.policy.disable_adapter():
            return token_logprobs_chunked(model.policy, input_ids, attention_mask, position_ids,
                                          completion_ids, temperature, with_entropy, chunk)
    backbone, head = backbone_and_head(model)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, use_cache=False).last_hidden_state   # (n, P+T, H)
    # NOTE: the hidden state at position t predicts token t+1: the completion's are one to the left.
    h = hidden[:, -(T + 1):-1, :].reshape(n * T, -1)                                  # (n*T, H)
    ids = completion_ids.reshape(n * T)                                               # (n*T,)
    grad = torch.is_grad_enabled()
    parts = [checkpoint(_chunk_logp, head, h[i:i + chunk], ids[i:i + chunk], temperature,
                        with_entropy, use_reentrant=False) if grad
             else _chunk_logp(head, h[i:i + chunk], ids[i:i + chunk], temperature, with_entropy)
             for i in range(0, n * T, chunk)]
    logp = torch.cat([p for p, _ in parts]).reshape(n, T)                             # (n, T)
    if not with_entropy:
        return logp
    return logp, torch.cat([e for _, e in parts]).reshape(n, T).detach()              # (n, T)


def offloaded(enabled: bool):
    """A context in which every tensor autograd saves for backward is kept in CPU RAM and copied
    back when backward needs it (torch.autograd.graph.save_on_cpu). With gradient checkpointing,
    what is saved is each layer's input, so a long sequence's activations leave the GPU (the idea
    behind Unsloth's offloaded checkpointing). On a CPU it changes nothing. Costs PCIe copies."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
