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


def step_in_backward(params, optimizer, loss, max_grad_norm: float,
                     micro_batches: int = 1) -> float:
    """Backward `loss` and take `optimizer`'s step on each parameter as soon as its gradient is
    ready, then free that gradient, so the gradients of the whole model never exist at once
    (LOMO, arXiv 2306.09782). Returns the gradient norm before clipping, as clip_grad_norm_.

    The same update as backward, clip_grad_norm_ and optimizer.step() (tests/test_memory.py):
    clipping needs the global norm before any weight moves, so it takes two backward passes over
    one retained graph, as LOMO does: the first only measures each gradient's norm, the second
    scales each gradient by the clip factor and steps. A non-finite loss or norm skips the second
    pass, so nothing moves (policy_update counts the update skipped, as it would the plain one).
    It saves memory, not time: the second backward costs what the first did (docs/memory.md).

    NOTE: the step needs the whole update's gradient in one backward: one micro-batch (the
          count policy_update passes; more is an error).
    WHY it works: a parameter's gradient is accumulated only after every use of it has been
          differentiated, so changing it in place then leaves the rest of backward untouched.
    """
    if micro_batches > 1:
        raise ValueError(f"update_in_backward needs the whole batch in one micro-batch, got "
                         f"{micro_batches}: raise micro_batch_size to the completions per step")
    params = [p for p in params if p.requires_grad]
    norms = {}

    def measure(p):
        # NOTE: clip_grad_norm_'s own arithmetic on a CPU: one 2-norm per tensor, then their norm.
        norms[p] = torch.linalg.vector_norm(p.grad, 2.0)                              # ()
        p.grad = None

    def scale_and_step(p, coef):
        p.grad.mul_(coef)
        optimizer.step()  # NOTE: AdamW skips every parameter whose grad is None: this one moves
        p.grad = None

    def backward(hook, retain):
        handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        try:
            loss.backward(retain_graph=retain)
        finally:
            for h in handles:
                h.remove()

    backward(measure, retain=True)
    total = torch.linalg.vector_norm(torch.stack([norms[p] for p in params if p in norms]), 2.0)
    if not (torch.isfinite(total) and torch.isfinite(loss)):
        return total.item()
    # NOTE: torch's rule, as clip_grad_norm_ has it: coef = min(1, max_norm / (‖g‖ + 1e-6)).
    coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)                       # ()
    backward(lambda p: scale_and_step(p, coef), retain=False)
    return total.item()
