"""
tasks.py -- a task is data plus rewards, in TRL's format; the recipe's loop serves any task.

    task = load_task("DIR" | "tiny" | "openai/gsm8k", ["my_reward.py:fn", ...], ...)
    prompts, columns = prompts_and_columns(tokenizer, rows, system_prompt)  # grpo_step's input

A row is a dict with a "prompt" and any other columns. The prompt is a string, used as it is, or a
list of chat messages [{"role": ..., "content": ...}] (TRL's conversational format), which the
tokenizer's chat template turns into text. Every reward function has TRL's signature
f(prompts, completions, **columns) -> list[float] and receives the other columns by name.

A folder's train.jsonl and test.jsonl hold such rows; --reward FILE.py:NAME names the functions.
GSM8K and the tiny world are two tasks built the same way: their rows come from gsm8k.py with the
question as a chat message, and their rewards are GSM8K's answer checkers. The loop in
train_gsm8k.py does not know which task it runs; evaluation.py scores any task's held-out rows.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpo
import rewards
from recipe import gsm8k
from recipe.flags import InputError


@dataclass
class Task:
    """What the loop needs to know of a task: its rows, its rewards and how to score held-out
    rows."""

    train: list[dict]
    """Training rows: {"prompt": str or chat messages, other columns...}."""
    test: list[dict]
    """Held-out rows, scored before and after training."""
    reward_funcs: list[Callable]
    """TRL-signature reward functions; each is logged as rewards/<name>."""
    reward_weights: list[float]
    """Their weights when --reward-weights is not given."""
    score_func: Callable
    """The held-out score: the mean of this over greedy completions (for a 0/1 reward, accuracy).
    The first reward; GSM8K's answer check under process supervision."""
    system_prompt: str
    """The task's own system message, used when --system-prompt is not given (chat models)."""
    shuffle: bool
    """Shuffle the training rows by --seed (rows from a file); generated rows come shuffled."""


# ----------------------------------------------------------------------------------------------
# Rows: from a folder of JSONL, or GSM8K's and the tiny world's
# ----------------------------------------------------------------------------------------------
def prompt_error(prompt) -> str:
    """Why `prompt` is not a row's prompt (a non-empty string, or a non-empty list of chat
    messages, each a dict with string 'role' and 'content'); '' when it is one."""
    if isinstance(prompt, str):
        return "" if prompt else "'prompt' is empty"
    if not isinstance(prompt, list) or not prompt:
        return "'prompt' must be a string or a non-empty list of chat messages"
    for m in prompt:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            return "each chat message in 'prompt' needs string 'role' and 'content'"
    return ""


def read_rows(path: Path) -> list[dict]:
    """TRL-format JSONL: one object per line with a 'prompt' and any other columns. A bad line
    raises InputError naming the file and line."""
    rows = []
    for n, row in gsm8k.json_lines(path):
        if not isinstance(row, dict) or "prompt" not in row:
            raise InputError(f"{path}:{n}: no 'prompt' column (a string, or a list of chat "
                             f"messages)")
        if why := prompt_error(row["prompt"]):
            raise InputError(f"{path}:{n}: {why}")
        rows.append(row)
    return rows


def holds_prompts(folder: Path) -> bool:
    """Whether a folder's train.jsonl is TRL-format (its first row has a 'prompt'), not GSM8K's
    {"question", "answer"}."""
    path = folder / "train.jsonl"
    if not path.is_file():
        return False
    with path.open(encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and "prompt" in row


def gsm8k_prompt(tokenizer, question: str, system_prompt: str = "", template: str = "plain") -> str:
    """The text of a GSM8K question's prompt, as a run renders it (gsm8k_rows, render_prompt)."""
    row = gsm8k_rows([{"question": question, "answer": ""}], template)[0]
    return render_prompt(tokenizer, row["prompt"], system_prompt)


def gsm8k_rows(rows: list[dict], template: str = "plain") -> list[dict]:
    """GSM8K's {"question", "answer"} rows as task rows: the question as one user message (R1's
    template: the whole prompt as text), with the question and the answer as columns."""
    out = []
    for r in rows:
        if template == "r1":
            prompt = gsm8k.R1_TEMPLATE.format(question=r["question"].strip())
        else:
            prompt = [{"role": "user", "content": r["question"]}]
        out.append({"prompt": prompt, "question": r["question"], "answer": r["answer"]})
    return out


# ----------------------------------------------------------------------------------------------
# Rewards: GSM8K's, or functions named FILE.py:NAME
# ----------------------------------------------------------------------------------------------
def load_reward(spec: str) -> Callable:
    """The function NAME defined in FILE.py, from --reward FILE.py:NAME. A missing file, a file
    that fails to import, or a NAME it does not define raises InputError naming them."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise InputError(f"--reward {spec!r}: expected FILE.py:NAME, e.g. my_reward.py:reward")
    file = Path(path).expanduser()
    if not file.is_file():
        raise InputError(f"--reward {spec}: the file {file} does not exist")
    # WHY a name from the path: two reward files of the same name load as two modules.
    module_name = "reward_" + hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    if module_spec is None:
        raise InputError(f"--reward {spec}: {file} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # WHY: whatever the user's file raises, say which file, in one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise InputError(f"--reward {spec}: importing {file} failed: "
                         f"{type(e).__name__}: {first}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise InputError(f"--reward {spec}: {file} defines no {name!r}")
    if not callable(fn):
        raise InputError(f"--reward {spec}: {name!r} in {file} is not a function")
    return fn


def gsm8k_rewards(supervision: str, template: str) -> tuple[list, list[float], Callable]:
    """(reward functions, default weights, held-out score) of the GSM8K task: the final-answer
    check (logged with the format check at weight 0), R1's pair under template 'r1', or the
    calculator's step rewards under process supervision, scored by the final answer."""
    funcs = gsm8k.reward_funcs_for(supervision, template)
    weights = (gsm8k.default_reward_weights(template) if supervision == "outcome"
               else [1.0] * len(funcs))
    return funcs, weights, rewards.correctness_reward


def load_task(data: str, reward_specs: list[str], supervision: str = "outcome",
              template: str = "plain", eval_size: int = 500, n_train: int = 0,
              seed: int = 0) -> Task:
    """The task a run trains on: rows from `data` (a folder of TRL-format JSONL; else GSM8K's
    rows: 'tiny', 'openai/gsm8k' or a folder of GSM8K JSONL), and the rewards `reward_specs` names
    (FILE.py:NAME each; none: GSM8K's). n_train: how many rows the tiny world generates."""
    folder = Path(data).expanduser()
    if data not in ("tiny", "openai/gsm8k") and folder.is_dir() and holds_prompts(folder):
        if template != "plain":
            raise InputError(f"--template {template} wraps GSM8K's questions; the rows in {data} "
                             f"carry their own prompts")
        train, test = read_rows(folder / "train.jsonl"), read_rows(folder / "test.jsonl")
        test, system_prompt = test[:eval_size], ""
    else:
        train, test = gsm8k.load_data(data, eval_size, n_train, seed=seed)
        train, test = gsm8k_rows(train, template), gsm8k_rows(test, template)
        system_prompt = gsm8k.GSM8K_SYSTEM_PROMPT
    if reward_specs:
        if supervision == "process":
            raise InputError("--supervision process uses the calculator's step rewards: "
                             "not with --reward")
        funcs = [load_reward(s) for s in reward_specs]
        weights, score = [1.0] * len(funcs), funcs[0]  # WHY 1.0 each: TRL's default weights
    else:
        if "answer" not in (train or test)[0]:
            raise InputError(f"--data {data}: its rows have no 'answer' column, which GSM8K's "
                             f"default reward reads: name yours with --reward FILE.py:NAME")
        funcs, weights, score = gsm8k_rewards(supervision, template)
    return Task(train, test, list(funcs), weights, score, system_prompt,
                shuffle=data != "tiny")


def check_rewards(task: Task, cfg: grpo.GRPOConfig, specs: list[str] = ()):
    """Call every reward function once on two training rows before any model is loaded, with
    empty completions, so one that returns the wrong number of values or a non-number, or raises
    (a column it reads that the rows lack, say), fails now, not at step 1 of a long run."""
    if cfg.supervision == "process":
        return  # WHY: step rewards are lists, checked by grpo.score_steps
    names = specs or [grpo.reward_name(f) for f in task.reward_funcs]
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(task.reward_funcs):
        raise InputError(f"--reward-weights needs {len(task.reward_funcs)} values "
                         f"({', '.join(names)})")
    rows = task.train[:2]
    prompts = [render_prompt(None, r["prompt"]) for r in rows]  # NOTE: no tokenizer yet
    for fn, name in zip(task.reward_funcs, names):
        try:
            grpo.compute_rewards([fn], prompts, [""] * len(rows), columns_of(rows))
        except Exception as e:  # WHY: whatever a user's function raises, name it, in one line
            # NOTE: compute_rewards' own checks already say "reward function 'f' returned ..."
            why = (str(e) if is_reward_failure(e) else f"{type(e).__name__}: {e}").splitlines()[0]
            raise InputError(f"--reward {name}: {why} (tried on two training rows with empty "
                             f"completions)") from None


class RewardFailed(ValueError):
    """A reward function raised during the run (guarded says which, and what it raised)."""


def guarded(fn: Callable) -> Callable:
    """`fn` whose exceptions become RewardFailed, naming it: "reward function 'f' raised
    KeyError: 'answer'". The same name (grpo.reward_name) and the same results otherwise.
    WHY: a reward that fails at step 300 of a long run must stop it with one line, not a
    traceback through grpo.py (train_gsm8k.main turns it into one, as it does compute_rewards'
    own "reward function 'f' returned ..." checks)."""
    @functools.wraps(fn)
    def reward(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- whatever a user's function raises, name it
            why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            raise RewardFailed(f"reward function {grpo.reward_name(fn)!r} raised {why}") from e
    return reward


def is_reward_failure(e: Exception) -> bool:
    """Whether `e` says a reward function failed: it raised (RewardFailed), or grpo.py refused
    what it returned (compute_rewards' and score_steps' messages)."""
    return isinstance(e, RewardFailed) or (isinstance(e, (ValueError, TypeError)) and str(
        e).startswith(("reward function", "process reward")))


# ----------------------------------------------------------------------------------------------
# Prompts and columns: what grpo.grpo_step takes for a list of rows
# ----------------------------------------------------------------------------------------------
def render_prompt(tokenizer, prompt, system_prompt: str = "") -> str:
    """A row's prompt as text. A string is used as it is. Chat messages go through the tokenizer's
    chat template, with `system_prompt` first as a system message when given and the messages
    have none. NOTE: a tokenizer with no chat template (the tiny world's) gets the messages'
    contents, one a line, then a newline; the system prompt is for chat models only."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        return "\n".join(m["content"] for m in prompt) + "\n"
    if system_prompt and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": system_prompt}] + prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def columns_of(rows: list[dict]) -> dict:
    """Every column but the prompt, as lists lined up with `rows` (TRL passes a dataset's columns
    to the reward functions likewise). A column a row lacks is None there."""
    names = dict.fromkeys(k for r in rows for k in r if k != "prompt")
    return {k: [r.get(k) for r in rows] for k in names}


def prompts_and_columns(tokenizer, rows: list[dict], system_prompt: str = "") -> tuple[list, dict]:
    """(the prompt texts of `rows`, their columns): what grpo.grpo_step takes for them."""
    return [render_prompt(tokenizer, r["prompt"], system_prompt) for r in rows], columns_of(rows)
