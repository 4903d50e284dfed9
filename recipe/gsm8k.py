"""
gsm8k.py -- the GSM8K task: its data, its prompts, its reward functions and its held-out evaluation.

    rows = load_data("tiny" | "path/to/dir" | "openai/gsm8k", ...)   # {"question", "answer"} rows
    prompt = make_prompt(tokenizer, row["question"], system_prompt)  # the chat template, if any
    accuracy = evaluate(model, tokenizer, rows, cfg)                 # greedy, the training checker

Every source becomes a list of {"question": str, "answer": str} rows, GSM8K's own format (the answer
ends in `#### <number>`). A bad row fails at once with one line naming the file and line
(InputError), before any model loads. train_gsm8k.py, train_trl.py and ablation.py all take their
data from here.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpo
import rewards
from recipe.flags import InputError, as_input_error

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
    if not rows:
        raise InputError(f"data file {path} has no rows")
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


def make_prompt(tokenizer, question: str, system_prompt: str = "", template: str = "plain") -> str:
    """The chat template if the tokenizer has one (instruct models); else the question and "\n".
    template "r1": R1_TEMPLATE around the question, with no chat template or system prompt."""
    if template == "r1":
        return R1_TEMPLATE.format(question=question.strip())
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question + "\n"


def columns_of(rows: list[dict]) -> dict:
    """The per-prompt columns every reward function receives (TRL passes a dataset's likewise)."""
    return {"answer": [r["answer"] for r in rows], "question": [r["question"] for r in rows]}


def prompts_and_columns(tokenizer, rows: list[dict], system_prompt: str = "",
                        template: str = "plain") -> tuple[list, dict]:
    """(the prompt strings of `rows`, their columns): what grpo.grpo_step takes for them."""
    return ([make_prompt(tokenizer, r["question"], system_prompt, template) for r in rows],
            columns_of(rows))


# ----------------------------------------------------------------------------------------------
# Rewards, checked up front
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


def check_reward_funcs(funcs, rows: list[dict], cfg: grpo.GRPOConfig):
    """Call every reward function once on a few gold solutions before any model is loaded, so one
    that returns the wrong number of values or a non-number fails now, not at step 1 of a long
    run."""
    if cfg.supervision == "process":
        return  # WHY: step rewards are lists, checked by grpo.score_steps
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(funcs):
        names = ", ".join(grpo.reward_name(f) for f in funcs)
        raise InputError(f"--reward-weights needs {len(funcs)} values ({names})")
    try:
        grpo.compute_rewards(funcs, [r["question"] for r in rows], [r["answer"] for r in rows],
                             columns_of(rows), cfg.reward_weights)
    except (ValueError, TypeError) as e:
        raise InputError(str(e)) from None


# ----------------------------------------------------------------------------------------------
# Evaluation: greedy accuracy with the same answer checker as training
# ----------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, rows: list[dict], cfg: grpo.GRPOConfig, system_prompt: str = "",
             batch_size: int = 100, desc: str = "eval", template: str = "plain",
             sample=None) -> float:
    """Share of `rows` whose greedy completion (cfg's max_new_tokens) has the right final answer.
    sample: a decode loop (grpo.Seams.sample; None: grpo.decode)."""
    from tqdm.auto import tqdm
    correct = 0.0
    for i in tqdm(range(0, len(rows), batch_size), desc=desc, leave=False, unit="batch"):
        chunk = rows[i:i + batch_size]
        prompts = [make_prompt(tokenizer, r["question"], system_prompt, template) for r in chunk]
        out = grpo.sample_completions(model, tokenizer, prompts, cfg, greedy=True, group_size=1,
                                      sample=sample)
        correct += sum(
            rewards.correctness_reward(
                out["completions"],
                [r["answer"] for r in chunk],
                prompts=prompts,
                question=[r["question"] for r in chunk],
            )
        )
    return correct / max(1, len(rows))


# ----------------------------------------------------------------------------------------------
# train_gsm8k.py eval: greedy accuracy, Maj@K and Pass@K of a model on held-out problems
# ----------------------------------------------------------------------------------------------
def maj_and_pass(completions: list[str], row: dict, prompt: str = "") -> tuple[bool, bool]:
    """Over K sampled completions of one problem: (is the most common final answer right (Maj@K),
    is any completion right (Pass@K)). Answers are read as correctness_reward reads them; a
    completion with no answer does not vote, and a tie goes to the answer drawn first.

    Example, gold 5: answers 5, 3, 5, none -> (True, True); 3, 3, 5 -> (False, True);
    3, 5 -> (False, True), the tie going to 3."""
    from collections import Counter
    answers = [rewards.extract_answer(rewards.without_echo(c, prompt, row["question"]))
               for c in completions]
    gold = rewards.gold_answer(row["answer"])
    votes = Counter(a for a in answers if a is not None)  # NOTE: first drawn first, on ties
    return bool(votes) and votes.most_common(1)[0][0] == gold, gold in answers


def load_for_eval(name: str):
    """(model, tokenizer) of a hub id or a model folder; of a run's --out folder (its final/); or
    of a LoRA checkpoint: its adapters on the base model its adapter_config.json names, merged."""
    from recipe import checkpoint
    from machinery import lora
    path = Path(name).expanduser()
    if (path / "final" / "config.json").exists():
        return checkpoint.load_pretrained(str(path / "final"), name)
    if not lora.is_adapter_dir(path):
        return checkpoint.load_pretrained(name)
    base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise InputError(f"--model {name}: a LoRA checkpoint that names no base model")
    model, tokenizer = checkpoint.load_pretrained(base, f"{base} (the base of {name})")
    with as_input_error(lora.LoRAError):
        adapted = lora.adapters_from(model, str(path))
    return lora.merged(adapted), tokenizer


def eval_command(argv: list[str]) -> dict:
    """`python train_gsm8k.py eval --model M [--data D] [--k 8] [--limit N] ...`: greedy accuracy,
    Maj@K and Pass@K on D's held-out problems, with a progress bar; --json for one JSON line."""
    import torch
    from tqdm.auto import tqdm

    from recipe import flags
    p = flags.OneLineParser(None, prog="train_gsm8k.py eval", description=(
        "Greedy accuracy, Maj@K (majority vote of K samples) and Pass@K (any of K right) on "
        "held-out problems, checked as training checks them (rewards.correctness_reward)."))
    p.add_argument("--model", required=True,
                   help="a hub id, a model folder, a run's --out folder (its final/), or a "
                        "LoRA checkpoint folder (merged onto its base)")
    p.add_argument("--data", default="openai/gsm8k",
                   help="'openai/gsm8k' (default: its test split), a folder with test.jsonl, "
                        "or 'tiny' (with --limit)")
    p.add_argument("--k", type=int, default=8, help="samples per problem for Maj@K, Pass@K (8)")
    p.add_argument("--limit", type=int, default=0, help="the first N problems (0, default: all)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="completion cap (512)")
    p.add_argument("--temperature", type=float, default=1.0, help="for the K samples (1.0)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sequences decoded at once (32): memory grows with it, see `plan`")
    p.add_argument("--system-prompt", default=GSM8K_SYSTEM_PROMPT,
                   help="system message for chat models (default: the training one)")
    p.add_argument("--template", choices=TEMPLATES, default="plain",
                   help="the prompt the model was trained with (plain, default, or r1)")
    p.add_argument("--seed", type=int, default=0, help="for the samples (0)")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    for name, low in [("k", 1), ("limit", 0), ("max_new_tokens", 1), ("batch_size", 1)]:
        if getattr(a, name) < low:
            raise InputError(f"--{name.replace('_', '-')} must be >= {low}, "
                             f"got {getattr(a, name)}")
    if not a.temperature > 0:
        raise InputError(f"--temperature must be > 0, got {a.temperature}")
    if a.data == "tiny" and not a.limit:
        raise InputError("--data tiny generates its problems: give --limit N")
    _, rows = load_data(a.data, a.limit or 10**9, n_train=0, seed=0)
    from recipe import checkpoint
    device = checkpoint.device_of(a.device)
    model, tokenizer = load_for_eval(a.model)
    model = grpo.disable_dropout(model).to(device).eval()
    cfg = grpo.GRPOConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature)
    from machinery import engine  # NOTE: the fast sampler; it draws grpo.decode's tokens
    sample = engine.apply(engine.EngineConfig(), grpo.Seams(), grpo.eos_token_ids(model, tokenizer),
                          grpo.pad_token_id(model, tokenizer)).sample
    greedy = evaluate(model, tokenizer, rows, cfg, a.system_prompt, a.batch_size, "greedy",
                      a.template, sample)
    torch.manual_seed(a.seed)
    maj = pas = 0
    per = max(1, a.batch_size // a.k)  # problems per sampling batch
    for i in tqdm(range(0, len(rows), per), desc=f"{a.k} samples each", unit="batch"):
        chunk = rows[i:i + per]
        prompts = [make_prompt(tokenizer, r["question"], a.system_prompt, a.template)
                   for r in chunk]
        out = grpo.sample_completions(model, tokenizer, prompts, cfg, group_size=a.k, sample=sample)
        for j, (r, prompt) in enumerate(zip(chunk, prompts)):
            m, s = maj_and_pass(out["completions"][j * a.k:(j + 1) * a.k], r, prompt)
            maj, pas = maj + m, pas + s
    res = {"model": a.model, "data": a.data, "problems": len(rows), "k": a.k,
           "template": a.template, "temperature": a.temperature, "max_new_tokens": a.max_new_tokens,
           "greedy_accuracy": greedy, f"maj@{a.k}": maj / len(rows), f"pass@{a.k}": pas / len(rows)}
    print(json.dumps(res) if a.json else
          f"{a.model} on {a.data} ({len(rows)} held-out problems; K = {a.k} samples at temperature "
          f"{a.temperature:g}, up to {a.max_new_tokens} tokens)\n\n| metric | % |\n|---|---|\n"
          f"| greedy accuracy | {100 * greedy:.1f} |\n| Maj@{a.k} | {100 * maj / len(rows):.1f} |\n"
          f"| Pass@{a.k} | {100 * pas / len(rows):.1f} |")
    return res
