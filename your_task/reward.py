"""
reward.py -- your task's rewards: the right word, said in as few words as the question asks.

    python train_gsm8k.py --data your_task/data --reward your_task/reward.py:concise_reward ...

A reward function has TRL's signature, f(prompts, completions, **columns) -> list[float]: one float
per completion. Every column of your rows other than "prompt" arrives by name, as a list lined up
with the completions (each prompt's value repeated G times, once per completion of its group).
Name several with --reward, one flag each: each is logged as rewards/<name>, the first is the
held-out score that summary.json reports before and after, and --reward-weights weighs them (TRL's
default: 1 each).
"""

import re

WORD = re.compile(r"[A-Za-z]+")


def concise_reward(prompts, completions, target, **columns) -> list[float]:
    """1 for the target word alone, halved for each word that comes with it; 0 without it.

    WHY partial credit: a right answer in a sentence is still right, so it earns something, and
    within a group the shorter of two right answers earns twice as much per word left out, which
    is what GRPO's group-standardised advantage ranks by. An all-or-nothing "exactly one word"
    reward would give this model nothing: it never answers in one word at first, so every group
    would be all zeros, with zero advantage.

    Example, target "Oslo": "Oslo." -> 1.0; "Oslo, Norway" -> 0.5;
    "The capital of Norway is Oslo." -> 1/32; "Bergen" -> 0.0.
    """
    scores = []
    for completion, word in zip(completions, target):
        words = [w.lower() for w in WORD.findall(completion)]
        scores.append(0.5 ** (len(words) - 1) if word.lower() in words else 0.0)
    return scores


def exact_reward(prompts, completions, target, **columns) -> list[float]:
    """1.0 where the completion is the target and nothing else (case and punctuation aside):
    the share answered exactly as asked, logged beside the partial credit (weight 0)."""
    return [1.0 if [w.lower() for w in WORD.findall(c)] == [t.lower()] else 0.0
            for c, t in zip(completions, target)]
