"""
tiny_world.py -- the offline stand-in for "a pretrained LM plus GSM8K", small enough for a CPU.

It is the R1 recipe in miniature: a supervised warm start that leaves a tiny model partly right,
then GRPO (train_gsm8k.py) makes it better. Nothing here downloads anything.

    char_tokenizer()     a real `PreTrainedTokenizerFast`, one token per character
                         (save/from_pretrained work)
    tiny_llama()         a randomly initialised `LlamaForCausalLM` (the warm start uses about
                         0.5 M parameters)
    make_problems()      GSM8K-style word problems of 1-3 steps, solved in GSM8K's layout:
                             3*4=<<3*4=12>>12
                             12+12=<<12+12=24>>24
                             #### 24
                         Train and test are disjoint by construction (a hash of the question
                         picks the split).
    warm_start()         supervised training on those solutions, stopped while the model is
                         still partly wrong; the checkpoint is cached on disk, built once and
                         reused.

Why the warm-start text has mistakes on purpose: real pretraining text is written by people who
slip. Here the careless author of the warm-start solutions works every step out right, then often
answers the wrong quantity: on 60% of multi-step problems the `####` line repeats the first step's
result instead of the last one (answering an intermediate quantity is a classic GSM8K error).
Imitation can only learn to copy that, so supervised training plateaus below what its own arithmetic
could reach. GRPO's reward checks the final answer against the truth, so it can do better than its
teacher. That is the point of RL after supervised training, shown at a size a laptop can run.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from recipe.checkpoint import default_cache_dir, load_pretrained, save_pretrained_atomic

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# WHY: printable ASCII plus newline covers GSM8K-style text; anything else maps to <unk>.
DEFAULT_CHARS = "\n" + "".join(c for c in string.printable if c.isprintable())


def char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """One token per character, plus <pad> <s> </s> <unk>. The pad token is distinct from EOS.

    WHY distinct: if pad == eos, masking pads would also mask the real EOS and the model would
    never be credited for stopping.
    """
    specials = [PAD, BOS, EOS, UNK]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(chars)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # every char alone
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()                                              # join with no spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS,
                                   unk_token=UNK)


def tiny_llama(tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4, ffn: int | None = None,
               max_positions: int = 512, seed: int = 0, vocab: int = 0) -> LlamaForCausalLM:
    """A randomly initialised Llama with tied embeddings; hidden=128, layers=4 gives about 1 M
    parameters. vocab: the embedding's rows (0: the tokenizer's; more, for a real vocabulary's
    memory: the extra rows are never drawn by the tokenizer but are in every softmax)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=ffn or 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    # NOTE: a fresh model's generation_config has no special ids; set them so generate() stops.
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def tiny_qwen2(tokenizer, seed: int = 0):
    """A randomly initialised Qwen2 (hidden 32, 2 layers): grouped-query attention (4 query heads
    share 2 key/value heads) and q/k/v biases, the architecture of the Qwen preset in small. For
    the samplers' tests (tests/test_engine.py) and benchmarks/gpu_check.py."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# ----------------------------------------------------------------------------------------------
# GSM8K-style word problems
# ----------------------------------------------------------------------------------------------
NAMES = ["Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Ben", "Lily", "Omar", "Nina", "Raj"]
ITEMS = ["apples", "pens", "cards", "books", "shells", "stamps", "marbles", "cookies", "stickers",
         "beads",
         "eggs", "coins"]
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a,
       b: a // b}
P = "prev"  # in a step, stands for the result of the step before


def _templates(r: random.Random):
    """One random problem: (question, steps). A step is (x, op, y); x or y may be P, the previous
    result."""
    n, items = r.choice(NAMES), r.choice(ITEMS)
    m = r.choice([x for x in NAMES if x != n])
    # WHY these small ranges: a ~0.5 M-parameter character model must learn the arithmetic in a few
    # minutes of supervised steps, so operands stay small (products within 6 x 6): larger
    # operands and the full times tables need far more supervised steps to learn.
    a, d = r.randint(10, 29), r.randint(2, 9)
    b, c, e = r.randint(2, 6), r.randint(2, 6), r.randint(2, 6)
    k = r.randrange(14)
    if k == 0:
        return f"{n} has {a} {items} and finds {d} more. How many {items} now?", [(a, "+", d)]
    if k == 1:
        return f"{n} has {a + d} {items} and gives away {d}. How many are left?", [(a + d, "-", d)]
    if k == 2:
        return f"{n} buys {b} boxes of {c} {items}. How many {items}?", [(b, "*", c)]
    if k == 3:
        return f"{n} splits {b * c} {items} into {b} equal bags. How many per bag?", [(b * c, "/",
                                                                                       b)]
    if k == 4:
        return f"There are {b} rows of {c} {items}. How many {items}?", [(b, "*", c)]
    if k == 5:
        return f"{n} has {a} {items} and buys {b} packs of {c}. How many {items} now?", [(b, "*",
                                                                                          c),
                                                                                          (a, "+",
                                                                                           P)]
    if k == 6:
        return (f"{n} buys {b} boxes of {c} {items} and gives {e} to {m}. How many are left?",
                [(b, "*", c), (P, "-", e)])
    if k == 7:
        return (f"{n} has {a} {items}, finds {d} more and loses {e}. How many {items} now?",
                [(a, "+", d), (P, "-", e)])
    if k == 8:
        return (f"{n} has {c * e + d} {items}, gives away {d} and shares the rest among {c} "
                f"friends. How many each?", [(c * e + d, "-", d), (P, "/", c)])
    if k == 9:
        return (f"{n} reads {b} pages a day for {c} days. The book has {a + b * c} pages. "
                f"How many are left?",
                [(b, "*", c), (a + b * c, "-", P)])
    if k == 10:
        return (f"{n} has {b} bags of {c} {items} and {m} has {e} bags. How many {items} in all?",
                [(b, "+", e), (P, "*", c)])
    if k == 11:
        return (f"{n} has {a} {items}, buys {b} packs of {c} and gives {d} to {m}. How many now?",
                [(b, "*", c), (a, "+", P), (P, "-", d)])
    if k == 12:
        pay = (b + c) * e + r.randint(1, 30)
        return (f"{items.capitalize()} cost ${e} each. {n} buys {b} and {m} buys {c}. "
                f"They pay ${pay}. How much change?", [(b, "+", c), (P, "*", e), (pay, "-", P)])
    spent = r.randint(1, b * c - 1)
    return (f"{n} earns ${b} an hour for {c} hours and spends ${spent}. How much is left?",
            [(b, "*", c), (P, "-", spent)])


SLIPS = ("answer", "arithmetic")


def solve(steps, slip_rate: float = 0.0, rng: random.Random | None = None,
          slip: str = "answer") -> tuple[str, int]:
    """GSM8K's layout for a chain of steps: one line `x op y=<<x op y=r>>r` per step, then `####
    answer`.

    With slip_rate > 0, the careless author slips on a problem of two or more steps, with that
    probability, in one of two ways (`slip`):
      'answer'      the `####` line repeats the FIRST step's result. Every step's arithmetic is
                    still right, so only the last line differs from the true solution.
      'arithmetic'  the first step's result is written one too high (`3*4=<<3*4=13>>13`) and the
                    later steps carry it on, so the answer is wrong because of an intermediate
                    step: the mistake a step-level check can point at and a final-answer check
                    cannot. Problems whose later steps divide are left alone (the division would
                    not come out even).
    slip_rate = 0 gives the true answer. Returns (solution text, the number on its `####` line).
    """
    if slip not in SLIPS:
        raise ValueError(f"slip must be one of {SLIPS}, got {slip!r}")
    slipped = slip_rate > 0 and len(steps) > 1 and rng.random() < slip_rate
    if slip == "arithmetic" and any(op == "/" for _, op, _ in steps[1:]):
        slipped = False
    lines, results = [], []
    for i, (x, op, y) in enumerate(steps):
        x, y = (results[-1] if x == P else x), (results[-1] if y == P else y)
        results.append(OPS[op](x, y) + (1 if slipped and slip == "arithmetic" and i == 0 else 0))
        lines.append(f"{x}{op}{y}=<<{x}{op}{y}={results[-1]}>>{results[-1]}")
    answer = results[0] if slipped and slip == "answer" else results[-1]
    return "\n".join(lines + [f"#### {answer}"]), answer


def split_of(question: str) -> str:
    """'test' for one question in ten, by a hash of its text; so train and test can never share
    one."""
    return "test" if int(hashlib.sha256(question.encode()).hexdigest(), 16) % 10 == 0 else "train"


def make_problems(n: int, split: str = "train", seed: int = 0,
                  slip_rate: float = 0.0, slip: str = "answer") -> list[dict]:
    """n distinct problems of one split, as GSM8K rows: {"question", "answer"} (answer = full
    solution).

    slip_rate > 0 writes careless solutions (see solve, and `slip` there); use it only for
    warm-start text, never as a gold.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    # WHY two generators: the same seed gives the same questions whatever the slip rate.
    r, slips = random.Random(f"{split}-{seed}"), random.Random(f"slips-{split}-{seed}")
    seen, rows = set(), []
    while len(rows) < n:
        question, steps = _templates(r)
        if question in seen or split_of(question) != split:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": solve(steps, slip_rate, slips, slip)[0]})
    return rows


def prompt_of(question: str) -> str:
    """The tiny world's prompt: the question and a newline; the solution follows directly."""
    return question + "\n"


# ----------------------------------------------------------------------------------------------
# The supervised warm start ("pretraining" for the tiny world), cached on disk
# ----------------------------------------------------------------------------------------------
@dataclass
class WarmStartConfig:
    """Settings of the supervised warm start. Any change builds (and caches) a new checkpoint."""

    hidden: int = 128
    """Model width. 128 with 2 layers and FFN 512 gives about 0.54 M parameters."""
    layers: int = 2
    """Transformer blocks. Each one adds to every step's time, supervised and GRPO alike; 2 keep
    the quick start to a few minutes on a laptop CPU."""
    heads: int = 4
    """Attention heads."""
    steps: int = 800
    """Supervised steps. Accuracy is still rising at 800; 800 is what fits a quick start of a few
    minutes with GRPO after it."""
    batch_size: int = 32
    """Problems per supervised step."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warm-up over 5% of steps, cosine decay to 10%)."""
    slip_rate: float = 0.6
    """Chance that a multi-step warm-start solution answers its first step's result (see solve). Our
    choice: above 0.5, so imitation learns the wrong quantity as the likelier answer, while sampling
    still writes the right one often enough for the verifier's reward to find it."""
    seed: int = 0
    """Seed for the weights and for the order of training problems."""
    slip: str = "answer"
    """The author's mistake (solve): 'answer' answers the first step's result; 'arithmetic'
    writes the first step's result one too high and carries it on (process supervision's fair
    test: its step rewards see the mistake, the final answer only that something is wrong)."""


def is_tiny_world_model(model: str) -> bool:
    """Whether --model names the tiny world: empty (the warm start), or a folder saved from it (a
    run's final/ or a checkpoint), known by its character tokenizer."""
    if not model:
        return True
    try:
        vocab = json.loads((Path(model).expanduser() / "tokenizer.json").read_text())
        return vocab["model"]["vocab"] == char_tokenizer().get_vocab()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def supervised_loss(model, tokenizer, rows: list[dict]) -> torch.Tensor:
    """Mean cross-entropy of the solution tokens (and the final EOS) given the question. Prompt
    tokens are masked."""
    prompts = [prompt_of(r["question"]) for r in rows]
    texts = [p + r["answer"] + tokenizer.eos_token for p, r in zip(prompts, rows)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                    add_special_tokens=False)
    labels = enc["input_ids"].clone()                                              # (n, L)
    labels[enc["attention_mask"] == 0] = -100
    for i, p in enumerate(prompts):
        # WHY: one token per character, so the prompt is exactly len(p) tokens
        labels[i, :len(p)] = -100
    return model(**enc, labels=labels).loss


def supervised_step(model, tokenizer, opt, rows: list[dict]) -> torch.Tensor:
    """One AdamW step on supervised_loss over `rows`, the gradient norm clipped to 1; the loss."""
    loss = supervised_loss(model, tokenizer, rows)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def warm_start_key(cfg: WarmStartConfig) -> str:
    """The warm start's cache key: a hash of its settings."""
    # WHY slip left out at its default: the checkpoints cached before it existed keep their key.
    settings = {k: v for k, v in asdict(cfg).items() if (k, v) != ("slip", "answer")}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def warm_start(cfg: WarmStartConfig = WarmStartConfig(), cache_dir: Path | None = None,
               log=print) -> Path:
    """Train (or reuse) the supervised warm start; return its `save_pretrained` directory.

    The directory name is a hash of `cfg`, so each setting is built once. It is written to a
    temporary directory and renamed into place, so an interrupted build never leaves a half-written
    checkpoint.
    """
    cache_dir = Path(cache_dir or default_cache_dir())
    out = cache_dir / f"warm-start-{warm_start_key(cfg)}"
    if (out / "config.json").exists():
        return out

    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer, hidden=cfg.hidden, layers=cfg.layers, heads=cfg.heads,
                       seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    warmup = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps)))))
    rows = make_problems(cfg.steps * cfg.batch_size, "train", seed=cfg.seed,
                         slip_rate=cfg.slip_rate, slip=cfg.slip)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"warm start: {n_params / 1e6:.2f} M parameters, {cfg.steps} supervised steps -> {out}")
    t0 = time.perf_counter()
    model.train()
    bar = tqdm(range(cfg.steps), desc="warm start", unit="step", leave=False)
    for step in bar:
        batch = rows[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        loss = supervised_step(model, tokenizer, opt, batch)
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()

    save_pretrained_atomic(model, tokenizer, out, extra_files={"warm_start.json": json.dumps(
        {**asdict(cfg), "final_loss": loss.item(), "seconds": time.perf_counter() - t0}, indent=1)})
    log(f"warm start: done in {time.perf_counter() - t0:.0f} s, final loss {loss.item():.3f}")
    return out


def more_supervised_steps(model, tokenizer, seconds: float,
                          cfg: WarmStartConfig = WarmStartConfig(),
                          lr: float | None = None, seed: int = 1) -> int:
    """Keep training `model` on the warm start's (slipped) text for `seconds` of wall time; return
    the number of steps taken. The control for "what RL adds beyond imitation": the same time spent
    imitating instead. lr defaults to where the warm start's schedule ended (10% of its peak)."""
    lr = cfg.lr * 0.1 if lr is None else lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    # WHY a different seed: fresh problems the warm start never saw, as GRPO's training prompts are.
    rows = make_problems(64 * cfg.batch_size, "train", seed=seed + 1000, slip_rate=cfg.slip_rate,
                         slip=cfg.slip)
    model.train()
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        if (step + 1) * cfg.batch_size > len(rows):
            rows += make_problems(64 * cfg.batch_size, "train", seed=seed + 1000 + step,
                                  slip_rate=cfg.slip_rate, slip=cfg.slip)
        batch = rows[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        supervised_step(model, tokenizer, opt, batch)
        step += 1
    model.eval()
    return step


def load_warm_start(steps: int, seed: int, log=print, slip: str = "answer"):
    """(model, tokenizer, name) of the warm start of `steps` supervised steps from `seed`, whose
    text slips as `slip` says, built on first use and cached (warm_start)."""
    ws = WarmStartConfig(steps=steps, seed=seed, slip=slip)
    name = (f"tiny-world warm start ({ws.steps} supervised steps, seed {ws.seed}"
            + ("" if slip == "answer" else f", {slip} slips") + ")")
    return (*load_pretrained(str(warm_start(ws, log=log)), name), name)


def load_model(name: str, warm_start_steps: int = 800, warm_start_seed: int = 0, log=print,
               slip: str = "answer"):
    """(model, tokenizer, name) of --model: a hub id, a folder or a .gguf file
    (checkpoint.load_pretrained); empty, the tiny world's warm start (load_warm_start), whose
    settings are the run's --warm-start-* flags. WHY here: the warm start is a property of the
    tiny world's model, so the loop loads every model the same way."""
    if not name:
        return load_warm_start(warm_start_steps, warm_start_seed, log, slip)
    return (*load_pretrained(name), name)
