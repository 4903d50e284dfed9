"""A task is data plus rewards (recipe/tasks.py): a task this project has never seen trains through
`train_gsm8k.py --data DIR --reward FILE.py:NAME` with plain and chat prompts, resumes to the same
numbers as an unbroken run, and reports its held-out score before and after; bad rows and bad
reward files are one-line errors that name the file, the line or the name; your_task/'s example
learns; and the README's own-model snippet moves the weights (fp32) where bf16 would not.

The task of its own here: "which letter comes next?" ("c" -> "d"), scored 1 for the right letter
first, on a random tiny Llama with a character tokenizer. Needs: torch, transformers. CPU, offline;
about 40 s, the your_task example's whole run (slow) about a minute.
"""

import json
import re
import string
import sys
from pathlib import Path

import pytest
import torch

import grpo
import train_gsm8k
from recipe import evaluation, report, tasks, tiny_world

ROOT = Path(__file__).resolve().parent.parent
LETTERS = string.ascii_lowercase
REWARD = '''
def next_letter(prompts, completions, target, **columns):
    return [1.0 if c[:1] == t else 0.0 for c, t in zip(completions, target)]

def length_penalty(prompts, completions, **columns):
    return [-len(c) / 10 for c in completions]
'''
# A chat template of the simplest kind: each message as "role: content", then "assistant:".
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_task(folder: Path, chat: bool) -> Path:
    """train.jsonl (letters a-t, each twice) and test.jsonl (u-y): {"prompt", "target"} rows."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, letters in [("train.jsonl", LETTERS[:20] * 2), ("test.jsonl", LETTERS[20:25])]:
        rows = [{"prompt": [{"role": "user", "content": c}] if chat else c + ">",
                 "target": LETTERS[LETTERS.index(c) + 1]} for c in letters]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def write_model(folder: Path, chat: bool) -> Path:
    """A random tiny Llama over letters and '>', saved as a model folder (with a chat template
    when `chat`)."""
    tok = tiny_world.char_tokenizer(LETTERS + ">:\n ")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    model = tiny_world.tiny_llama(tok, hidden=32, layers=1, heads=2, seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def task_dir(tmp_path):
    """(data folder, reward file, model folder) of the plain-prompt task."""
    reward = tmp_path / "letters.py"
    reward.write_text(REWARD)
    return (write_task(tmp_path / "plain", chat=False), reward,
            write_model(tmp_path / "model", chat=False))


def flags(data: Path, reward: Path, model: Path, out: Path, steps: int = 3) -> list[str]:
    return ["--data", str(data), "--reward", f"{reward}:next_letter", "--model", str(model),
            "--steps", str(steps), "--prompts-per-step", "4", "--group-size", "4",
            "--max-new-tokens", "3", "--lr", "1e-2", "--eval-size", "5", "--eval-every", "0",
            "--save-every", "1", "--sample-every", "1", "--threads", "1", "--device", "cpu",
            "--micro-batch-size", "16", "--out", str(out)]


def metrics_of(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock field, which no two runs share."""
    return [{k: v for k, v in json.loads(line).items() if k != "step_time"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


# --- rows and prompts -------------------------------------------------------------------------
def test_plain_prompts_are_used_as_they_are_and_chat_prompts_go_through_the_template():
    """A string is the prompt; messages go through the chat template with --system-prompt first;
    with no template, the contents one a line (the tiny world: its question and a newline)."""
    tok = tiny_world.char_tokenizer()
    assert tasks.render_prompt(tok, "c>", "ignored") == "c>"
    messages = [{"role": "user", "content": "c"}]
    assert tasks.render_prompt(tok, messages, "be brief") == "c\n"
    tok.chat_template = CHAT_TEMPLATE
    assert tasks.render_prompt(tok, messages, "be brief") == (
        "system: be brief\nuser: c\nassistant:")
    own = [{"role": "system", "content": "mine"}] + messages  # the row's own system message wins
    assert tasks.render_prompt(tok, own, "be brief") == "system: mine\nuser: c\nassistant:"


def test_gsm8k_rows_render_as_the_gsm8k_prompt_always_did():
    """GSM8K's questions become one user message: the tiny world's prompt is the question and a
    newline (its tokenizer has no chat template); R1's template is plain text; the columns a
    reward receives are the question and the answer."""
    rows = [{"question": "Tom has 3 pens.", "answer": "#### 3"}]
    tok = tiny_world.char_tokenizer()
    prompts, columns = tasks.prompts_and_columns(tok, tasks.gsm8k_rows(rows), "a system prompt")
    assert prompts == ["Tom has 3 pens.\n"]
    assert columns == {"question": ["Tom has 3 pens."], "answer": ["#### 3"]}
    r1 = tasks.gsm8k_rows(rows, "r1")[0]["prompt"]
    assert r1.endswith("User: Tom has 3 pens. Assistant:")


# --- a task of its own, through the whole loop ------------------------------------------------
def test_a_new_task_with_plain_prompts_trains_reports_and_resumes_exactly(task_dir, tmp_path):
    """Three steps in one go, and the same three steps killed after step 2 and resumed: the same
    metrics to the last digit and the same score after. The summary reports the held-out score
    (the first reward's mean over greedy completions) before and after; each reward is logged as
    rewards/<name>."""
    data, reward, model = task_dir
    whole = train_gsm8k.main(flags(data, reward, model, tmp_path / "whole"))
    assert whole["score"] == "next_letter" and whole["eval_size"] == 5
    assert 0 <= whole["accuracy_before"] <= 1 and 0 <= whole["accuracy_after"] <= 1
    m = metrics_of(tmp_path / "whole")
    assert len(m) == 3 and all("rewards/next_letter" in s for s in m)
    assert all(w.is_file() for w in [tmp_path / "whole" / "curves.png",
                                     tmp_path / "whole" / "final" / "config.json"])
    assert "held-out greedy score (mean next_letter, 5 rows)" in (
        tmp_path / "whole" / "results.md").read_text()
    assert "| score (mean next_letter) before GRPO (%) |" in report.summarize([tmp_path / "whole"])

    train_gsm8k.main(flags(data, reward, model, tmp_path / "broken", steps=2))
    (tmp_path / "broken" / "summary.json").unlink()  # as if killed after step 2's checkpoint
    resumed = train_gsm8k.main(["--resume", str(tmp_path / "broken"), "--steps", "3"])
    assert metrics_of(tmp_path / "broken") == m
    assert resumed["accuracy_after"] == whole["accuracy_after"]
    assert resumed["train_config"]["reward"] == [f"{reward}:next_letter"]


def test_a_new_task_with_chat_prompts_trains_through_the_chat_template(tmp_path):
    """Chat rows on a model with a chat template: the prompts the run sampled from are the
    template's text, with the task's system prompt (none) or --system-prompt's."""
    reward = tmp_path / "letters.py"
    reward.write_text(REWARD)
    data = write_task(tmp_path / "chat", chat=True)
    model = write_model(tmp_path / "model", chat=True)
    argv = flags(data, reward, model, tmp_path / "run") + ["--system-prompt", "next letter"]
    summary = train_gsm8k.main(argv)
    assert summary["train_config"]["system_prompt"] == "next letter"
    prompts = {json.loads(line)["prompt"]
               for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()}
    assert prompts and all(re.fullmatch(r"system: next letter\nuser: [a-t]\nassistant:", p)
                           for p in prompts), prompts


def test_two_rewards_are_logged_and_the_first_is_the_score(task_dir, tmp_path):
    """--reward A --reward B: both logged, the first scored, weights 1 each (TRL's default)."""
    data, reward, model = task_dir
    argv = flags(data, reward, model, tmp_path / "run", steps=1) + [
        "--reward", f"{reward}:length_penalty"]
    summary = train_gsm8k.main(argv)
    assert summary["grpo_config"]["reward_weights"] == [1.0, 1.0]
    m = metrics_of(tmp_path / "run")[0]
    assert {"rewards/next_letter", "rewards/length_penalty"} <= set(m)
    assert m["reward"] == pytest.approx(m["rewards/next_letter"] + m["rewards/length_penalty"],
                                        abs=1e-6)


def test_eval_scores_a_new_task_with_its_first_reward(task_dir, tmp_path, capsys):
    """`eval --data DIR --reward FILE:NAME`: the greedy score is the training run's own score
    after, and the best of K is at least the greedy score's chance; no Maj@K (no answers)."""
    data, reward, model = task_dir
    summary = train_gsm8k.main(flags(data, reward, model, tmp_path / "run", steps=2))
    res = evaluation.eval_command(["--model", str(tmp_path / "run"), "--data", str(data),
                                   "--reward", f"{reward}:next_letter", "--k", "2",
                                   "--max-new-tokens", "3", "--device", "cpu", "--json"])
    assert res["greedy_accuracy"] == summary["accuracy_after"]
    assert res["score"] == "next_letter" and "maj@2" not in res and 0 <= res["pass@2"] <= 1


# --- bad input: one line, naming what was wrong -----------------------------------------------
@pytest.mark.parametrize("line, expected", [
    ('{"target": "b"}', "train.jsonl:2: no 'prompt' column"),
    ('{"prompt": 3, "target": "b"}', "train.jsonl:2: 'prompt' must be a string or"),
    ('{"prompt": [{"role": "user"}], "target": "b"}', "train.jsonl:2: each chat message"),
    ('{"prompt": "a>"', "train.jsonl:2: not valid JSON"),
])
def test_a_bad_row_names_its_file_and_line(task_dir, tmp_path, capsys, line, expected):
    data, reward, model = task_dir
    rows = (data / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join([rows[0], line] + rows[1:]) + "\n")
    code = train_gsm8k.cli(flags(data, reward, model, tmp_path / "run"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("spec, expected", [
    ("{d}/nothere.py:next_letter", "the file {d}/nothere.py does not exist"),
    ("{d}/letters.py:no_such", "letters.py defines no 'no_such'"),
    ("{d}/letters.py", "expected FILE.py:NAME"),
    ("{d}/wrong_count.py:reward", "reward function 'reward' returned 1 values for 2 completions"),
    ("{d}/not_a_number.py:reward", "reward function 'reward' returned 'yes'; expected a number"),
    ("{d}/broken.py:reward", "importing {d}/broken.py failed: ZeroDivisionError"),
    ("{d}/missing_column.py:reward", "--reward {d}/missing_column.py:reward: TypeError: "),
])
def test_a_bad_reward_is_one_line_naming_it(task_dir, tmp_path, capsys, spec, expected):
    """A missing file, an undefined name, no name at all, a reward returning the wrong number of
    floats or a non-number, a file that raises on import, or a reward that raises (a column the
    rows lack): exit 2, one line, before any model loads."""
    data, _, model = task_dir
    (tmp_path / "wrong_count.py").write_text(
        "def reward(prompts, completions, **columns):\n    return [1.0]\n")
    (tmp_path / "not_a_number.py").write_text(
        "def reward(prompts, completions, **columns):\n    return ['yes'] * len(completions)\n")
    (tmp_path / "broken.py").write_text("1 / 0\n")
    (tmp_path / "missing_column.py").write_text(  # reads a column the rows do not have
        "def reward(prompts, completions, gold, **columns):\n    return [0.0] * len(gold)\n")
    argv = flags(data, tmp_path / "letters.py", model, tmp_path / "run")
    argv[argv.index("--reward") + 1] = spec.format(d=tmp_path)
    code = train_gsm8k.cli(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert expected.format(d=tmp_path) in err, err
    assert not (tmp_path / "run").exists()


def test_rows_without_an_answer_need_a_reward(task_dir, tmp_path, capsys):
    """Rows with a prompt but no --reward: GSM8K's default reward reads 'answer', which they lack:
    the error says to name a reward."""
    data, _, model = task_dir
    argv = flags(data, Path("x"), model, tmp_path / "run")
    del argv[argv.index("--reward"):argv.index("--reward") + 2]
    assert train_gsm8k.cli(argv) == 2
    assert "no 'answer' column" in capsys.readouterr().err


# --- learning, and your_task/: the template a forker starts from ------------------------------
DIGITS_REWARD = '''
def reversal_reward(prompts, completions, target, **columns):
    return [sum(a == b for a, b in zip(c[:3], t)) / 3 for c, t in zip(completions, target)]
'''


def test_a_new_task_learns_through_the_loop(tmp_path):
    """Reverse three digits ("307>" -> "703"), partial credit per digit in place, on a random
    tiny Llama (beta 0: no pull toward a random start): through --data and --reward, the held-out
    score rises from near chance (0.1; greedy decoding of a random model: about 0) by more than
    0.2 in 100 steps of 16 prompts x G = 8 (about 0.2 to 0.4 in three seeds, in seconds)."""
    import random
    r = random.Random(0)
    strings = r.sample([f"{i:03d}" for i in range(1000)], 900)
    for name, part in [("train.jsonl", strings[:800]), ("test.jsonl", strings[800:])]:
        (tmp_path / name).write_text("".join(
            json.dumps({"prompt": s + ">", "target": s[::-1]}) + "\n" for s in part))
    (tmp_path / "digits.py").write_text(DIGITS_REWARD)
    tok = tiny_world.char_tokenizer("0123456789>")
    model = tiny_world.tiny_llama(tok, hidden=64, layers=2, heads=4, seed=0)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    summary = train_gsm8k.main([
        "--data", str(tmp_path), "--reward", f"{tmp_path / 'digits.py'}:reversal_reward",
        "--model", str(tmp_path / "model"), "--beta", "0", "--lr", "3e-3", "--steps", "100",
        "--prompts-per-step", "16", "--max-new-tokens", "4", "--micro-batch-size", "128",
        "--eval-size", "100", "--eval-every", "0", "--save-every", "0", "--device", "cpu",
        "--threads", "2", "--out", str(tmp_path / "run")])
    assert summary["accuracy_before"] < 0.15, summary
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.2, summary


def your_task_command() -> list[str]:
    """The training command docs/your_task.md shows, as argv for train_gsm8k.main."""
    text = (ROOT / "docs" / "your_task.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("python train_gsm8k.py --model"))
    return line.split()[2:]


def test_your_task_runs_as_the_docs_say(tmp_path):
    """your_task/'s rows (written by its make_rows.py) and rewards, through the command
    docs/your_task.md shows, with a tiny chat model for SmolLM2 and 2 steps: the run scores with
    plural_reward, logs both rewards, and its prompts went through the chat template."""
    pytest.importorskip("peft", reason="the command trains LoRA adapters: pip install peft")
    sys.path.insert(0, str(ROOT / "your_task"))
    import make_rows
    make_rows.main(["--out", str(tmp_path / "data")])
    assert (tmp_path / "data" / "train.jsonl").read_text() == (
        ROOT / "your_task" / "data" / "train.jsonl").read_text()  # the committed rows are its own
    tok = tiny_world.char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tiny_world.tiny_llama(tok, hidden=32, layers=1, heads=2).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    argv = your_task_command()
    assert argv[argv.index("--model") + 1] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for flag, value in [("--data", tmp_path / "data"), ("--model", tmp_path / "m"),
                        ("--out", tmp_path / "run"), ("--steps", 2), ("--eval-every", 0)]:
        argv[argv.index(flag) + 1] = str(value)
    argv = [a.replace("your_task/reward.py", str(ROOT / "your_task" / "reward.py")) for a in argv]
    summary = train_gsm8k.main(argv + ["--eval-size", "4", "--threads", "2", "--save-every", "0"])
    assert summary["score"] == "plural_reward"
    logged = set(metrics_of(tmp_path / "run")[0])
    assert {"rewards/plural_reward", "rewards/one_word_reward"} <= logged
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("user: What is the plural of ")
    assert sample["prompt"].endswith("Answer with one word.\nassistant:")


def test_plural_reward_by_hand():
    """Target "wolves": alone or ending the first sentence 1.0; a wrong plural, a hedge, the
    singular echoed or a sentence cut off 0.0; the one-word reward counts only the word alone."""
    sys.path.insert(0, str(ROOT / "your_task"))
    import reward
    said = ["Wolves.", "The plural of wolf is wolves.", "The plural of wolf is wolfs.",
            "wolves or wolfs", 'The answer is "wolf".', "The plural of wolf is wolves, which is",
            ""]
    assert reward.plural_reward(None, said, ["wolves"] * 7) == [1, 1, 0, 0, 0, 0, 0]
    assert reward.one_word_reward(None, said, ["wolves"] * 7) == [1, 0, 0, 0, 0, 0, 0]


# --- low precision speaks up ------------------------------------------------------------------
def readme_snippet() -> str:
    """The README's own-model snippet: the python block under "Your own task and model"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own task and model"):]
    start = section.index("```python") + len("```python")
    return section[start:section.index("```\n", start)]


def test_the_readme_snippet_moves_the_weights_where_bf16_would_not(tmp_path, monkeypatch):
    """The README's snippet, run on a tiny model saved in bf16 (as Qwen2.5 and SmolLM2 are): it
    loads fp32 weights, and one step at its lr 1e-6 moves every one of them. Loaded in the
    checkpoint's own bf16, the same step leaves 98% where they were (only entries near 0, where
    bf16's steps are finer than 1e-6, move), and make_optimizer warns. The reward is
    swapped for one that varies in a group, since a random model never writes a right answer."""
    tok = tiny_world.char_tokenizer()
    tiny_world.tiny_llama(tok, hidden=32, layers=1, heads=2).to(torch.bfloat16).save_pretrained(
        tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    import rewards
    monkeypatch.setattr(rewards, "correctness_reward",
                        lambda completions, **kw: [len(c) / 100 for c in completions])
    code = readme_snippet().replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(tmp_path / "m")))
    assert "dtype=torch.float32" in code

    def moved(source: str) -> float:
        """The share of the weights' entries that one step of `source` changed."""
        scope = {}
        torch.manual_seed(0)
        exec(compile(source, "README.md", "exec"), scope)
        pairs = list(zip(scope["policy"].parameters(), scope["ref"].parameters()))
        changed = sum((p != q).sum().item() for p, q in pairs)
        return changed / sum(p.numel() for p, _ in pairs)

    assert moved(code) > 0.9                                  # measured: every entry
    with pytest.warns(UserWarning, match="torch.bfloat16: AdamW's updates below"):
        assert moved(code.replace("torch.float32", "torch.bfloat16")) < 0.05   # measured: 2%


def test_make_optimizer_warns_on_low_precision_weights_only():
    """bf16 or fp16 trainable weights: a warning naming the dtype and the fix; fp32, or a frozen
    bf16 base under fp32 adapters: none."""
    tok = tiny_world.char_tokenizer()
    model = tiny_world.tiny_llama(tok, hidden=16, layers=1, heads=2)
    cfg = grpo.GRPOConfig()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grpo.make_optimizer(model, cfg)                        # fp32: silent
        frozen = model.to(torch.bfloat16).requires_grad_(False)
        frozen.lm_head.weight.data = frozen.lm_head.weight.data.float()
        frozen.lm_head.requires_grad_(True)
        grpo.make_optimizer(frozen, cfg)                       # only fp32 trains: silent
    with pytest.warns(UserWarning, match=r"torch.float16.*dtype=torch.float32"):
        grpo.make_optimizer(model.to(torch.float16).requires_grad_(True), cfg)
