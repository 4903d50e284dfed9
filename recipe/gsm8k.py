"""
gsm8k.py -- the GSM8K task's data and reward functions (the tiny world's problems share both).

    rows = load_data("tiny" | "path/to/dir" | "openai/gsm8k", ...)   # {"question", "answer"} rows
    funcs = reward_funcs_for("outcome")        # the final-answer check, and the format, logged

Every source becomes a list of {"question": str, "answer": str} rows, GSM8K's own format (the answer
ends in `#### <number>`). A bad row fails at once with one line naming the file and line
(InputError), before any model loads. tasks.py makes them a task like any other (the question as a
chat message, the answer as a column); train_trl.py and ablation.py take their data from here.
"""

from __future__ import annotations

import json
from pathlib import Path

import rewards
from recipe.flags import InputError

GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem step by step. "
    "Finish with a last line of the form '#### <number>', giving only the final number."
)
# WHY a worked example: it shows a small model the layout the checker reads and keeps its answers
#     to a few lines, which is what makes a step cheap on a CPU (the smollm2-135m preset; its step 1
#     against GSM8K_SYSTEM_PROMPT's: docs/real_model.md). The example is none of the tiny world's
#     held-out problems (tiny_world.split_of gives it "train"; tests/test_flags.py).
EXAMPLE_SYSTEM_PROMPT = (
    "Solve the math problem with one short line of arithmetic per step, then a last line "
    "'#### <number>'. Example:\nQuestion: Tom has 3 bags of 5 pens and gives 4 away. How many "
    "are left?\nAnswer:\n3*5=15\n15-4=11\n#### 11"
)

# WHY format_reward with weight 0: it is logged (rewards/format_reward) so a broken layout shows up,
# but the optimised reward is the paper's: is the final answer right.
REWARD_FUNCS = [rewards.correctness_reward, rewards.format_reward]
DEFAULT_REWARD_WEIGHTS = [1.0, 0.0]
# PAPER §4.1.3: process supervision rewards each calculator step and the final answer.
PROCESS_REWARD_FUNCS = [rewards.calculator_process_reward]

R1_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
    "here </think> <answer> answer here </answer>. User: {question} Assistant:")
"""DeepSeek-R1-Zero's template (arXiv 2501.12948, Table 1), the prompt is the whole text: no chat
template, as R1-Zero trained a base model. {question} is the problem."""
TEMPLATES = ("plain", "r1")
# PAPER (R1-Zero): an accuracy reward and a format reward. Our choice of 0.5 for the format: less
# than a right answer, so a well-formed wrong one never outscores a right one.
R1_REWARD_FUNCS = [rewards.correctness_reward, rewards.r1_format_reward]
R1_REWARD_WEIGHTS = [1.0, 0.5]


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def json_lines(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a JSONL file. A missing or empty file,
    or a line that is not JSON, raises InputError naming the file (and the line)."""
    if not path.is_file():
        raise InputError(f"data file {path} does not exist")
    values = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            values.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not values:
        raise InputError(f"data file {path} has no rows")
    return values


def read_jsonl(path: Path) -> list[dict]:
    """GSM8K-format JSONL: one {"question": str, "answer": str} object per line."""
    rows = []
    for n, row in json_lines(path):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str)
                                                for k in ("question", "answer")):
            raise InputError(
                f"{path}:{n}: expected an object with string fields 'question' and 'answer'"
            )
        try:
            rewards.gold_answer(row["answer"])
        except ValueError:
            raise InputError(f"{path}:{n}: the answer has no final number "
                             f"(expected '#### <number>')") from None
        rows.append({"question": row["question"], "answer": row["answer"]})
    return rows


def load_data(
    data: str, eval_size: int, n_train: int, seed: int = 0
) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) from the tiny world ('tiny': n_train generated problems, the
    order set by seed), a local directory with train.jsonl and test.jsonl, or the hub
    ('openai/gsm8k')."""
    if data == "tiny":
        from recipe import tiny_world
        return (tiny_world.make_problems(n_train, "train", seed=seed + 1),
                tiny_world.make_problems(eval_size, "test", seed=0))
    path = Path(data).expanduser()
    if path.is_dir():
        return read_jsonl(path / "train.jsonl"), read_jsonl(path / "test.jsonl")[:eval_size]
    if data == "openai/gsm8k":
        try:
            import datasets
        except ImportError:
            raise InputError("--data openai/gsm8k needs `pip install datasets`, "
                             "or pass a directory with train.jsonl and test.jsonl") from None
        try:
            ds = datasets.load_dataset("openai/gsm8k", "main")
        except OSError as e:  # WHY: no network, or offline mode: ConnectionError is an OSError
            raise InputError(f"--data openai/gsm8k: cannot load it from the hub "
                             f"({str(e).strip().splitlines()[0][:120]}); pass a folder with "
                             f"train.jsonl and test.jsonl instead") from None
        return [dict(r) for r in ds["train"]], [dict(r) for r in ds["test"]][:eval_size]
    raise InputError(f"--data {data!r} is not 'tiny', 'openai/gsm8k' or an existing directory")


# ----------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------
def reward_funcs_for(supervision: str, template: str = "plain") -> list:
    """The reward functions a run optimises: outcome checkers (with R1's format reward under
    template "r1"), or the calculator's step rewards."""
    if supervision == "process":
        return PROCESS_REWARD_FUNCS
    return R1_REWARD_FUNCS if template == "r1" else REWARD_FUNCS


def default_reward_weights(template: str = "plain") -> list[float]:
    """The weights of reward_funcs_for's outcome functions when --reward-weights is not given."""
    return R1_REWARD_WEIGHTS if template == "r1" else DEFAULT_REWARD_WEIGHTS
