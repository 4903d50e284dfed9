"""
own_task_example.py -- the template for GRPO on YOUR task: your rows, your reward, grpo.py's step.

The task here: reverse a string of three digits ("307" -> "703"). A randomly initialised tiny model
gets better at it from a partial-credit reward alone (mean reward from chance, 0.1, to about 0.4 in
150 steps), offline, on a CPU, in about 15 seconds:

    python recipe/own_task_example.py       # the reward every 25 steps, then a few greedy answers

To make it yours, change three things and keep the loop:
    1. make_rows():  your data, one dict per prompt: a "prompt" plus any columns your reward needs;
    2. reversal_reward(): your reward, with TRL's signature f(prompts, completions, **columns) ->
       list[float];
    3. the tokenizer and model: any Hugging Face causal LM (here a tiny one from tiny_world.py).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # WHY: run as a script

import grpo  # noqa: E402
from recipe import tiny_world  # noqa: E402


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Your dataset: each row is a prompt plus the columns the reward reads (here "target")."""
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = "".join(r.choice("0123456789") for _ in range(3))
        rows.append({"prompt": digits + "=", "target": digits[::-1]})
    return rows


def reversal_reward(prompts, completions, target, **kwargs) -> list[float]:
    """Partial credit: the share of the three target positions the completion gets right.

    WHY partial credit: a random model almost never gets all three right (1 in 1,000), so an
    all-or-nothing reward would leave nearly every group with equal rewards and zero advantage:
    nothing to learn from.
    """
    return [sum(a == b for a, b in zip(c[:3], t)) / 3 for c, t in zip(completions, target)]


def main(steps: int = 200, seed: int = 0, log=print) -> list[float]:
    torch.manual_seed(seed)
    tok = tiny_world.char_tokenizer("0123456789=")
    model = tiny_world.tiny_llama(tok, hidden=64, layers=2, heads=4, seed=seed)
    # lr 3e-3: our choice for a ~100 k-parameter model; max_new_tokens 4: three digits and an EOS.
    # DEVIATION: beta = 0 (no reference model). The model starts random, so a KL pull toward its
    #            random start would only slow learning; with a pretrained model keep the paper's
    #            0.04.
    cfg = grpo.GRPOConfig(group_size=8, max_new_tokens=4, lr=3e-3, beta=0.0, micro_batch_size=128)
    ref, opt = None, grpo.make_optimizer(model, cfg)

    rows, history = make_rows(steps * 16, seed), []
    for step in range(steps):
        batch = rows[step * 16:(step + 1) * 16]
        m = grpo.grpo_step(model, ref, opt, tok, [r["prompt"] for r in batch], [reversal_reward],
                           cfg,
                           columns={"target": [r["target"] for r in batch]})
        history.append(m["reward"])
        if (step + 1) % 25 == 0:
            log(f"step {step + 1:4d}  reward {sum(history[-25:]) / 25:.3f}  "
                f"entropy {m['entropy']:.3f}")

    test = make_rows(5, seed=seed + 1)
    greedy = grpo.sample_completions(model, tok, [r["prompt"] for r in test],
                                     grpo.GRPOConfig(max_new_tokens=4), greedy=True, group_size=1)
    for r, c in zip(test, greedy["completions"]):
        log(f"{r['prompt']} -> {c!r} (want {r['target']})")
    return history


if __name__ == "__main__":
    main()
