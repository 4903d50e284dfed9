"""
lora.py -- LoRA adapters through PEFT: train a few low-rank matrices, score π_ref with them off.

    policy = lora.add_adapters(policy, r=16, alpha=32)     # a peft.PeftModel; the base is frozen
    ref = lora.AdaptersOff(policy)                         # π_ref: the same model, adapters off
    grpo.grpo_step(policy, ref, make_optimizer(policy, cfg), ...)   # grpo.py needs no change
    lora.merged(policy).save_pretrained(path)              # a plain model from_pretrained loads

    python train_gsm8k.py --lora-r 16 --lora-alpha 32 --lr 1e-5    # the same from the command line

WHY: full fine-tuning keeps fp32 weights, gradients and AdamW's two moments (16 bytes a parameter)
plus a frozen reference copy. With LoRA the gradients and AdamW state exist for the adapters only
(well under 1% of the parameters at r = 16), and π_ref costs nothing: it is the base model, which
LoRA never changes, reached by switching the adapters off (TRL does the same with PEFT). LoRA's B
matrices start at zero, so before the first update the policy is exactly the base model.
What it buys, measured (docs/memory.md; the 2-core Intel Xeon CPU, Qwen2.5-0.5B's architecture,
64 tokens): a step peaked at 5,865 MB with --lora-r 16 against 11,668 MB with full fine-tuning.
NOTE: LoRA usually wants a larger learning rate than full fine-tuning (1e-5 to 1e-4 against the
      paper's 1e-6); no default here changes with it.
peft is an optional dependency (pip install peft); without it, --lora-r fails with one line.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch


class LoRAError(ValueError):
    """A LoRA setting or checkpoint that cannot work, in one line (the recipe shows it as bad
    input: recipe.flags.InputError, exit code 2)."""


DEFAULT_TARGETS = "all-linear"
"""Every linear layer of the decoder blocks, the lm_head excepted: PEFT's name for q/k/v/o and the
MLP's gate/up/down in Llama- and Qwen-style models (c_attn, c_proj, c_fc in GPT-2). Our choice:
adapting all of them is the common recipe for RL fine-tuning (QLoRA, Unsloth's GRPO notebooks)."""


def peft_module():
    """The peft package, or one line saying how to get it."""
    try:
        import peft
    except ImportError:
        raise LoRAError("LoRA (--lora-r) needs the peft package: pip install peft") from None
    return peft


def add_adapters(model, r: int, alpha: float, targets: str = DEFAULT_TARGETS):
    """`model` with LoRA adapters of rank r on `targets` (comma-separated module names, or
    'all-linear'); only the adapters train. PEFT scales each adapter's update by alpha / r. The
    adapters, the only weights AdamW updates, are fp32 whatever the base's dtype (PEFT's
    autocast_adapter_dtype), so small updates survive.
    NOTE: for a bf16 autocast run, store the base as π_ref is stored first (it is π_ref):
          precision.bf16_reference(model), the blocks' Linear weights in bf16 and the embedding,
          norms, output layer and so the residual stream fp32 (train_gsm8k.py does).
    WHY not the whole base in bf16: its residual stream is then bf16, and the sampler's token-by-
    token decoding and the trainer's one pass drift apart: over SmolLM2's first 3 steps, 4.8 to
    6.7% of tokens >10% apart, against 1.5 to 1.8% stored as π_ref (docs/real_model.md)."""
    peft = peft_module()
    names = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    # WHY dropout 0: dropout would make π_θ a random function at μ = 1 (grpo.disable_dropout).
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=names, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    try:
        with quiet_peft():
            return peft.get_peft_model(model, config)
    except ValueError as e:  # e.g. a target module name the model does not have
        raise LoRAError(f"--lora-target-modules {targets}: {str(e).splitlines()[0]}") from None


def adapters_from(model, adapter_dir: str):
    """A saved adapter folder's LoRA adapters on `model` (peft.PeftModel.from_pretrained)."""
    with quiet_peft():
        return peft_module().PeftModel.from_pretrained(model, adapter_dir)


@contextlib.contextmanager
def quiet_peft():
    """Silence the one transformers deprecation that PEFT's own code triggers: PeftModel reads
    `is_gradient_checkpointing`, which transformers 5 renamed (is_activation_checkpointing)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class AdaptersOff:
    """π_ref for a LoRA policy: calling it runs the policy with its adapters switched off, which is
    exactly the base model (tests/test_lora.py checks the logits bit for bit). It holds no weights
    of its own. Everything else (config, device, ...) is the policy's."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.policy, name)


def merged(policy):
    """A plain transformers model with the adapters folded into the weights (W + (alpha/r) B A):
    save_pretrained writes a model that AutoModelForCausalLM.from_pretrained loads, no peft needed.
    NOTE: it changes `policy` in place, so call it last."""
    return policy.merge_and_unload() if is_lora(policy) else policy


def active_adapters(layer) -> list[str]:
    """The names of a PEFT LoRA layer's active adapters that this layer holds."""
    return [a for a in layer.active_adapters if a in layer.lora_A]


def lora_layers(policy) -> list:
    """The policy's PEFT LoRA layers that hold an active adapter (each wraps one base Linear)."""
    from peft.tuners.lora import LoraLayer
    return [m for m in policy.modules() if isinstance(m, LoraLayer) and active_adapters(m)]


@contextlib.contextmanager
def merged_weights(policy):
    """Inside: `policy` computes W + (alpha/r) B A in each adapted layer as one product, not PEFT's
    three (the base's, then x A, then B, scaled and added); on leaving, every base weight is the
    very tensor it was before, untouched (π_ref stays the base bit for bit).
    WHY: sampling reads each weight once per decoded token; merged, a decode step runs one product
    per layer instead of three plus PEFT's casts and adds. The merge runs once per call, in fp32,
    into new tensors (the adapted layers' weights again: +424 MB at SmolLM2's fp32, while inside).
    NOTE: the numbers equal the unmerged ones to float rounding, not bit for bit
    (tests/test_lora.py: the same tokens, logits within 1e-5 in fp32)."""
    layers, saved = lora_layers(policy), []
    try:
        with torch.no_grad(), torch.autocast(policy.device.type, enabled=False):
            for m in layers:
                W = m.base_layer.weight                                               # (out, in)
                # PAPER (LoRA): W' = W + (alpha/r) B A, in fp32, rounded once to W's dtype
                delta = sum(m.get_delta_weight(a) for a in active_adapters(m))        # (out, in)
                merged = (W.float() + delta.float()).to(W.dtype)                      # (out, in)
                saved.append((m, W))
                m.base_layer.weight = torch.nn.Parameter(merged, requires_grad=False)
        with policy.disable_adapter():  # WHY: the adapters are in the weights; PEFT adds nothing
            yield policy
    finally:
        for m, W in saved:
            m.base_layer.weight = W


def merge_keeps_updates(policy) -> bool:
    """Whether merging loses nothing: every adapted layer's base weight is fp32.
    WHY not a bf16 base (--bf16 --lora-r): W + (alpha/r) B A rounded to bf16 (8 bits of mantissa)
    drops any part of the update under about 1/256 of W's size, which is where a few steps' updates
    are; unmerged, PEFT adds them as a product of their own. At SmolLM2's steps 2 and 3, merged,
    sampler and trainer put 2.4 to 2.5% of tokens >10% apart, unmerged 1.8% (docs/real_model.md)."""
    return all(m.base_layer.weight.dtype == torch.float32 for m in lora_layers(policy))


def sample_merged(sample):
    """A sampler (grpo.Seams.sample's signature) that draws from a LoRA policy with an fp32 base
    with its adapters merged (merged_weights), and from any other model (a bf16 base included:
    merge_keeps_updates) as `sample` does. The same distribution; the tokens are the unmerged
    sampler's wherever no two tokens tie to float rounding."""
    def merged_sample(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int,
                      pick):
        merge = is_lora(model) and merge_keeps_updates(model)
        with merged_weights(model) if merge else contextlib.nullcontext():
            return sample(model, prompt_ids, prompt_mask, group_size, max_new_tokens, pick)
    return merged_sample


def load_adapter_weights(model, adapter_dir: Path):
    """Load a checkpoint's saved adapter weights into LoRA model `model`, in place (--resume);
    returns `model`. A checkpoint whose adapters do not fit the model is refused in one line."""
    from safetensors.torch import load_file
    saved = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    result = peft_module().set_peft_model_state_dict(model, saved)
    if result.unexpected_keys or len(saved) != sum(1 for n, _ in model.named_parameters()
                                                    if "lora_" in n):
        raise LoRAError(f"{adapter_dir}: its adapters do not match this model's LoRA settings")
    return model


def is_adapter_dir(path: Path) -> bool:
    """A directory that PEFT's save_pretrained wrote (adapters only, no base weights)."""
    return (Path(path) / "adapter_config.json").exists()


def trainable_share(model) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    n = [(p.numel(), p.requires_grad) for p in model.parameters()]
    return sum(k for k, g in n if g), sum(k for k, _ in n)

