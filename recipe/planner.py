"""
planner.py -- will a training run fit on a card? Its peak memory, part by part, from the model's
config alone: no weights are loaded, nothing is downloaded beyond the config.

    python train_gsm8k.py plan --model Qwen/Qwen2.5-1.5B-Instruct --gpu-gb 24 --bf16
    python train_gsm8k.py plan --model benchmarks/configs/deepseek-math-7b.json --gpu-gb 24 \
        --bf16 --lora-r 16 --gradient-checkpointing --json

It prints the predicted peak of one GRPO step by part (weights, gradients, AdamW state, the
reference, autocast's bf16 copies, activations, logits, the sampler's KV cache), the same for PPO
with a critic the policy's size under the same flags, whether each fits the card, and for one that
does not, the flags that would make it fit (added one at a time, the largest saving first, then
pruned to those still needed).

How far to trust it: the counts behind each part are written beside it in step_memory, and the
whole prediction is checked against measured peaks on a CPU (benchmarks/memory_parts.py
--plan-check, at three sizes up to Qwen2.5-0.5B's architecture, full, LoRA, chunked, checkpointed;
docs/planner.md has the table). On a GPU it is a projection until benchmarks/gpu_check.sh has
measured it there. Its model is of Llama- and Qwen-style blocks (SwiGLU MLP); for others it is
an estimate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from recipe import flags
from recipe.flags import InputError

GiB = 2**30
CUDA_RESERVE = GiB
"""Added to the tensors' peak before it is compared with a card: the CUDA context, cuBLAS's
workspaces and the caching allocator's fragmentation. An allowance, not a measurement."""
CPU_RUNTIME = 100 * 2**20
"""Added to the tensors' peak for a run on a CPU: the runtime's own host memory, which no tensor
holds (the code that from_pretrained and the first optimizer step load, autograd's threads).
Measured once on the reference machine (x86_64 Linux, torch 2.13.0+cpu) as a 0.1 M-parameter
model's peak over its tensors: `python benchmarks/memory_parts.py --measure-runtime --threads 2`,
raw output in benchmarks/results/plan_check/. On a GPU it stays in host RAM, off the card."""
PPO_CRITIC = "PPO + critic"


@dataclass
class ModelShape:
    """What the planner reads from a model's config: sizes and parameter counts, no weights."""

    params: int                 # every parameter (a tied output layer counted once)
    linear_params: int          # the weights and biases that nn.Linear layers (lm_head too) use
    embed_params: int           # the input embedding's
    head_params: int            # an untied output layer's (0 when tied)
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    block_linears: list[tuple[str, int, int]]  # (name, in, out) of each decoder block's linears

    def lora_params(self, r: int, targets: str) -> int:
        """Adapter parameters at rank r: r * (in + out) for each targeted linear of every block
        ('all-linear': all of them, as PEFT does; else the comma-separated names)."""
        names = None if targets == "all-linear" else {t.strip() for t in targets.split(",")}
        return self.layers * sum(r * (i + o) for name, i, o in self.block_linears
                                 if names is None or name in names)


def model_shape(config) -> ModelShape:
    """The shape of the causal LM a transformers config describes. WHY the meta device: the model
    is built without allocating a single weight, so any architecture transformers knows is
    counted exactly, at 7B as fast as at 0.5M."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    linear = {id(p): p.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))
              for p in (m.weight, m.bias) if p is not None}  # WHY by id: a tied weight counts once
    block = []  # WHY Conv1D: GPT-2's linear layers keep their weight as (in, out)
    for name, m in blocks[0].named_modules():
        if isinstance(m, torch.nn.Linear):
            block.append((name.split(".")[-1], m.in_features, m.out_features))
        elif isinstance(m, Conv1D):
            block.append((name.split(".")[-1], *m.weight.shape))
    hidden, heads = config.hidden_size, config.num_attention_heads
    head = model.get_output_embeddings()
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        linear_params=sum(linear.values()),
        embed_params=model.get_input_embeddings().weight.numel(),
        head_params=(0 if head.weight is model.get_input_embeddings().weight
                     else head.weight.numel()),
        layers=len(blocks), hidden=hidden,
        ffn=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        or 4 * hidden,
        heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        vocab=config.vocab_size, block_linears=block)


@dataclass
class StepSettings:
    """The training flags that decide a step's memory (train_gsm8k.py's, by the same names)."""

    group_size: int = 8
    prompts_per_step: int = 16
    prompt_tokens: int = 256
    max_new_tokens: int = 256
    micro_batch_size: int = 16
    num_iterations: int = 1
    beta: float = 0.04
    bf16: bool = False
    gradient_checkpointing: bool = False
    logprob_chunk: int = 0
    sample_batch_size: int = 0
    offload_activations: bool = False
    lean_activations: bool = False
    update_in_backward: bool = False
    share_prompts: bool = True
    lora_r: int = 0
    lora_target_modules: str = "all-linear"
    eval_batch_size: int = 64


def step_memory(shape: ModelShape, s: StepSettings, critic: bool = False) -> dict:
    """Predicted memory of one training step in bytes: {"parts": {part: bytes}, "phases": {phase:
    bytes on top of the persistent parts}, "peak_phase", "peak"}. critic: PPO's same-size value
    model (its weights, gradients, AdamW state and activations) on top of GRPO's parts.

    The peak is the persistent parts (weights, reference, AdamW state) plus the largest phase:
        sampling      KV cache of the sequences decoded together (all N = B*G, or
                      sample_batch_size), the last position's logits
        scoring       π_ref's (and π_old's) no-grad pass over a micro-batch
        backward      one micro-batch's saved activations and logits' gradients, with the output
                      layer's gradient (all gradients once a second micro-batch has run)
        optimizer     every gradient (fused AdamW: no model-sized temporaries), and the
                      embedding's dense gradient as backward ends
        critic backward  PPO only: the value model's activations and gradients, after the
                      policy's update (ppo.Critic.value_update)
    The per-token activation counts were measured on Llama and Qwen2 blocks with autograd's
    saved-tensor hooks (fp32 and CPU bf16 autocast): benchmarks/results/plan_check/README.md.
    """
    h, i, L, V = shape.hidden, shape.ffn, shape.layers, shape.vocab
    S = s.prompt_tokens + s.max_new_tokens                 # a sequence, prompt and completion
    N = s.group_size * s.prompts_per_step                  # completions per step
    n = min(s.micro_batch_size, N)                         # sequences per micro-batch
    lora_p = shape.lora_params(s.lora_r, s.lora_target_modules) if s.lora_r else 0
    tied = not shape.head_params                           # one (V, h) weight, input and output
    trainable = lora_p or shape.params
    # NOTE: under bf16, π_ref (and a LoRA base, which is π_ref) stores the blocks' Linear weights
    #       in bf16, the output layer, the embedding and the norms in fp32 (bf16_reference)
    bf16_saved = 2 * (shape.linear_params - (shape.head_params or shape.embed_params))
    base_saved = bf16_saved if (s.lora_r and s.bf16) else 0    # the policy's (and critic's) base
    parts = {
        "weights": shape.params * 4 - base_saved + lora_p * 4,
        "gradients": trainable * 4,
        "optimizer": trainable * 8,                        # AdamW: exp_avg, exp_avg_sq in fp32
        # WHY 0 with LoRA: π_ref is the base, adapters off (lora.AdaptersOff)
        "reference": 0 if (s.beta == 0 or s.lora_r) else 4 * shape.params - (
            bf16_saved if s.bf16 else 0),
        # NOTE: autocast keeps a bf16 copy of each fp32 weight it casts for its region (a whole
        #       decode, a scoring pass: precision.autocast_seams) and backward keeps them saved
        "autocast copies": (2 * (lora_p if s.lora_r else shape.linear_params) if s.bf16 else 0),
    }
    # NOTE: saved for backward per token and block, in bytes (fitted: fp32 10h + 4i + S + heads
    #       + 2 floats; bf16 autocast 34h + 8i + 2S + 2 heads bytes), + r floats per LoRA adapter.
    full = (4 * (10 * h + 4 * i + S + shape.heads + 2) if not s.bf16
            else 34 * h + 8 * i + 2 * S + 2 * shape.heads)
    full += 4 * s.lora_r * len(shape.block_linears)
    if s.lean_activations:  # NOTE: memory.lean_activations: not silu(g), g*u (unless LoRA
        #                                wraps the MLP) nor the 2 norms' normalised x (fp32)
        full -= 4 * 2 * h + (0 if s.lora_r else (4 if not s.bf16 else 2) * 2 * i)
    kept = 4 * h if s.gradient_checkpointing else full     # checkpointing keeps blocks' inputs
    if s.offload_activations:
        kept = 0                                           # saved tensors wait in CPU RAM
    one_block = full if (s.gradient_checkpointing or s.offload_activations) else 0
    # NOTE: share_prompts (engine.shared_logits): a micro-batch's u distinct prompts run once and
    #       each of its n rows keeps a copy of its prompt's keys and values for attention; not in
    #       chunks, nor in a checkpointed training pass, which score whole sequences.
    u, P, T = -(-n // s.group_size), s.prompt_tokens, s.max_new_tokens
    kv_copies = n * P * L * 2 * shape.kv_heads * shape.head_dim * (2 if s.bf16 else 4)
    scores_shared = s.share_prompts and not s.logprob_chunk
    shared = scores_shared and not s.gradient_checkpointing
    tokens = u * P + n * T if shared else n * S                 # tokens through the blocks
    parts["activations"] = (tokens * (L * kept + one_block + 10 * h)
                            + (kv_copies if shared and not s.offload_activations else 0))
    rows = min(s.logprob_chunk, n * T) if s.logprob_chunk else n * T
    # WHY 3.5 (measured: benchmarks/results/memory/README.md): the fp32 logits kept for backward,
    #      and the (rows, V) gradients of logsumexp, gather and the slice that backward makes,
    #      partly at once.
    #      In chunks (memory._LinearLogp, a bias-free output layer as in Llama, Qwen and GPT-2)
    #      nothing is kept: a chunk's logits and the one tensor its gradient is built in.
    unit = rows * V * 4
    head_trainable = not s.lora_r
    parts["logits"] = (2 * unit if s.logprob_chunk
                       else 7 * unit // 2 + (2 * n * (T + 1) * V if s.bf16 else 0))
    decoded = min(s.sample_batch_size, N) if s.sample_batch_size else N  # rows sampled at once
    parts["KV cache"] = 2 * L * shape.kv_heads * shape.head_dim * S * decoded * (2 if s.bf16
                                                                                 else 4)
    head_grad = h * V * 4 if head_trainable else 0
    later = -(-N // n) > 1 or s.num_iterations > 1         # a second micro-batch or epoch
    # NOTE: memory.step_in_backward frees each gradient once its weight has stepped, so only the
    #       output layer's, held until the embedding's adds to it, outlives its moment
    later = later and not s.update_in_backward
    train = parts["activations"] + parts["logits"] + (parts["gradients"] if later else head_grad)
    if critic:  # NOTE: PPO: a value model the policy's size, a scalar head for the output layer
        c_params = shape.params - shape.head_params + h
        c_trainable = lora_p + h if s.lora_r else c_params
        parts.update({"critic weights": c_params * 4 - base_saved + lora_p * 4,
                      "critic gradients": c_trainable * 4, "critic optimizer": c_trainable * 8,
                      "critic autocast copies": parts["autocast copies"],
                      "critic activations": parts["activations"]})  # the same blocks, no logits
    copies = parts["autocast copies"] + parts.get("critic autocast copies", 0)
    phases = {
        "sampling": parts["KV cache"] + 2 * decoded * V * 4 + copies,
        # NOTE: the logits, their copy and logsumexp's, and the blocks' no-grad temporaries
        "scoring": 3 * unit + copies + ((u * P + n * T) * full + kv_copies if scores_shared
                                        else n * S * full),
        "backward": train + copies,
        # NOTE: at backward's end every gradient exists, and the embedding's arrives as a dense
        #       (V, h) tensor before it is added into its .grad; in chunks a tied embedding adds
        #       its rows into the output layer's gradient in place (memory._TiedEmbedding)
        "optimizer": parts["gradients"] + copies + (4 * shape.embed_params if head_trainable
                                                    and not (tied and s.logprob_chunk) else 0),
    }
    if s.update_in_backward:
        # WHY: no gradient outlives its step. The largest is the embedding's dense (V, h) one; a
        #      tied output layer's waits for it, and the two are summed: two of them at once,
        #      except in chunks, where the embedding's rows are added into it in place.
        parts["gradients"] = 4 * shape.embed_params * (2 if tied and not s.logprob_chunk else 1)
        phases["optimizer"] = copies + (parts["gradients"] if head_trainable else 0)
    if critic:
        # WHY a phase of its own: ppo.Critic updates the value model after the policy, whose
        #      gradients are freed by then. (TRL's PPOTrainer backpropagates the summed losses of
        #      both at once, which would add these activations to the policy's backward.)
        phases["critic backward"] = (parts["critic activations"] + copies
                                     + parts["critic gradients"] * (1 if later else 0))
    persistent = sum(parts[k] for k in ("weights", "reference", "optimizer", "critic weights",
                                        "critic optimizer") if k in parts)
    peak_phase = max(phases, key=phases.get)
    # NOTE: the held-out evaluation runs between steps, beside the persistent parts
    return {"parts": parts, "phases": phases, "persistent": persistent, "peak_phase": peak_phase,
            "peak": persistent + phases[peak_phase], "evaluation": eval_memory(shape, s),
            "eval_command": shape.params * 4 + eval_memory(shape, s)}


def eval_memory(shape: ModelShape, s: StepSettings) -> int:
    """Bytes the held-out evaluation adds to the weights: greedy decoding of eval_batch_size
    prompts at once (evaluation.evaluate; `train_gsm8k.py eval` with --batch-size), through engine's
    sampler. Its parts:
        KV cache      every row's keys and values for prompt + completion, one buffer
                      (engine.in_place_cache), in the compute dtype
        prefill       one block's no-grad temporaries over all prompt tokens at once: q, k, v,
                      the attention output, the MLP's gate, up and their product (fp32, as on
                      a CPU; fitted as 6 h + 4 i floats a token), the attention scores
        logits        the last position's, fp32, and their softmax
    Measured against `train_gsm8k.py eval` on SmolLM2-135M (docs/real_model.md)."""
    rows, P, T = s.eval_batch_size, s.prompt_tokens, s.max_new_tokens
    dtype = 2 if s.bf16 else 4
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * (P + T) * rows * dtype
    prefill = rows * P * (4 * (6 * shape.hidden + 4 * shape.ffn) + 4 * shape.heads * P)
    return kv + prefill + 2 * rows * shape.vocab * 4


# ----------------------------------------------------------------------------------------------
# The verdict, and the flags that would make a run fit
# ----------------------------------------------------------------------------------------------
def fits(peak: float, gpu_gb: float) -> bool:
    """Whether a predicted tensor peak, with CUDA_RESERVE on top, fits a card of gpu_gb GiB."""
    return peak + CUDA_RESERVE <= gpu_gb * GiB


def candidate_changes(s: StepSettings) -> list[tuple[str, str, object]]:
    """Each single change of flags that lowers memory and leaves the math and the data alone:
    (the flag as typed, the setting it changes, the new value)."""
    n = min(s.micro_batch_size, s.group_size * s.prompts_per_step)
    k = min(s.sample_batch_size or s.group_size * s.prompts_per_step,
            s.group_size * s.prompts_per_step)
    return [(flag, key, value) for flag, key, value, useful in [
        ("--lora-r 16", "lora_r", 16, not s.lora_r),
        ("--gradient-checkpointing", "gradient_checkpointing", True, not s.gradient_checkpointing),
        ("--bf16", "bf16", True, not s.bf16),
        ("--logprob-chunk 1024", "logprob_chunk", 1024, not s.logprob_chunk),
        (f"--micro-batch-size {max(1, n // 2)}", "micro_batch_size", max(1, n // 2), n > 1),
        ("--offload-activations", "offload_activations", True, not s.offload_activations),
        ("--lean-activations", "lean_activations", True, not s.lean_activations),
        ("--update-in-backward", "update_in_backward", True,
         not s.update_in_backward and n == s.group_size * s.prompts_per_step),
        (f"--sample-batch-size {max(1, k // 2)}", "sample_batch_size", max(1, k // 2), k > 1),
    ] if useful]


def run_changes(s: StepSettings) -> list[tuple[str, str, object]]:
    """The last resort, changes to the run itself: half the prompts per step (down to 1), half
    the completion length (down to 64 tokens). As candidate_changes: (flag, setting, value)."""
    return [(flag, key, value) for flag, key, value, useful in [
        (f"--prompts-per-step {s.prompts_per_step // 2}", "prompts_per_step",
         s.prompts_per_step // 2, s.prompts_per_step > 1),
        (f"--max-new-tokens {s.max_new_tokens // 2}", "max_new_tokens", s.max_new_tokens // 2,
         s.max_new_tokens > 64),
    ] if useful]


def fixes(shape: ModelShape, s: StepSettings, gpu_gb: float, critic: bool) -> list[str] | None:
    """The flags that make a run fit ([] if it fits as it is, None if nothing here does).
    Greedy: add the change that lowers the peak most until it fits (run_changes only when no
    other is left), then drop each flag the others make unnecessary."""
    chosen: dict[str, tuple[str, object]] = {}  # setting -> (flag, value); a later halving wins

    def settings(without: str = "", **extra) -> StepSettings:  # s with the chosen changes
        return replace(s, **{**{k: v for k, (_, v) in chosen.items() if k != without}, **extra})

    def peak(without: str = "", **extra) -> float:
        return step_memory(shape, settings(without, **extra), critic)["peak"]

    while not fits(peak(), gpu_gb):
        options = candidate_changes(settings()) or run_changes(settings())
        if not options:
            return None
        flag, key, value = min(options, key=lambda o: peak(**{o[1]: o[2]}))
        chosen[key] = (flag, value)
    for key in list(chosen):
        if fits(peak(without=key), gpu_gb):
            del chosen[key]
    return [flag for flag, _ in chosen.values()]


# ----------------------------------------------------------------------------------------------
# The command: train_gsm8k.py plan
# ----------------------------------------------------------------------------------------------
def load_config(name: str):
    """A transformers config from a hub id, a local model folder or a config.json file."""
    from transformers import AutoConfig

    from recipe import checkpoint
    path = Path(name).expanduser()
    gguf = (path if name.endswith(".gguf")
            else checkpoint.offline_copy(name) if name in checkpoint.OFFLINE_COPIES else None)
    if gguf:  # NOTE: a GGUF file's own metadata (transformers reads it with the gguf package)
        try:
            return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (OSError, ValueError, ImportError) as e:
            raise InputError(f"--model {name}: cannot read its config: "
                             f"{str(e).strip().splitlines()[0]}") from None
    if (path.exists() or name.startswith((".", "/", "~")) or name.endswith(".json")
            or name.count("/") > 1) and not (path / "config.json").exists() and not path.is_file():
        raise InputError(f"--model {name}: no config.json there (give a hub id, a model folder "
                         f"or a config.json file)")
    try:
        return AutoConfig.from_pretrained(str(path) if path.exists() else name)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"--model {name}: cannot read its config: "
                         f"{str(e).strip().splitlines()[0]}") from None


def settings_of(gcfg, prompt_tokens: int, **run) -> StepSettings:
    """StepSettings from a grpo.GRPOConfig, the prompt length and the run's own settings
    (train_gsm8k.py's TrainConfig, EngineConfig and MemoryConfig fields, by the same names; any
    other name is ignored)."""
    given = {**run, **asdict(gcfg), "prompt_tokens": prompt_tokens}
    return StepSettings(**{k: given[k] for k in StepSettings.__dataclass_fields__ if k in given})


def prompt_tokens_of(tokenizer, prompts: list[str]) -> int:
    """The longest prompt in tokens: what grpo.sample_completions pads a step's prompts to."""
    return max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)


def plan(shape: ModelShape, s: StepSettings, gpu_gb: float) -> dict:
    """{method: step_memory(...) with "fits" and "fix" (fixes' flags)} for GRPO and PPO."""
    out = {}
    for method, critic in (("GRPO", False), (PPO_CRITIC, True)):
        res = step_memory(shape, s, critic)
        res.update(fits=fits(res["peak"], gpu_gb),
                   fix=fixes(shape, s, gpu_gb, critic))
        out[method] = res
    return out


def eval_peak(res: dict) -> float:
    """Bytes while the held-out evaluation runs in training: the persistent parts and its own."""
    return res["persistent"] + res["evaluation"]


def render(name: str, shape: ModelShape, s: StepSettings, gpu_gb: float, res: dict) -> str:
    """The plan as a table (GiB) and one verdict line per method."""
    gib = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    train = "LoRA r %d" % s.lora_r if s.lora_r else "full fine-tuning"
    size = (f"{shape.params / 1e9:.2f} B" if shape.params >= 1e9 else f"{shape.params / 1e6:.2f} M")
    lines = [f"Memory plan (projected): {name}, {size} parameters, {train}, "
             f"{'bf16 autocast' if s.bf16 else 'fp32'}, gradient checkpointing "
             f"{'on' if s.gradient_checkpointing else 'off'}, log-prob chunk "
             f"{s.logprob_chunk or 'off'}; G={s.group_size} x {s.prompts_per_step} prompts, "
             f"micro-batch {s.micro_batch_size}, {s.prompt_tokens} prompt + {s.max_new_tokens} "
             f"completion tokens; a {gpu_gb:g} GiB card", "",
             f"| part (GiB) | GRPO | {PPO_CRITIC} |", "|---|---|---|"]
    names = list(res[PPO_CRITIC]["parts"])
    for part in names:
        lines.append(f"| {part} | {gib(res['GRPO']['parts'].get(part, 0))} | "
                     f"{gib(res[PPO_CRITIC]['parts'][part])} |")
    lines.append(f"| **peak** (persistent parts + the {res['GRPO']['peak_phase']} / "
                 f"{res[PPO_CRITIC]['peak_phase']} phase) | **{gib(res['GRPO']['peak'])}** | "
                 f"**{gib(res[PPO_CRITIC]['peak'])}** |")
    lines.append(f"| with the CUDA allowance ({gib(CUDA_RESERVE)}) | "
                 f"{gib(res['GRPO']['peak'] + CUDA_RESERVE)} | "
                 f"{gib(res[PPO_CRITIC]['peak'] + CUDA_RESERVE)} |")
    lines.append(f"| on a CPU, with the runtime allowance ({gib(CPU_RUNTIME)}) | "
                 f"{gib(res['GRPO']['peak'] + CPU_RUNTIME)} | "
                 f"{gib(res[PPO_CRITIC]['peak'] + CPU_RUNTIME)} |")
    lines.append(f"| evaluation between steps (persistent parts + greedy decoding of "
                 f"{s.eval_batch_size} prompts) | {gib(eval_peak(res['GRPO']))} | "
                 f"{gib(eval_peak(res[PPO_CRITIC]))} |")
    lines.append("")
    lines.append(f"`train_gsm8k.py eval --batch-size {s.eval_batch_size}` alone (fp32 weights + "
                 f"its decoding): {gib(res['GRPO']['eval_command'])} GiB")
    for method, r in res.items():
        verdict = "fits" if r["fits"] else "does not fit"
        fix = ("" if r["fits"] else
               "; nothing here makes it fit" if r["fix"] is None else
               f"; it would fit with: {' '.join(r['fix'])}")
        lines.append(f"{method}: {verdict} on {gpu_gb:g} GiB{fix}")
    lines.append("(parts are not summed: the peak is the persistent parts plus the largest phase; "
                 "planner.py says how each is counted)")
    return "\n".join(lines)


def plan_command(argv: list[str], parse_args) -> dict:
    """`train_gsm8k.py plan [--gpu-gb G] [--prompt-tokens P] [--json] [training flags]`:
    parse_args is train_gsm8k.parse_args, so the training flags and presets mean what they mean
    there (an unknown flag is one line, exit 2)."""
    p = flags.OneLineParser(None, prog="train_gsm8k.py plan", add_help=False,
                            allow_abbrev=False)
    p.add_argument("--gpu-gb", type=float, default=24.0)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--json", action="store_true")
    p.add_argument("-h", "--help", action="store_true")
    a, rest = p.parse_known_args(argv)
    if a.help:
        print(PLAN_HELP)
        return {}
    if not a.gpu_gb > 0:
        raise InputError(f"--gpu-gb must be > 0 (the card's memory in GiB), got {a.gpu_gb:g}")
    if a.prompt_tokens < 1:
        raise InputError(f"--prompt-tokens must be >= 1, got {a.prompt_tokens}")
    tcfg, gcfg, _, ecfg, mcfg, _ = parse_args(rest)
    if tcfg.model:
        name, config = tcfg.model, load_config(tcfg.model)
    else:  # the tiny world's model, as tiny_world.warm_start builds it
        from recipe import tiny_world
        ws = tiny_world.WarmStartConfig()
        name = "the tiny world's model"
        config = tiny_world.tiny_llama(tiny_world.char_tokenizer(), hidden=ws.hidden,
                                       layers=ws.layers, heads=ws.heads).config
    shape, s = model_shape(config), settings_of(gcfg, a.prompt_tokens, **asdict(tcfg),
                                                **asdict(ecfg), **asdict(mcfg))
    res = plan(shape, s, a.gpu_gb)
    out = {"model": name, "gpu_gb": a.gpu_gb, "cuda_reserve_bytes": CUDA_RESERVE,
           "cpu_runtime_bytes": CPU_RUNTIME,
           "parameters": shape.params, "settings": asdict(s),
           **{m: {"parts_bytes": r["parts"], "phases_bytes": r["phases"],
                  "peak_phase": r["peak_phase"], "total_bytes": r["peak"], "fits": r["fits"],
                  "flags_to_fit": r["fix"], "evaluation_bytes": eval_peak(r)}
              for m, r in res.items()},
           "eval_command_bytes": res["GRPO"]["eval_command"]}
    print(json.dumps(out) if a.json else render(name, shape, s, a.gpu_gb, res))
    return out


PLAN_HELP = """usage: python train_gsm8k.py plan [--gpu-gb G] [--prompt-tokens P] [--json] [flags]

Predict the peak memory of one training step, part by part, for GRPO and for PPO with a critic
the policy's size, from the model's config alone (no weights), and say whether each fits a card.

  --gpu-gb G          the card's memory in GiB (default 24; a "24 GB" card has 24 GiB)
  --prompt-tokens P   tokens in a prompt, chat template included (default 256)
  --json              one JSON object: each part in bytes, the total, the verdict per method
  flags               any of `python train_gsm8k.py --help`: --model (a hub id, a local folder
                      or a config.json), --preset, --bf16, --lora-r, --gradient-checkpointing,
                      --logprob-chunk, --micro-batch-size, --group-size, --prompts-per-step,
                      --max-new-tokens, --beta, --offload-activations, ...
A card the plan says fits is a projection: planner.py says how it is counted and how it was
checked (docs/planner.md)."""
