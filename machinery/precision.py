"""
precision.py -- bf16 autocast as PyTorch's AMP recipe runs it, computing what fp32 computes where it
matters: π_ref against the policy, and the sampler against the trainer.

    policy = fp32_logits(policy)                            # the output layer in fp32, always
    ref = bf16_reference(grpo.make_reference(policy))   # Linear weights in bf16, same numbers
    seams = autocast_seams(seams, "cuda")     # each forward under autocast, each backward not

AMP's recipe is: every forward pass under autocast, every backward pass outside it. A step run
whole inside one autocast region breaks it twice (train_gsm8k.py --bf16 did, until this file):
  - backward runs under autocast too, so a part that turned autocast off to compute in fp32 (the
    fp32 output layer below; memory.py's chunked scorer) gets bf16 products in its backward: one
    step's gradient norm on a small Llama was 3.09746 against AMP's 3.10189;
  - autocast keeps the bf16 copy of each fp32 weight until its region ends, so at μ > 1 updates 2..μ
    scored the weights from before update 1: the ratio stayed exactly 1 and the clip never bound.
autocast_seams gives the sampler and the scorer a region each, so backward (grpo.py's update) runs
outside every region and each forward casts the weights as they are now. tests/test_precision.py
checks both against AMP's own gradient and against fp32's clipping.

Under bf16 autocast (train_gsm8k.py --bf16) a real model showed two faults at step 1, where the
policy, π_ref and the sampler are all the same model (SmolLM2-135M-Instruct; docs/real_model.md,
benchmarks/real_model_numerics.py, the 2-core Intel Xeon CPU):
  - the KL to π_ref was 0.0016, not 0: π_ref was the policy cast whole to bf16, so its
    embeddings, norms and residual stream were bf16 where the policy's are fp32;
  - the sampler's and the trainer's log-probs of the same tokens differed by 0.029 on average,
    6.9% of tokens more than 10% apart in probability: both rounded the logits to bf16 (8 bits of
    mantissa: a logit of 16 to 0.125), from hidden states that differ in their last bits.
bf16_reference makes the first exactly 0; fp32_logits takes the second to the size of the hidden
states' own bf16 rounding (MiniMax-M1, arXiv 2506.13585, found the same fix for the same gap).
tests/test_precision.py checks both on small models.
"""

from __future__ import annotations

import functools
import types
from dataclasses import replace

import torch
import torch.nn.functional as F

import grpo
from machinery.engine import base_model


def slow_bf16_cpu(device_type: str) -> bool:
    """True on a CPU with neither AVX512_BF16 nor AMX: there bf16 matmuls are emulated and --bf16
    can be slower than fp32 (on the 2-core AMD EPYC, with AVX512_BF16, they run at 2.2x fp32's)."""
    if device_type != "cpu":
        return False
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return not (native or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def under_autocast(fn, device_type: str):
    """`fn`, run inside a bf16 autocast region of its own: what it computes is autocast's, and
    autocast's cached bf16 copies of the weights are dropped when it returns (the region ends).
    NOTE: a backward pass run later, on what `fn` returned, runs outside autocast: AMP's recipe."""
    @functools.wraps(fn)
    def autocast_fn(*args, **kwargs):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return fn(*args, **kwargs)
    return autocast_fn


def autocast_seams(seams: grpo.Seams, device_type: str) -> grpo.Seams:
    """`seams` whose sampler and scorer (grpo.py's own, grpo.decode and grpo.token_logprobs, where
    a seam is empty) each run under bf16 autocast in a region of their own (under_autocast). The
    update seam is left as it is: backward and AdamW's step run outside autocast, in fp32.
    WHY not one region around the whole step: see this file's docstring (backward under autocast,
    and stale weights at μ > 1)."""
    return replace(seams, sample=under_autocast(seams.sample or grpo.decode, device_type),
                   score=under_autocast(seams.score or grpo.token_logprobs, device_type))


def autocast_forward(module, device_type: str):
    """`module` whose forward runs under bf16 autocast in a region of its own and returns its
    tensor in fp32, in place; for a model that no seam scores (PPO's value model in
    compare/ppo.py). Returns the module.
    WHY fp32 out: what it returns is used outside autocast (PPO's GAE and value loss), where a bf16
    tensor meets fp32 ones; accelerate's convert_outputs_to_fp32 does the same for TRL.
    NOTE: set on the instance as a bound method, so a deep copy calls its own forward."""
    forward = under_autocast(type(module).forward, device_type)

    def fp32_forward(self, *args, **kwargs):
        return forward(self, *args, **kwargs).float()
    module.forward = types.MethodType(fp32_forward, module)
    return module


class FP32Logits(torch.nn.Linear):
    """An output layer that computes in fp32 whatever autocast says: the logits, and so every
    log-prob the sampler draws with and the trainer scores, keep fp32's precision."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)                    # (..., V)


def fp32_logits(model, enabled: bool = True):
    """`model` with its output layer computing in fp32 (FP32Logits), in place; a copy made later
    (grpo.make_reference) keeps it. Only where the output layer is an nn.Linear (Llama, Qwen,
    GPT-2's lm_head); otherwise, or not enabled, the model is left as it is.
    WHY: under bf16 autocast the logits are rounded to bf16, which moves a log-prob by up to a few
    hundredths; fp32 logits cost a (V, H) fp32 product instead of a bf16 one, and with a tied
    output layer save autocast's bf16 copy of the embedding."""
    head = base_model(model).get_output_embeddings()
    if enabled and type(head) is torch.nn.Linear:
        head.__class__ = FP32Logits
    return model


def bf16_reference(ref):
    """π_ref for a run under bf16 autocast, in place: the weights (and biases) of its Linear
    layers stored in bf16; the embedding, the norms and the output layer stay fp32.
    PAPER: π_ref is the policy GRPO starts from, so before the first update the two must score
    every token the same and step 1's KL must be 0. It is, bit for bit: autocast rounds each fp32
    Linear weight to bf16 before it multiplies, the same rounding as storing it in bf16, and what
    autocast leaves in fp32 (the embedding, the norms, the residual stream; the output layer under
    fp32_logits) is kept fp32 here.
    WHY not the whole copy in bf16: the embedding's and norms' outputs would then be bf16, the
    residual stream too, and π_ref another function. WHY not fp32: 2 bytes a weight saved on
    every Linear layer of every block, most of the model."""
    from transformers.pytorch_utils import Conv1D  # NOTE: GPT-2's Linear, (in, out), addmm
    base = base_model(ref)
    keep = {id(p) for m in (base.get_input_embeddings(), base.get_output_embeddings())
            for p in m.parameters()}
    for module in ref.modules():
        if (isinstance(module, (torch.nn.Linear, Conv1D)) and not isinstance(module, FP32Logits)
                and id(module.weight) not in keep):
            module.to(torch.bfloat16)
    return ref
