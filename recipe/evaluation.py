"""
evaluation.py -- a task's held-out score, and `train_gsm8k.py eval`: greedy, Maj@K and Pass@K.

    score = evaluate(model, tokenizer, task.score_func, task.test, cfg)   # mean reward, greedy
    python train_gsm8k.py eval --model runs/a --data D [--reward FILE.py:NAME] --k 8

The held-out score is the mean of the task's first reward over one greedy completion of each row;
for a 0/1 reward, that is accuracy (GSM8K: the share of right final answers, checked as training
checks them). `eval` adds K samples per row: Pass@K (the best of K; for a 0/1 reward, any right)
and, for GSM8K's answer check, Maj@K (the most common final answer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import grpo
import rewards
from recipe import gsm8k, tasks
from recipe.flags import InputError, as_input_error


def evaluate(model, tokenizer, score_func: Callable, rows: list[dict], cfg: grpo.GRPOConfig,
             system_prompt: str = "", batch_size: int = 100, desc: str = "eval",
             sample=None) -> float:
    """Mean of `score_func` over one greedy completion (cfg's max_new_tokens) of each row: for a
    0/1 reward, the share right. sample: a decode loop (grpo.Seams.sample; None: grpo.decode)."""
    from tqdm.auto import tqdm
    total = 0.0
    for i in tqdm(range(0, len(rows), batch_size), desc=desc, leave=False, unit="batch"):
        prompts, columns = tasks.prompts_and_columns(tokenizer, rows[i:i + batch_size],
                                                     system_prompt)
        out = grpo.sample_completions(model, tokenizer, prompts, cfg, greedy=True, group_size=1,
                                      sample=sample)
        total += sum(score_func(prompts=prompts, completions=out["completions"], **columns))
    return total / max(1, len(rows))


def maj_and_pass(completions: list[str], row: dict, prompt: str = "") -> tuple[bool, bool]:
    """Over K sampled completions of one GSM8K problem: (is the most common final answer right
    (Maj@K), is any completion right (Pass@K)). Answers are read as correctness_reward reads them;
    a completion with no answer does not vote, and a tie goes to the answer drawn first.

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


def eval_parser():
    """`train_gsm8k.py eval`'s flags."""
    from recipe import flags
    p = flags.OneLineParser(None, prog="train_gsm8k.py eval", description=(
        "Greedy score, Pass@K (best of K samples) and, for GSM8K's answer check, Maj@K (majority "
        "vote of K) on held-out rows, scored as training scores them (the task's first reward)."))
    p.add_argument("--model", required=True,
                   help="a hub id, a model folder, a run's --out folder or its final/ (then "
                        "every flag below marked RUN defaults to the run's own setting, so the "
                        "greedy score is the run's accuracy_after), or a LoRA checkpoint folder "
                        "(merged onto its base)")
    p.add_argument("--data", default=None,
                   help="RUN. 'openai/gsm8k' (default: its test split), a folder with "
                        "test.jsonl (GSM8K's rows, or rows with a 'prompt'), or 'tiny' (with "
                        "--limit)")
    p.add_argument("--reward", action="extend", nargs="+", default=None, metavar="FILE.py:NAME",
                   help="RUN. The task's rewards, as in training; the first is the score "
                        "(default: GSM8K's answer check)")
    p.add_argument("--k", type=int, default=8, help="samples per problem for Maj@K, Pass@K (8)")
    p.add_argument("--limit", type=int, default=None,
                   help="RUN (its --eval-size). The first N problems (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="RUN. Completion cap (default 512)")
    p.add_argument("--temperature", type=float, default=1.0, help="for the K samples (1.0)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="RUN (its --eval-batch-size). Sequences decoded at once (default 32): "
                        "memory grows with it, see `plan`")
    p.add_argument("--system-prompt", default=None,
                   help="RUN. System message for chat models (default: the task's; GSM8K's asks "
                        "for a '####' line)")
    p.add_argument("--template", choices=gsm8k.TEMPLATES, default=None,
                   help="RUN. The prompt the model was trained with (plain, default, or r1)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default=None,
                   help="RUN. Compiled decoding (engine.decode_compiled): on, off, or auto, on "
                        "from engine.AUTO_COMPILE_DECODE_STEPS decode steps (default auto)")
    p.add_argument("--seed", type=int, default=0, help="for the samples (0)")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


# eval's flags that default to the run's own setting (run_settings), and their defaults otherwise
EVAL_DEFAULTS = {"data": "openai/gsm8k", "reward": [], "limit": 0, "max_new_tokens": 512,
                 "batch_size": 32, "system_prompt": None, "template": "plain", "compile": "auto"}


def run_settings(model: str) -> dict:
    """The settings a run scored its held-out rows with, from the summary.json of the run whose
    folder (or final/) `model` names: eval's flag names to values; {} for any other model."""
    path = Path(model).expanduser()
    if (path / "final").is_dir():
        summary = path / "summary.json"
    elif path.name == "final":
        summary = path.parent / "summary.json"
    else:
        return {}
    if not summary.is_file():
        return {}
    saved = json.loads(summary.read_text())
    t, g = saved.get("train_config", {}), saved.get("grpo_config", {})
    e = saved.get("engine_config", {})
    return {"data": t.get("data"), "reward": t.get("reward"), "limit": t.get("eval_size"),
            "max_new_tokens": g.get("max_new_tokens"), "batch_size": t.get("eval_batch_size"),
            "system_prompt": t.get("system_prompt"), "template": t.get("template"),
            "compile": e.get("compile"), "bf16": t.get("bf16", False),
            # NOTE: the run's output layer: fp32 under --bf16 unless --no-fp32-logits or --plain
            "fp32_logits": t.get("fp32_logits", True) and not t.get("plain", False)}


def checked_eval_args(argv: list[str]):
    """eval's flags, each checked: a bad one raises InputError naming it."""
    a = eval_parser().parse_args(argv)
    # WHY: a run is scored as it scored itself; a flag given overrides the run's setting.
    run = run_settings(a.model)
    for name, default in EVAL_DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, run[name] if run.get(name) is not None else default)
    a.bf16, a.fp32_logits = run.get("bf16", False), run.get("fp32_logits", True)
    for name, low in [("k", 1), ("limit", 0), ("max_new_tokens", 1), ("batch_size", 1)]:
        if getattr(a, name) < low:
            raise InputError(f"--{name.replace('_', '-')} must be >= {low}, "
                             f"got {getattr(a, name)}")
    if not a.temperature > 0:
        raise InputError(f"--temperature must be > 0, got {a.temperature}")
    if a.data == "tiny" and not a.limit:
        raise InputError("--data tiny generates its problems: give --limit N")
    return a


def sampled_scores(model, tokenizer, task, rows, cfg, a, system_prompt: str, sample) -> tuple:
    """(Maj@K, Pass@K) over `rows`, K = a.k samples each: Pass@K the mean of the best of K scores;
    Maj@K the share of rows whose most common final answer is right (GSM8K's check only, else
    None)."""
    from tqdm.auto import tqdm
    is_gsm8k = task.score_func is rewards.correctness_reward
    maj = best = 0.0
    per = max(1, a.batch_size // a.k)  # problems per sampling batch
    for i in tqdm(range(0, len(rows), per), desc=f"{a.k} samples each", unit="batch"):
        chunk = rows[i:i + per]
        prompts, columns = tasks.prompts_and_columns(tokenizer, chunk, system_prompt)
        out = grpo.sample_completions(model, tokenizer, prompts, cfg, group_size=a.k,
                                      sample=sample)
        many = {k: [v for v in vs for _ in range(a.k)] for k, vs in columns.items()}
        scores = task.score_func(prompts=[p for p in prompts for _ in range(a.k)],
                                 completions=out["completions"], **many)
        for j, (row, prompt) in enumerate(zip(chunk, prompts)):
            best += max(scores[j * a.k:(j + 1) * a.k])
            if is_gsm8k:
                maj += maj_and_pass(out["completions"][j * a.k:(j + 1) * a.k], row, prompt)[0]
    return (maj / len(rows) if is_gsm8k else None), best / len(rows)


def decode_steps(a, n_rows: int) -> int:
    """The most decode steps eval takes on n_rows: a greedy pass in batches of a.batch_size, then
    K samples each in batches of a.batch_size // K rows, each batch up to a.max_new_tokens."""
    batches = -(-n_rows // a.batch_size) + -(-n_rows // max(1, a.batch_size // a.k))
    return batches * a.max_new_tokens


def eval_sampler(model, tokenizer, a, n_rows: int, device: str) -> tuple[str, object]:
    """(the sampler's name, the decode loop) eval scores with, as the run scored itself: the
    engine's, compiled as --compile says (auto: from the decode steps ahead, as a run decides);
    under a --bf16 run's settings, its fp32 output layer (in place) and bf16 autocast around each
    decode (precision.autocast_seams, as train_gsm8k.py applies them)."""
    from machinery import engine, precision
    ecfg = engine.EngineConfig(compile=a.compile, sampler=engine.sampler_for(
        a.compile, "engine", decode_steps(a, n_rows)))
    if a.bf16:
        precision.fp32_logits(model, a.fp32_logits)
    seams = engine.apply(ecfg, grpo.Seams(), grpo.eos_token_ids(model, tokenizer),
                         grpo.pad_token_id(model, tokenizer))
    if a.bf16:
        seams = precision.autocast_seams(seams, device.split(":")[0])
    return ecfg.sampler, seams.sample


def eval_command(argv: list[str]) -> dict:
    """`python train_gsm8k.py eval --model M [--data D] [--reward F.py:N] [--k 8] [--limit N]`:
    greedy score, Pass@K and (GSM8K) Maj@K on D's held-out rows, with a progress bar; --json for
    one JSON line."""
    import torch
    from machinery import engine
    a = checked_eval_args(argv)
    task = tasks.load_task(a.data, a.reward, template=a.template, eval_size=a.limit or 10**9)
    rows = task.test
    system_prompt = task.system_prompt if a.system_prompt is None else a.system_prompt
    from recipe import checkpoint
    device = checkpoint.device_of(a.device)
    model, tokenizer = load_for_eval(a.model)
    model = grpo.disable_dropout(model).to(device).eval()
    cfg = grpo.GRPOConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature)
    sampler, sample = eval_sampler(model, tokenizer, a, len(rows), device)
    greedy = evaluate(model, tokenizer, task.score_func, rows, cfg, system_prompt, a.batch_size,
                      "greedy", sample)
    torch.manual_seed(a.seed)
    maj, best = sampled_scores(model, tokenizer, task, rows, cfg, a, system_prompt, sample)
    res = {"model": a.model, "data": a.data, "problems": len(rows), "k": a.k,
           "sampler": engine.sampler_used(model, sampler), "bf16": a.bf16,
           "template": a.template, "temperature": a.temperature, "max_new_tokens": a.max_new_tokens,
           "score": grpo.reward_name(task.score_func), "greedy_accuracy": greedy,
           **({f"maj@{a.k}": maj} if maj is not None else {}), f"pass@{a.k}": best}
    table = "".join(f"| {name} | {100 * value:.1f} |\n" for name, value in
                    [("greedy", greedy), (f"Maj@{a.k}", maj), (f"Pass@{a.k}", best)]
                    if value is not None)
    print(json.dumps(res) if a.json else
          f"{a.model} on {a.data} ({len(rows)} held-out rows, scored by {res['score']}; K = {a.k} "
          f"samples at temperature {a.temperature:g}, up to {a.max_new_tokens} tokens)\n\n"
          f"| metric (mean score x 100) | % |\n|---|---|\n{table}")
    return res
