"""
memory.py -- memory machinery for grpo.py, applied from outside it: log-probs in chunks, lean
activations, activations kept in CPU RAM, AdamW stepped inside backward.

    seams = memory.apply(MemoryConfig(logprob_chunk=1024), grpo.Seams())   # score= and update=
    lean_activations(model)          # SwiGLU MLPs and RMSNorms keep fewer tensors for backward
    with offloaded(True):            # tensors saved for backward go to CPU RAM (on a GPU)
        grpo.grpo_step(..., seams=seams)

Each gives the plain code's numbers, bit for bit or within float tolerance (tests/test_memory.py),
and each is a switch of MemoryConfig (train_gsm8k.py --help shows them in their own section).
grpo.py knows none of them: the chunked scorer and the update inside backward reach it through
grpo.Seams, the others act on the model or around the step.

What each buys, measured (docs/memory.md, benchmarks/results/memory/README.md; the 2-core Intel
Xeon CPU, torch 2.13, at Qwen2.5-0.5B's architecture unless stated): chunks keep at most `chunk`
tokens' logits, where one 512-token completion's are 311 MB at Qwen's vocabulary; lean
activations keep 2 i + 2 h fewer floats a token and block (0.45 GB for 1,000 tokens without
checkpointing); the update inside backward never holds the whole model's gradients at once, for
a second backward pass; offloading pays only on a GPU (a projection there: no GPU has measured it).

WHY chunks: the plain grpo.token_logprobs materialises a micro-batch's logits, (n, T, V) in fp32,
keeps them for backward and builds their gradient, as large again. At Qwen's 151,936-entry
vocabulary one 512-token completion's logits are 311 MB. Here the hidden states go through the
output layer `chunk` tokens at a time, each chunk's logits are reduced to log-probs at once, and
backward recomputes each chunk's logits and sums its gradient into one output-layer gradient
(_LinearLogp), so at most one chunk's logits exist at any moment. Unsloth's and Liger's fused
cross-entropy do the same thing in fused kernels; this is the plain-PyTorch version of the idea.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import platform
import types
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import grpo
from machinery import lora
from machinery.engine import base_model
from machinery.precision import FP32Logits


@dataclass
class MemoryConfig:
    """The memory machinery's switches (train_gsm8k.py --help shows them in their own section).
    Each gives the plain code's numbers, within float tolerance."""

    logprob_chunk: int = 0
    """Score log-probs this many completion tokens at a time (token_logprobs_chunked), never
    holding a whole micro-batch's (n, T, V) logits; the same numbers. 0: all at once."""
    update_in_backward: bool = False
    """Step AdamW on each weight inside backward and free its gradient at once, so the model's
    gradients never exist together (step_in_backward, LOMO): the same update, two backward
    passes instead of one. Needs the whole batch in one micro-batch."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (slower)."""
    lean_activations: bool = False
    """SwiGLU MLPs and RMSNorms keep fewer activations for backward, recompute the rest."""
    offload_activations: bool = False
    """Keep tensors saved for backward in CPU RAM (offloaded; pays on a GPU). Slower."""
    return_freed_memory: bool = False
    """CPU only: have glibc give freed blocks of 1 MB or more back to the system at once, for the
    whole process (return_freed_memory). Lowers resident memory; costs time (docs/memory.md)."""
    keep_freed_memory: bool = False
    """CPU only, the opposite: have glibc keep freed blocks of any size for reuse, for the whole
    process (keep_freed_memory). Saves the page faults of each new large tensor (a step's logits);
    resident memory stays near its peak (docs/real_model.md: what it buys)."""

    def __post_init__(self):
        if self.logprob_chunk < 0:
            raise ValueError(f"logprob_chunk must be >= 0, got {self.logprob_chunk}")
        if self.return_freed_memory and self.keep_freed_memory:
            raise ValueError("return_freed_memory and keep_freed_memory are opposites: "
                             "pick one")


def apply(cfg: MemoryConfig, seams: grpo.Seams) -> grpo.Seams:
    """`seams` with the chunked scorer (cfg.logprob_chunk) and the update inside backward
    (cfg.update_in_backward) where they are on. The other switches act on the model
    (lean_activations, engine.enable_activation_checkpointing) or around the step (offloaded)."""
    if cfg.logprob_chunk:
        seams = replace(seams, score=chunked_scorer(cfg.logprob_chunk))
    return replace(seams, update=StepInsideBackward()) if cfg.update_in_backward else seams


def chunked_scorer(chunk: int):
    """A scorer with grpo.token_logprobs' arguments and results that scores `chunk` completion
    tokens at a time (token_logprobs_chunked)."""
    def score(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
              temperature: float = 1.0, with_entropy: bool = False):
        inputs = grpo.joined_sequences(prompt_ids, prompt_mask, completion_ids,
                                       completion_mask)                               # (n, P+T) x3
        return token_logprobs_chunked(model, *inputs, completion_ids, temperature, with_entropy,
                                      chunk)
    return score


class StepInsideBackward:
    """grpo.ClippedStep's two calls, with AdamW stepped inside backward (step_in_backward): the
    same update from one micro-batch's loss. backward(loss) keeps the loss, graph and all; step()
    runs step_in_backward on it. Returns (gradient norm, whether the weights moved)."""

    def __init__(self):
        self.loss = None

    def backward(self, loss):
        """Keep this update's loss for step(). A second micro-batch is refused before anything
        moves: the step needs the whole update's gradient in one backward."""
        if self.loss is not None:
            self.loss = None
            raise ValueError("update_in_backward needs the whole batch in one micro-batch: raise "
                             "micro_batch_size to the completions per step")
        self.loss = loss

    def step(self, policy, optimizer, max_grad_norm: float, loss: float) -> tuple[float, bool]:
        """Backward the kept loss, stepping AdamW on each weight as its gradient is ready."""
        kept, self.loss = self.loss, None
        optimizer.zero_grad(set_to_none=True)
        grad_norm = step_in_backward(policy.parameters(), optimizer, kept, max_grad_norm)
        return grad_norm, math.isfinite(grad_norm) and math.isfinite(loss)


def backbone_and_head(model):
    """(the transformer without its output layer, the output layer) of a causal LM, PEFT-wrapped
    or not. NOTE: LoRA layers sit inside the backbone's modules, so they run, and switch off,
    as in the full forward."""
    base = base_model(model)
    return base.base_model, base.get_output_embeddings()


def _compute_dtype(x, weight):
    """The dtype a layer computes in: autocast's if it is on for x's device, else the weight's."""
    on = torch.is_autocast_enabled(x.device.type)
    return torch.get_autocast_dtype(x.device.type) if on else weight.dtype


def _logp_lse_entropy(z, ids, with_entropy: bool):
    """From logits over the temperature: log-probs of ids, logsumexp, and (no gradient; None
    unless asked for) entropies. (c, V), (c,) -> (c,) x3."""
    lse = torch.logsumexp(z, dim=-1)                                                  # (c,)
    logp = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse                          # (c,)
    if not with_entropy:
        return logp, lse, None
    with torch.no_grad():
        # NOTE: H = logsumexp(z) - Σ_v p_v z_v, as in grpo.token_logprobs
        return logp, lse, lse - (torch.softmax(z, dim=-1) * z).sum(-1)                # (c,)


def _logits(h, weight, temperature: float):
    """The output layer's logits over the temperature, in fp32: (c, H), (V, H) -> (c, V).
    NOTE: `weight` is already in the dtype the layer computes in (bf16 under autocast)."""
    # NOTE: in place on the fresh product: a chunk's (c, V) is the largest tensor in this path
    return F.linear(h.to(weight.dtype), weight).float().div_(temperature)             # (c, V)


class _LinearLogp(torch.autograd.Function):
    """log π(id | h) through a bias-free output layer z = h Wᵀ / temperature, `chunk` rows at a
    time, with its backward written out, so that only one chunk's (c, V) logits exist at a time
    and the weight's gradient is summed into one (V, H) tensor. (Through autograd, each chunk's
    backward would make a whole (V, H) gradient of its own before adding it in: 545 MB at Qwen's
    vocabulary, and a second one at the peak.) Forward: h (N, H), W (V, H), ids (N,) ->
    logp (N,), entropy (N,) (no gradient; empty unless asked for)."""

    @staticmethod
    def forward(ctx, h, weight, ids, temperature, chunk, with_entropy, sink):
        dt = _compute_dtype(h, weight)
        w = weight.to(dt)                                                             # (V, H)
        parts = [_logp_lse_entropy(_logits(h[i:i + chunk], w, temperature), ids[i:i + chunk],
                                   with_entropy) for i in range(0, h.shape[0], chunk)]
        logp, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # (N,) x2
        entropy = torch.cat([p[2] for p in parts]) if with_entropy else lse.new_empty(0)  # (N,)
        ctx.save_for_backward(h, weight, ids, lse)
        ctx.dt, ctx.temperature, ctx.chunk, ctx.sink = dt, temperature, chunk, sink
        ctx.mark_non_differentiable(entropy)
        return logp, entropy                                                          # (N,) x2

    @staticmethod
    def backward(ctx, grad_logp, _):
        # WHY: this backward computes in the dtype its forward did (ctx.dt), whatever autocast
        #      says: a bf16 recompute against the forward's fp32 logsumexp is no softmax at all.
        with torch.autocast(grad_logp.device.type, enabled=False):
            return _LinearLogp.backward_in(ctx, grad_logp)

    @staticmethod
    def backward_in(ctx, grad_logp):
        """backward's body, outside autocast: the gradients of h and the weight."""
        h, weight, ids, lse = ctx.saved_tensors
        w = weight.to(ctx.dt)                                                         # (V, H)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None             # (N, H)
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None        # (V, H)
        for i in range(0, h.shape[0], ctx.chunk):
            s, hs, gs = slice(i, i + ctx.chunk), h[i:i + ctx.chunk], grad_logp[i:i + ctx.chunk]
            # PAPER (the log-softmax's gradient): ∂ log p_o / ∂ z_v = 1[v = o] - p_v, p = softmax(z)
            g = _logits(hs, w, ctx.temperature).sub_(lse[s, None]).exp_()             # (c, V) p
            g.mul_(-gs[:, None]).scatter_add_(1, ids[s, None], gs[:, None].float())   # (c, V)
            g.div_(ctx.temperature)  # NOTE: now ∂loss/∂(h Wᵀ), through z = h Wᵀ / temperature
            if grad_h is not None:
                grad_h[s] = (g.to(w.dtype) @ w).to(h.dtype)                           # (c, H)
            if grad_w is not None:
                grad_w.addmm_(g.t().to(grad_w.dtype), hs.to(grad_w.dtype))            # (V, H)
        if grad_w is not None and ctx.sink is not None:  # NOTE: for _TiedEmbedding's rows
            ctx.sink.append(grad_w)
        return grad_h, grad_w, None, None, None, None, None


class _TiedEmbedding(torch.autograd.Function):
    """The input embedding of a weight tied to the output layer, whose gradient is added in place
    into the output layer's (V, H) gradient: (n, L) ids, (V, H) weight -> (n, L, H).
    WHY (memory): autograd would build a second dense (V, H) gradient here, or sum a sparse one
    into a new (V, H) tensor: 545 MB more for a moment at Qwen's vocabulary, at backward's peak.
    NOTE: _LinearLogp's backward, which always runs first (every layer lies between the two),
          leaves its (V, H) gradient in `sink`; this backward adds the embedding's rows into that
          very tensor, which autograd still holds for the weight, and passes no gradient of its
          own. So the weight's hooks fire once, on one dense gradient holding both parts. With
          nothing in `sink` (another output layer), it returns its own dense gradient."""

    @staticmethod
    def forward(ctx, ids, weight, sink, padding_idx):
        ctx.save_for_backward(ids)
        ctx.sink, ctx.padding_idx, ctx.like = sink, padding_idx, weight
        return F.embedding(ids, weight, padding_idx)                                  # (n, L, H)

    @staticmethod
    def backward(ctx, grad):
        ids, = ctx.saved_tensors
        ids, grad = ids.reshape(-1), grad.reshape(ids.numel(), -1)                    # (m,), (m, H)
        if ctx.padding_idx is not None:  # NOTE: as nn.Embedding: the pad row gets no gradient
            real = ids != ctx.padding_idx                                             # (m,)
            ids, grad = ids[real], grad[real]
        sunk = bool(ctx.sink)
        out = ctx.sink.pop() if sunk else torch.zeros_like(ctx.like)                  # (V, H)
        out.index_add_(0, ids, grad.to(out.dtype))
        return None, None if sunk else out, None, None


def _embeddings(model, input_ids, sink):
    """The input embeddings through _TiedEmbedding where they are tied to a trained output layer,
    else None (the model embeds input_ids itself). (n, L) -> (n, L, H)."""
    base = base_model(model)
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    if not (torch.is_grad_enabled() and type(emb) is torch.nn.Embedding
            and emb.max_norm is None and not emb.scale_grad_by_freq
            and emb.weight.requires_grad and emb.weight is getattr(head, "weight", None)):
        return None
    return _TiedEmbedding.apply(input_ids, emb.weight, sink, emb.padding_idx)         # (n, L, H)


def _chunk_logp(head, h, ids, temperature: float, with_entropy: bool):
    """log-probs (and, without gradient, entropies) of `ids` through any output layer: the
    general path, for layers _LinearLogp does not cover. (c, H), (c,) -> (c,) [, (c,)]."""
    logp, _, entropy = _logp_lse_entropy(head(h).float() / temperature, ids, with_entropy)
    return logp, entropy                                                              # (c,) x2


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
    sink = []  # NOTE: the output layer's gradient, handed on to a tied input embedding
    embeds = _embeddings(model, input_ids, sink)                                      # (n, P+T, H)
    hidden = backbone(input_ids=None if embeds is not None else input_ids, inputs_embeds=embeds,
                      attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state                              # (n, P+T, H)
    # NOTE: the hidden state at position t predicts token t+1: the completion's are one to the left.
    h = hidden[:, -(T + 1):-1, :].reshape(n * T, -1)                                  # (n*T, H)
    ids = completion_ids.reshape(n * T)                                               # (n*T,)
    if type(head) in (torch.nn.Linear, FP32Logits) and head.bias is None:  # WHY: written out
        fp32 = type(head) is FP32Logits  # NOTE: its logits in fp32 under autocast too
        with torch.autocast(h.device.type, enabled=False) if fp32 else contextlib.nullcontext():
            logp, entropy = _LinearLogp.apply(h.float() if fp32 else h, head.weight, ids,
                                              temperature, chunk, with_entropy,
                                              None if embeds is None else sink)       # (n*T,) x2
        logp = logp.reshape(n, T)                                                     # (n, T)
        return (logp, entropy.reshape(n, T)) if with_entropy else logp
    grad = torch.is_grad_enabled()
    parts = [checkpoint(_chunk_logp, head, h[i:i + chunk], ids[i:i + chunk], temperature,
                        with_entropy, use_reentrant=False) if grad
             else _chunk_logp(head, h[i:i + chunk], ids[i:i + chunk], temperature, with_entropy)
             for i in range(0, n * T, chunk)]
    logp = torch.cat([p for p, _ in parts]).reshape(n, T)                             # (n, T)
    if not with_entropy:
        return logp
    return logp, torch.cat([e for _, e in parts]).reshape(n, T).detach()              # (n, T)


class _SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(g) ⊙ u), the end of a SwiGLU MLP (Llama, Qwen, Mistral), keeping only g and
    u for backward: (..., i) x2, (h, i) -> (..., h).
    WHY (memory): autograd keeps four (..., i) tensors for these three ops: g, silu(g), u and the
    product, which down_proj saves as its input. This keeps two and recomputes the product in
    backward (what Liger's and Unsloth's fused SwiGLU kernels do). Without checkpointing, at
    Qwen2.5-0.5B's width (i = 4,864) that is 0.45 GB less for 1,000 tokens in fp32."""

    @staticmethod
    def forward(ctx, g, u, weight):
        dt = _compute_dtype(g, weight)
        ctx.save_for_backward(g, u, weight)
        ctx.dt = dt
        return F.linear((F.silu(g) * u).to(dt), weight.to(dt))                        # (..., h)

    @staticmethod
    def backward(ctx, grad):
        # WHY: as _LinearLogp's, in its forward's dtype (ctx.dt) whatever autocast says
        with torch.autocast(grad.device.type, enabled=False):
            return _SwiGLUDown.backward_in(ctx, grad)

    @staticmethod
    def backward_in(ctx, grad):
        """backward's body, outside autocast: the gradients of g, u and the weight."""
        g, u, weight = ctx.saved_tensors
        w, grad = weight.to(ctx.dt), grad.to(ctx.dt)                         # (h, i), (..., h)
        s = torch.sigmoid(g)                                                          # (..., i)
        a = g * s  # NOTE: silu(g)                                                    # (..., i)
        grad_w = None
        if ctx.needs_input_grad[2]:  # NOTE: ∂/∂W of p Wᵀ is gradᵀ p, over every token
            p = (a * u).to(ctx.dt)                                                    # (..., i)
            grad_w = (grad.reshape(-1, grad.shape[-1]).t() @ p.reshape(-1, p.shape[-1])
                      ).to(weight.dtype)                                              # (h, i)
            del p
        dp = (grad @ w).to(g.dtype)                                                   # (..., i)
        du = dp * a                                                                   # (..., i)
        # NOTE: silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)
        ds = (1 - s).mul_(g).add_(1).mul_(s)                                          # (..., i)
        return dp.mul_(u).mul_(ds), du, grad_w


class _RMSNorm(torch.autograd.Function):
    """Llama's and Qwen2's RMSNorm, w ⊙ x / sqrt(mean(x²) + eps), keeping only x and the (..., 1)
    inverse norm for backward: (..., h), (h,) -> (..., h). The same arithmetic as their forward.
    WHY (memory): autograd also keeps the normalised x, one more (..., h) tensor per norm (two a
    block); this recomputes it in backward."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = x.to(torch.float32)                                                      # (..., h)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)                    # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)                                       # (..., h)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        n = x.to(torch.float32) * rstd                                                # (..., h)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * n.to(x.dtype)).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        gn = (grad * weight).to(torch.float32)                                        # (..., h)
        # NOTE: for n = x r, r = mean(x²)^-1/2: ∂L/∂x = r (∂L/∂n - n mean(∂L/∂n ⊙ n))
        grad_x = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))                    # (..., h)
        return grad_x.to(x.dtype), grad_w, None


def _lean_mlp_forward(self, x):
    return _SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


def _lean_norm_forward(self, x):
    return _RMSNorm.apply(x, self.weight, self.variance_epsilon)


NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")  # NOTE: each forward read, the same


def lean_activations(model, enabled: bool = True) -> int:
    """Route every SwiGLU MLP of `model` (gate_proj, up_proj and a bias-free down_proj, all plain
    nn.Linear; act_fn torch's or transformers' SiLU) through _SwiGLUDown and every RMSNorm of
    NORMS through _RMSNorm; returns how many modules. The forward is the same arithmetic, bit for
    bit; backward agrees to float rounding (tests/test_memory.py). At Qwen2.5-0.5B's shape that
    is 2 i + 2 h of 10 h + 4 i + ... floats a token and block fewer (docs/memory.md).
    NOTE: LoRA-wrapped projections are left as they are."""
    count = 0
    for m in model.modules() if enabled else ():
        parts = [getattr(m, k, None) for k in ("gate_proj", "up_proj", "down_proj")]
        if (all(type(p) is torch.nn.Linear for p in parts) and parts[2].bias is None
                and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")):
            m.forward = types.MethodType(_lean_mlp_forward, m)
            count += 1
        elif type(m).__name__ in NORMS:
            m.forward = types.MethodType(_lean_norm_forward, m)
            count += 1
    return count


def offloaded(enabled: bool):
    """A context in which every tensor autograd saves for backward is kept in CPU RAM and copied
    back when backward needs it (torch.autograd.graph.save_on_cpu). With gradient checkpointing,
    what is saved is each layer's input, so a long sequence's activations leave the GPU (the idea
    behind Unsloth's offloaded checkpointing). On a CPU it changes nothing. Costs PCIe copies."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def return_freed_memory():
    """Have glibc give freed memory back to the system: what is free now (malloc_trim), and every
    block of 1 MB or more at once when it is freed from now on, as MALLOC_MMAP_THRESHOLD_=1048576
    would. Linux with glibc only; nothing when that variable is set (the user chose).
    WHY (memory, CPU): glibc keeps freed blocks under a threshold that grows to 32 MB for reuse,
    so RSS does not fall when they are freed. Stepping inside backward frees each weight's
    gradient on its own, hundreds of blocks of a few MB, twice a step: kept, they cost more than
    the gradients saved (+1.4 GB at Qwen2.5-0.5B, docs/memory.md), and the sampler's and the
    reference pass's freed memory sits under backward's peak. On a GPU it changes nothing there:
    PyTorch's caching allocator holds GPU memory itself.
    NOTE: process-wide, so never switched on by another flag: MemoryConfig.return_freed_memory."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 1 << 20)  # NOTE: -3 is M_MMAP_THRESHOLD in glibc's malloc.h
    libc.malloc_trim(0)


def keep_freed_memory():
    """Have glibc keep freed memory for reuse: blocks of up to 1 GiB come from its heap, not from
    a fresh mmap each, and freed memory stays with the process. Linux with glibc only; nothing
    when MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ is set (the user chose).
    WHY (speed, CPU): glibc serves each block over 32 MB from a fresh mmap and unmaps it on free,
    so every new large tensor (a micro-batch's logits: 16 rows x 96 tokens x 49,152 in fp32,
    302 MB) is page-faulted in again, page by page. Then an elementwise op over it runs at a
    fraction of the machine's memory bandwidth.
    NOTE: process-wide, so never switched on by another flag: MemoryConfig.keep_freed_memory."""
    if ({"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ)
            or platform.libc_ver()[0] != "glibc"):
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 1 << 30)  # NOTE: M_MMAP_THRESHOLD: blocks under 1 GiB from the heap
    libc.mallopt(-1, 2**31 - 1)  # NOTE: M_TRIM_THRESHOLD (a C int): trim the heap's top never


def step_in_backward(params, optimizer, loss, max_grad_norm: float) -> float:
    """Backward `loss` and take `optimizer`'s step on each parameter as soon as its gradient is
    ready, then free that gradient, so the gradients of the whole model never exist at once
    (LOMO, arXiv 2306.09782). Returns the gradient norm before clipping, as clip_grad_norm_.

    The same update as backward, clip_grad_norm_ and optimizer.step() (tests/test_memory.py):
    clipping needs the global norm before any weight moves, so it takes two backward passes over
    one retained graph, as LOMO does: the first only measures each gradient's norm, the second
    scales each gradient by the clip factor and steps. A non-finite loss or norm skips the second
    pass, so nothing moves (policy_update counts the update skipped, as it would the plain one).
    It saves memory, not time: the second backward costs what the first did (docs/memory.md).

    NOTE: the step needs the whole update's gradient in one backward: one micro-batch
          (StepInsideBackward refuses more).
    WHY it works: a parameter's gradient is accumulated only after every use of it has been
          differentiated, so changing it in place then leaves the rest of backward untouched.
    """
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
