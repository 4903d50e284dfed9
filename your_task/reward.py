"""
reward.py -- your task's rewards: is the answer the right plural, and is it one word?

    python train_gsm8k.py --data your_task/data --reward your_task/reward.py:plural_reward ...

A reward function has TRL's signature, f(prompts, completions, **columns) -> list[float]: one float
per completion. Every column of your rows other than "prompt" arrives by name, as a list lined up
with the completions (each prompt's value repeated G times, once per completion of its group).
Name several with --reward, one flag each: each is logged as rewards/<name>, the first is the
held-out score that summary.json reports before and after, and --reward-weights weighs them (TRL's
default: 1 each).
"""

import re

WORD = re.compile(r"[A-Za-z]+")
SENTENCE_END = re.compile(r"[.!?\n]")


def answer_of(completion: str) -> str:
    """The word a completion answers with: the last word of its first sentence, lower-cased
    ("The plural of city is cities." -> "cities"; "Cities" -> "cities"; "" -> "")."""
    words = WORD.findall(SENTENCE_END.split(completion.strip(), maxsplit=1)[0])
    return words[-1].lower() if words else ""


def plural_reward(prompts, completions, target, **columns) -> list[float]:
    """1.0 where the completion answers with the target plural, else 0.0.

    WHY the last word of the first sentence: it is where an answer stands, alone or in a
    sentence ("The plural of wolf is wolves."), so both earn 1; a hedge ("cities or citys"), the
    singular echoed ('The answer is "lady".') or a sentence cut off by the token cap earns 0.

    Example, target "wolves": "Wolves." -> 1.0; "The plural of wolf is wolves." -> 1.0;
    "The plural of wolf is wolfs." -> 0.0; "wolves or wolfs" -> 0.0.
    """
    return [1.0 if answer_of(c) == t.lower() else 0.0 for c, t in zip(completions, target)]


def one_word_reward(prompts, completions, target, **columns) -> list[float]:
    """1.0 where the completion is the target plural and nothing else (case and punctuation
    aside): the share that answered as the question asked, logged beside the score (weight 0)."""
    return [1.0 if [w.lower() for w in WORD.findall(c)] == [t.lower()] else 0.0
            for c, t in zip(completions, target)]
