"""
train_gsm8k.py -- train a model with GRPO (grpo.py) and show, on held-out problems, that it got better.

    python train_gsm8k.py                                     # tiny world, CPU, no network (preset "tiny")
    python train_gsm8k.py --preset qwen2.5-0.5b               # Qwen2.5-0.5B-Instruct on GSM8K, one GPU
    python train_gsm8k.py --preset qwen2.5-0.5b --data ../shared/data/gsm8k   # GSM8K from local JSONL
    python train_gsm8k.py --help                              # every flag, with its default and meaning
    python train_gsm8k.py --resume runs/tiny-20261202-101500  # continue a killed run from its last checkpoint
    python train_gsm8k.py summarize runs/a runs/b runs/c      # mean ± std table over finished runs

What it does: measure greedy accuracy on held-out problems, run `--steps` GRPO steps, measure again, and
write to --out DIR:
    summary.json    accuracy before/after, steps, wall time, model, data, the full config
    metrics.jsonl   one line per step with every metric of grpo.grpo_step, keyed by "step"
    curves.png      reward, accuracy, KL, clip ratio and completion length against step
    samples.jsonl   a few completions with their rewards every few steps (to spot reward hacking)
    final/          the trained model and tokenizer (`AutoModelForCausalLM.from_pretrained` loads it)
    checkpoint-<step>/  weights, AdamW state, RNG states and run state, every --save-every steps (crash-safe)

The "tiny" preset needs no download: tiny_world.py builds a ~0.5 M-parameter character-level Llama, gives it
a supervised warm start on GSM8K-style problems (cached on disk after the first run), then GRPO trains it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpo
import rewards


# ----------------------------------------------------------------------------------------------
# Configuration: one dataclass for the run; the algorithm's knobs live in grpo.GRPOConfig
# ----------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Everything about a run that is not the GRPO algorithm itself."""

    preset: str = "tiny"
    """Named starting configuration (see PRESETS); flags you pass override it."""
    model: str = ""
    """Hugging Face hub id or local directory. Empty: the preset's model (tiny: the cached warm start)."""
    data: str = ""
    """'tiny' (generated problems), a directory with GSM8K-format train.jsonl/test.jsonl, or 'openai/gsm8k'."""
    steps: int = 60
    """GRPO steps. Each step samples group_size completions for each of prompts_per_step prompts."""
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
    """Compute in bfloat16 autocast. Weights and AdamW state stay fp32, so lr 1e-6 updates are not lost."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (slower)."""
    system_prompt: str = ""
    """System message for models with a chat template; empty for none."""
    threads: int = 0
    """CPU threads for torch (0: torch's default). Set it when timing."""
    warm_start_steps: int = 800
    """Tiny world only: supervised steps of the warm start (a cached checkpoint per setting)."""
    warm_start_seed: int = 0
    """Tiny world only: seed of the warm start. Fixed by default, so every --seed starts from one model."""
    sample_every: int = 10
    """Every this many steps, write a few completions with their rewards to samples.jsonl."""
    save_every: int = 20
    """Checkpoint (model, optimizer, RNG, step, evaluations) every this many steps and at the end; 0: at the end."""
    resume: str = ""
    """A previous run's --out directory: continue it from its last checkpoint, with its own settings."""
    max_bad_steps: int = 3
    """Stop the run after this many steps in a row whose loss or gradient was not finite (each is skipped)."""
    out: str = ""
    """Output directory. Empty: runs/<preset>-<date>-<time>."""


GSM8K_SYSTEM_PROMPT = ("Solve the math problem step by step. "
                       "Finish with a last line of the form '#### <number>', giving only the final number.")

# Each preset: (TrainConfig overrides, GRPOConfig overrides), each override with its reason.
PRESETS = {
    "tiny": (
        dict(model="", data="tiny", device="cpu"),           # everything offline, built by tiny_world.py
        dict(group_size=8,                                   # paper: 64; 8 x 16 prompts is one CPU batch
             lr=1e-4,                                        # probe: 3e-4 and above drifted and lost accuracy
             max_new_tokens=96,                              # the longest tiny-world solution is 66 characters
             micro_batch_size=128),                          # the whole step in one pass; it fits easily
    ),
    "qwen2.5-0.5b": (
        dict(model="Qwen/Qwen2.5-0.5B-Instruct", data="openai/gsm8k",
             prompts_per_step=8, steps=200, eval_batch_size=64,
             bf16=True, gradient_checkpointing=True,          # fits a 24 GB card with fp32 AdamW state
             save_every=50,                                   # a checkpoint is ~6 GB (weights + AdamW state)
             system_prompt=GSM8K_SYSTEM_PROMPT),              # ask for GSM8K's '####' layout
        dict(group_size=8, lr=1e-6,                           # paper §4.2: lr 1e-6
             max_new_tokens=512,                              # GSM8K answers are long; a short cap zeroes reward
             micro_batch_size=8),                             # 8 sequences of up to ~700 tokens per pass
    ),
}


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source (as CleanRL/tyro do)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {a.target.id: b.value.value.strip() for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, title: str):
    """One --flag per field of `cls`, its help text from the field's docstring, its type from the annotation."""
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        flag, kind = "--" + f.name.replace("_", "-"), str(f.type)
        presets = "".join(f"; {p}: {o[f.name]}" for p, over in PRESETS.items() for o in over if f.name in o)
        kw = dict(dest=f.name, default=argparse.SUPPRESS,
                  help=f"{docs.get(f.name, '')} (default: {f.default!r}{presets})")
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif kind.startswith("list[float]"):
            group.add_argument(flag, type=float, nargs="+", **kw)
        else:
            base = {"int": int, "float": float, "str": str}[kind.split(" |")[0]]
            group.add_argument(flag, type=base, **kw)
    return group


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line ("error: ...") instead of the whole usage block."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


# With --resume, the run keeps the settings it was started with; only these may change (none alters the math).
RESUME_MAY_CHANGE = {"resume", "steps", "save_every", "sample_every", "threads", "device", "eval_batch_size",
                     "max_bad_steps"}


def parse_args(argv=None) -> tuple[TrainConfig, grpo.GRPOConfig]:
    """Flags override the preset, which overrides the dataclass defaults. --resume DIR: DIR's saved settings."""
    parser = OneLineErrorParser(
        description="Train a causal LM with GRPO on GSM8K-style problems and report held-out accuracy "
                    "before and after. Defaults follow --preset; any flag overrides it.")
    add_dataclass_flags(parser, TrainConfig, "run")
    add_dataclass_flags(parser, grpo.GRPOConfig, "GRPO (grpo.GRPOConfig)")
    parser._option_string_actions["--preset"].choices = list(PRESETS)
    args = vars(parser.parse_args(argv))
    train_names = {f.name for f in dataclasses.fields(TrainConfig)}
    if args.get("resume"):
        state = json.loads((latest_checkpoint(Path(args["resume"])) / "state.json").read_text())
        saved = {**state["grpo_config"], **state["train_config"]}
        for k, v in args.items():
            if k not in RESUME_MAY_CHANGE and v != saved.get(k):
                may_change = ", ".join("--" + n.replace("_", "-") for n in sorted(RESUME_MAY_CHANGE))
                raise InputError(f"--resume continues a run with the settings it was started with; "
                                 f"--{k.replace('_', '-')} was {saved.get(k)!r} there (only {may_change} may change)")
        train_over, grpo_over = state["train_config"], state["grpo_config"]
    else:
        train_over, grpo_over = PRESETS[args.get("preset", TrainConfig.preset)]
    tcfg = TrainConfig(**{**train_over, **{k: v for k, v in args.items() if k in train_names}})
    try:
        gcfg = grpo.GRPOConfig(**{**grpo_over, **{k: v for k, v in args.items() if k not in train_names}})
    except ValueError as e:  # "group_size must be ..." -> "--group-size must be ...", the flag the user typed
        field, _, rest = str(e).partition(" ")
        raise InputError(f"--{field.replace('_', '-')} {rest}") from None
    return tcfg, gcfg


# ----------------------------------------------------------------------------------------------
# Data: every source becomes a list of {"question", "answer"} rows, GSM8K's own format
# ----------------------------------------------------------------------------------------------
class InputError(Exception):
    """Bad input from the user: printed as one line, exit code 2, nothing written."""


def read_jsonl(path: Path) -> list[dict]:
    """GSM8K-format JSONL: one {"question": str, "answer": str} object per line."""
    if not path.is_file():
        raise InputError(f"data file {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("question", "answer")):
            raise InputError(f"{path}:{n}: expected an object with string fields 'question' and 'answer'")
        try:
            rewards.gold_answer(row["answer"])
        except ValueError:
            raise InputError(f"{path}:{n}: the answer has no final number (expected '#### <number>')") from None
        rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise InputError(f"data file {path} has no rows")
    return rows


def load_data(tcfg: TrainConfig, n_train: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) from the tiny world, a local GSM8K-format directory, or the hub."""
    if tcfg.data == "tiny":
        import tiny_world
        return (tiny_world.make_problems(n_train, "train", seed=tcfg.seed + 1),
                tiny_world.make_problems(tcfg.eval_size, "test", seed=0))
    path = Path(tcfg.data).expanduser()
    if path.is_dir():
        return read_jsonl(path / "train.jsonl"), read_jsonl(path / "test.jsonl")[:tcfg.eval_size]
    if tcfg.data == "openai/gsm8k":
        try:
            import datasets
        except ImportError:
            raise InputError("--data openai/gsm8k needs `pip install datasets`, "
                             "or pass a directory with train.jsonl and test.jsonl") from None
        ds = datasets.load_dataset("openai/gsm8k", "main")
        return ([dict(r) for r in ds["train"]], [dict(r) for r in ds["test"]][:tcfg.eval_size])
    raise InputError(f"--data {tcfg.data!r} is not 'tiny', 'openai/gsm8k' or an existing directory")


def make_prompt(tokenizer, question: str, system_prompt: str) -> str:
    """The chat template when the tokenizer has one (instruct models); else the bare question and a newline."""
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question + "\n"


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
def resolve_device(name: str) -> str:
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def load_model(tcfg: TrainConfig, log=print):
    """(policy, tokenizer, model name) from the hub, a local directory, or the tiny world's warm start."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if tcfg.model:
        name = tcfg.model
        # A hub id is "name" or "org/name"; anything that exists on disk, starts like a path or has more
        # slashes is a local directory.
        looks_local = Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
        if looks_local and not Path(name).expanduser().is_dir():
            raise InputError(f"model directory {name} does not exist")
        path = str(Path(name).expanduser()) if looks_local else name
    else:
        import tiny_world
        ws = tiny_world.WarmStartConfig(steps=tcfg.warm_start_steps, seed=tcfg.warm_start_seed)
        path = str(tiny_world.warm_start(ws, log=log))
        name = f"tiny-world warm start ({ws.steps} supervised steps, seed {ws.seed})"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        # WHY fp32: AdamW on bf16 weights rounds lr-1e-6 updates away; bf16 compute comes from autocast.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except OSError as e:
        raise InputError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # NOTE: safe here: grpo.py masks by EOS position, not pad id
    return model, tokenizer, name


# ----------------------------------------------------------------------------------------------
# Evaluation: greedy accuracy with the same answer checker as training
# ----------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, rows, tcfg: TrainConfig, gcfg: grpo.GRPOConfig, desc="eval") -> float:
    from tqdm.auto import tqdm
    correct = 0.0
    for i in tqdm(range(0, len(rows), tcfg.eval_batch_size), desc=desc, leave=False, unit="batch"):
        chunk = rows[i:i + tcfg.eval_batch_size]
        prompts = [make_prompt(tokenizer, r["question"], tcfg.system_prompt) for r in chunk]
        out = grpo.sample_completions(model, tokenizer, prompts, gcfg, greedy=True, group_size=1)
        correct += sum(rewards.correctness_reward(out["completions"], [r["answer"] for r in chunk], prompts=prompts,
                                                  question=[r["question"] for r in chunk]))
    return correct / max(1, len(rows))


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------
def write_json_atomic(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def plot_curves(metrics: list[dict], evals: list[tuple[int, float]], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [m["step"] for m in metrics]
    panels = [("reward", ["reward"]), ("accuracy", ["rewards/correctness_reward"]), ("KL to reference", ["kl"]),
              ("clip ratio", ["clip_ratio/low", "clip_ratio/high"]), ("completion length", ["completions/mean_length"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, keys) in zip(axes, panels):
        for k in keys:
            # NOTE: under process supervision there is no rewards/correctness_reward; `reward` is the accuracy.
            ax.plot(steps, [m.get(k, m["reward"] if k == "rewards/correctness_reward" else math.nan) for m in metrics],
                    label=k if len(keys) > 1 else "train samples")
        if title == "accuracy" and evals:
            ax.plot(*zip(*evals), "o-", color="black", label="held-out, greedy")
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(keys) > 1 or title == "accuracy":
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Validation, up front
# ----------------------------------------------------------------------------------------------
def validate(tcfg: TrainConfig, gcfg: grpo.GRPOConfig):
    """Run settings that cannot work fail here, before any model is loaded (GRPOConfig checks its own)."""
    checks = [
        (tcfg.steps >= 0, f"--steps must be >= 0, got {tcfg.steps}"),
        (tcfg.prompts_per_step >= 1, f"--prompts-per-step must be >= 1, got {tcfg.prompts_per_step}"),
        (tcfg.eval_size >= 1, f"--eval-size must be >= 1, got {tcfg.eval_size}"),
        (tcfg.eval_batch_size >= 1, f"--eval-batch-size must be >= 1, got {tcfg.eval_batch_size}"),
        (tcfg.sample_every >= 1, f"--sample-every must be >= 1, got {tcfg.sample_every}"),
        (tcfg.save_every >= 0, f"--save-every must be >= 0, got {tcfg.save_every}"),
        (tcfg.max_bad_steps >= 1, f"--max-bad-steps must be >= 1, got {tcfg.max_bad_steps}"),
        (tcfg.threads >= 0, f"--threads must be >= 0, got {tcfg.threads}"),
        (gcfg.supervision == "process" or gcfg.reward_weights is None
         or len(gcfg.reward_weights) == len(REWARD_FUNCS),
         f"--reward-weights needs {len(REWARD_FUNCS)} values ({', '.join(f.__name__ for f in REWARD_FUNCS)})"),
    ]
    for ok, message in checks:
        if not ok:
            raise InputError(message)


def columns_of(rows: list[dict]) -> dict:
    """The per-prompt columns every reward function receives (TRL passes a dataset's columns the same way)."""
    return {"answer": [r["answer"] for r in rows], "question": [r["question"] for r in rows]}


def check_reward_funcs(funcs, rows: list[dict], gcfg: grpo.GRPOConfig):
    """Call every reward function once on a few gold solutions before any model is loaded, so one that
    returns the wrong number of values or a non-number fails now, not at step 1 of a long run."""
    if gcfg.supervision == "process":
        return  # step rewards are lists, checked by grpo.rollout
    try:
        grpo.compute_rewards(funcs, [r["question"] for r in rows], [r["answer"] for r in rows], columns_of(rows),
                             gcfg.reward_weights)
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from None


# WHY format_reward with weight 0: it is logged (rewards/format_reward) so a broken layout shows up,
# but the optimised reward is the paper's: is the final answer right.
REWARD_FUNCS = [rewards.correctness_reward, rewards.format_reward]
DEFAULT_REWARD_WEIGHTS = [1.0, 0.0]
# PAPER §4.1.3: process supervision rewards each calculator step and the final answer.
PROCESS_REWARD_FUNCS = [rewards.calculator_process_reward]


def reward_funcs_for(gcfg: grpo.GRPOConfig) -> list:
    return PROCESS_REWARD_FUNCS if gcfg.supervision == "process" else REWARD_FUNCS


# ----------------------------------------------------------------------------------------------
# Checkpoints: out/checkpoint-<step>/, written whole or not at all
# ----------------------------------------------------------------------------------------------
class TrainingStopped(Exception):
    """The run cannot go on (e.g. non-finite losses in a row). Printed as one line, exit code 1."""


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint in a run directory. Incomplete ones never have this name (see below)."""
    found = sorted(run_dir.glob("checkpoint-*/state.json"))
    if not found:
        raise InputError(f"--resume {run_dir}: no checkpoint there (a run writes checkpoint-<step>/ every "
                         f"--save-every steps)")
    return found[-1].parent


def all_finite(model) -> bool:
    import torch
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def save_checkpoint(out: Path, policy, tokenizer, optimizer, state: dict):
    """Everything a resumed run needs: weights and tokenizer (save_pretrained), AdamW moments, every RNG,
    and the run's own state (step, evaluations, settings) in state.json.

    WHY crash-safe: tiny_world.save_pretrained_atomic writes into a temporary directory and renames it to
    checkpoint-<step>, a name that never existed before; only then is the previous checkpoint deleted.
    A kill at any moment leaves at least one complete checkpoint, and latest_checkpoint picks the newest.
    """
    import io
    import torch
    import tiny_world
    if not all_finite(policy):  # WHY: never write a poisoned checkpoint over a good one
        raise TrainingStopped(f"refusing to save a checkpoint at step {state['step']}: the weights are not finite")
    trainer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "python_rng": random.getstate()}, trainer)
    path = tiny_world.save_pretrained_atomic(
        policy, tokenizer, out / f"checkpoint-{state['step']:06d}",
        extra_files={"state.json": json.dumps(state, indent=1), "trainer_state.pt": trainer.getvalue()})
    for old in out.glob("checkpoint-*"):
        if old != path:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(ckpt: Path, device: str, gcfg: grpo.GRPOConfig):
    """(policy, optimizer, state) from a checkpoint directory; restores every RNG as it was when saved."""
    import torch
    from transformers import AutoModelForCausalLM
    policy = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    policy = grpo.disable_dropout(policy).to(device)
    optimizer = grpo.make_optimizer(policy, gcfg)
    trainer = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(trainer["optimizer"])
    torch.set_rng_state(trainer["torch_rng"])
    if trainer["cuda_rng"]:
        torch.cuda.set_rng_state_all(trainer["cuda_rng"])
    random.setstate(trainer["python_rng"])
    return policy, optimizer, json.loads((ckpt / "state.json").read_text())


def keep_lines_up_to(path: Path, step: int):
    """Rewrite a JSONL log keeping the lines of steps <= `step` (a resumed run redoes the later ones).
    A torn last line, from a kill while writing, is dropped."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    t_command = time.perf_counter()  # WHY: the whole command, warm-start build included, for the 10-min budget
    tcfg, gcfg = parse_args(argv)
    if gcfg.reward_weights is None:
        gcfg = dataclasses.replace(gcfg, reward_weights=DEFAULT_REWARD_WEIGHTS)
    validate(tcfg, gcfg)
    import torch
    from tqdm.auto import tqdm

    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    device = resolve_device(tcfg.device)
    # WHY the extra rows: dynamic sampling tops batches up with fresh prompts (at most this many rounds).
    n_train = tcfg.steps * tcfg.prompts_per_step * (1 + gcfg.dynamic_sampling)
    train_rows, eval_rows = load_data(tcfg, n_train=n_train)
    reward_funcs = reward_funcs_for(gcfg)
    check_reward_funcs(reward_funcs, train_rows[:2], gcfg)
    policy, tokenizer, model_name = load_model(tcfg, log=tqdm.write)
    if not all_finite(policy):
        raise InputError(f"model {model_name!r} has non-finite weights")
    policy = grpo.disable_dropout(policy).to(device)
    # PAPER: the reference is the model GRPO starts from; a resumed run rebuilds it from the same source.
    ref = grpo.make_reference(policy) if gcfg.beta != 0 else None
    if ref is not None and tcfg.bf16:
        ref = ref.to(torch.bfloat16)  # WHY (memory): the frozen reference never needs fp32 master weights
    # WHY seed here, after loading: building the tiny warm start reseeds torch, so seeding earlier would make
    #     the first run (which builds it) differ from later ones (which load it from the cache).
    torch.manual_seed(tcfg.seed)
    random.seed(tcfg.seed)
    out = Path(tcfg.resume or tcfg.out or f"runs/{tcfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    if tcfg.resume:
        ckpt = latest_checkpoint(out)
        for junk in [*out.glob(".tmp-*"), *out.glob(".old-*")]:  # left by a kill in the middle of a save
            shutil.rmtree(junk, ignore_errors=True)
        del policy
        policy, optimizer, state = load_checkpoint(ckpt, device, gcfg)
        for name in ("metrics.jsonl", "samples.jsonl"):
            keep_lines_up_to(out / name, state["step"])
        tqdm.write(f"resuming {out} from {ckpt.name} (step {state['step']} of {tcfg.steps})")
    else:
        optimizer = grpo.make_optimizer(policy, gcfg)
        state = {"step": 0, "evals": [], "wall_seconds": 0.0, "bad_in_a_row": 0, "skipped_updates": 0,
                 "model": model_name, "refill_cursor": tcfg.steps * tcfg.prompts_per_step}
        out.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "samples.jsonl"):
            (out / name).write_text("")
    state.update(train_config=dataclasses.asdict(tcfg), grpo_config=dataclasses.asdict(gcfg))
    if tcfg.gradient_checkpointing:
        # NOTE: transformers 5 renamed it activation_checkpointing_enable; 4.x only has the old name.
        (getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable)()
        policy.config.use_cache = False
    policy.train()
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=tcfg.bf16)
    tqdm.write(f"model: {model_name} ({sum(p.numel() for p in policy.parameters()) / 1e6:.2f} M parameters) "
               f"on {device}; data: {tcfg.data} ({len(train_rows)} train, {len(eval_rows)} held out); out: {out}")

    t_start = time.perf_counter() - state["wall_seconds"]
    if not state["evals"]:
        with autocast:
            state["evals"].append((0, evaluate(policy, tokenizer, eval_rows, tcfg, gcfg, desc="eval before")))
        tqdm.write(f"held-out greedy accuracy before GRPO: {state['evals'][0][1]:.3f} on {len(eval_rows)} problems")
    acc_before = state["evals"][0][1]

    # WHY: tiny-world problems come out of the generator in random order, and there are --steps x
    #      --prompts-per-step of them; keeping that order means a run resumed with more --steps sees the same
    #      problems first. A file's rows are shuffled with the seed.
    order = (list(range(len(train_rows))) if tcfg.data == "tiny"
             else random.Random(tcfg.seed).sample(range(len(train_rows)), len(train_rows)))
    metrics_log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def more_prompts(k):
        """Dynamic sampling: k fresh prompts, from the rows no regular step uses (cycling if they run out)."""
        picked = [train_rows[order[(state["refill_cursor"] + i) % len(order)]] for i in range(k)]
        state["refill_cursor"] += k
        return [make_prompt(tokenizer, r["question"], tcfg.system_prompt) for r in picked], columns_of(picked)

    bar = tqdm(range(state["step"] + 1, tcfg.steps + 1), desc="GRPO", unit="step",
               initial=state["step"], total=tcfg.steps)
    for step in bar:
        idx = [order[(i + (step - 1) * tcfg.prompts_per_step) % len(order)] for i in range(tcfg.prompts_per_step)]
        rows = [train_rows[i] for i in idx]
        prompts = [make_prompt(tokenizer, r["question"], tcfg.system_prompt) for r in rows]
        with autocast:
            m = grpo.grpo_step(policy, ref, optimizer, tokenizer, prompts, reward_funcs, gcfg,
                               columns=columns_of(rows), return_samples=True, more_prompts=more_prompts)
        samples = m.pop("samples")
        m = {"step": step, **m}
        metrics_log.append(m)
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(m) + "\n")
        if step % tcfg.sample_every == 0 or step == 1:
            with open(out / "samples.jsonl", "a") as f:
                for s in samples[:: gcfg.group_size][:4]:
                    f.write(json.dumps({"step": step, **s}) + "\n")
        # NOTE: under process supervision `reward` is the final-answer step's reward, i.e. the accuracy.
        acc = m.get("rewards/correctness_reward", m["reward"])
        bar.set_postfix(reward=f"{m['reward']:.3f}", acc=f"{acc:.3f}", kl=f"{m['kl']:.4f}")
        tqdm.write(f"step {step:4d}/{tcfg.steps}  reward {m['reward']:.3f}  acc {acc:.3f}  "
                   f"zero-std {m['frac_reward_zero_std']:.2f}  kl {m['kl']:.4f}  "
                   f"len {m['completions/mean_length']:.1f}  entropy {m['entropy']:.3f}  {m['step_time']:.1f}s"
                   + ("  UPDATE SKIPPED (non-finite loss or gradient)" if m["skipped_updates"] else ""))

        # Numerical safety: grpo_step already skipped any non-finite update; several in a row means the
        # run itself is broken (a reward returning NaN, an lr far too high, bf16 overflow), so stop.
        state["skipped_updates"] += m["skipped_updates"]
        state["bad_in_a_row"] = state["bad_in_a_row"] + 1 if m["skipped_updates"] else 0
        if state["bad_in_a_row"] >= tcfg.max_bad_steps:
            kept = sorted(out.glob("checkpoint-*"))
            raise TrainingStopped(
                f"stopped at step {step}: {state['bad_in_a_row']} steps in a row had a non-finite loss or "
                f"gradient, so their updates were skipped and the weights are untouched; "
                f"{'the last checkpoint is ' + str(kept[-1]) if kept else 'no checkpoint was written'} "
                f"(check the reward functions and --lr; metrics.jsonl shows each step)")
        state["step"] = step
        if (tcfg.save_every and step % tcfg.save_every == 0) or step == tcfg.steps:
            state["wall_seconds"] = time.perf_counter() - t_start
            save_checkpoint(out, policy, tokenizer, optimizer, state)

    with autocast:
        acc_after = evaluate(policy, tokenizer, eval_rows, tcfg, gcfg, desc="eval after")
    evals = state["evals"] + [(tcfg.steps, acc_after)]
    wall = time.perf_counter() - t_start

    import tiny_world
    tiny_world.save_pretrained_atomic(policy, tokenizer, out / "final")
    plot_curves(metrics_log, evals, out / "curves.png")
    summary = {
        "accuracy_before": acc_before, "accuracy_after": acc_after, "accuracy_gain": acc_after - acc_before,
        "steps": tcfg.steps, "wall_seconds": wall, "model": state["model"], "data": tcfg.data,
        "eval_size": len(eval_rows), "device": device, "torch_threads": torch.get_num_threads(),
        "skipped_updates": state["skipped_updates"],
        "command_seconds": time.perf_counter() - t_command,  # this process only (a resumed run: since resuming)
        "train_config": dataclasses.asdict(tcfg), "grpo_config": dataclasses.asdict(gcfg),
    }
    write_json_atomic(out / "summary.json", summary)
    table = (f"\n| held-out greedy accuracy ({len(eval_rows)} problems) | before | after | change |\n"
             f"|---|---|---|---|\n"
             f"| {state['model']} | {acc_before:.3f} | {acc_after:.3f} | {acc_after - acc_before:+.3f} |\n"
             f"\n{tcfg.steps} GRPO steps, {wall / 60:.1f} min on {device}; results in {out}/")
    print(table)
    (out / "results.md").write_text(table.lstrip() + "\n")
    return summary


def summarize(run_dirs: list[str]) -> str:
    """A markdown table, mean ± std over runs, from each run's summary.json (for the README's results)."""
    import statistics
    runs = []
    for d in run_dirs:
        path = Path(d) / "summary.json"
        if not path.is_file():
            raise InputError(f"{path} does not exist (did that run finish?)")
        runs.append(json.loads(path.read_text()))

    def ms(key, scale=1.0, fmt="{:.1f}"):
        xs = [r[key] * scale for r in runs]
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return f"{fmt.format(statistics.mean(xs))} ± {fmt.format(sd)}"

    seeds = ", ".join(str(r["train_config"]["seed"]) for r in runs)
    rows = [f"| runs (seeds) | {len(runs)} ({seeds}) |", "|---|---|",
            f"| model | {runs[0]['model']} |", f"| held-out problems | {runs[0]['eval_size']} |",
            f"| GRPO steps | {runs[0]['steps']} |",
            f"| accuracy before GRPO (%) | {ms('accuracy_before', 100)} |",
            f"| accuracy after GRPO (%) | {ms('accuracy_after', 100)} |",
            f"| change (points) | {ms('accuracy_gain', 100)} (each run: "
            + ", ".join(f"{100 * r['accuracy_gain']:+.1f}" for r in runs) + ") |",
            f"| GRPO wall time per run, evaluations included (min) | {ms('wall_seconds', 1 / 60)} |",
            "| whole command per run, model load or warm-start build included (min) | "
            + (ms('command_seconds', 1 / 60) if all("command_seconds" in r for r in runs) else "not recorded") + " |",
            f"| device, torch threads | {runs[0]['device']}, {runs[0]['torch_threads']} |"]
    return "\n".join(rows)


def cli(argv=None) -> int:
    """The command line: runs main (or `summarize DIR...`); bad input is one line on stderr and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["summarize"]:
            print(summarize(argv[1:]))
        else:
            main(argv)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2), already printed
        return e.code if isinstance(e.code, int) else 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
