"""
make_rows.py -- your task's rows: "What is the plural of wolf? Answer with one word."

    python your_task/make_rows.py            # writes your_task/data/train.jsonl and test.jsonl

The task: English plurals, regular ("horse" -> "horses") and not ("city" -> "cities", "box" ->
"boxes", "wolf" -> "wolves", "tooth" -> "teeth"). SmolLM2-135M-Instruct gets about two in three
right when it answers greedily; its mistakes are of a few kinds ("The answer is "lady".", "The
plural of dress is dress."), and the rules carry over from one noun to another, so GRPO has
something to learn that shows on nouns it never trained on.

Each line of train.jsonl and test.jsonl is one JSON object, TRL's dataset format: a "prompt" plus
any columns your reward reads (here "target"). The prompt is a list of chat messages, which the
model's chat template turns into text:

    {"prompt": [{"role": "user", "content": "What is ...? One word."}], "target": "wolves"}

or plain text, used as it is: {"prompt": "Q: What is ...?\nA:", "target": "wolves"}. Train and
test must not share a question: test.jsonl is what a run scores before and after.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Nouns and their plurals, by rule. Our lists; every rule is in train and in test.
PLURALS = {
    "add s": "apple river table stone horse cloud chair house book tree car dog bird road lake "
             "window door garden flower ship song friend hand shoe coat bag cup plate spoon pen "
             "lamp clock bottle ring bell boat farm hill island bridge tower castle street market",
    "y to ies": "city baby party story lady family country berry puppy fly body cherry penny pony "
                "army daisy diary enemy hobby lily memory library battery bakery candy factory "
                "fairy gallery strawberry university company",
    "add es": "box fox bus church bench brush dish glass watch match peach beach wish tax dress "
              "lunch kiss class bush coach couch inch patch ranch sandwich switch torch witch "
              "address princess potato tomato hero",
    "f to ves": "leaf knife wolf shelf half loaf thief life wife calf elf scarf",
    "irregular": "man woman child mouse tooth foot goose person",
}
IRREGULAR = {"man": "men", "woman": "women", "child": "children", "mouse": "mice",
             "tooth": "teeth", "foot": "feet", "goose": "geese", "person": "people"}


def plural(noun: str, rule: str) -> str:
    """The plural of `noun` under `rule` (a key of PLURALS)."""
    if rule == "y to ies":
        return noun[:-1] + "ies"
    if rule == "add es":
        return noun + "es"
    if rule == "f to ves":
        return noun[:-2] + "ves" if noun.endswith("fe") else noun[:-1] + "ves"
    if rule == "irregular":
        return IRREGULAR[noun]
    return noun + "s"


def make_rows() -> list[dict]:
    """One row per noun: its chat-message prompt, its plural as "target", and its rule."""
    return [{"prompt": [{"role": "user",
                         "content": f"What is the plural of {noun}? Answer with one word."}],
             "target": plural(noun, rule), "rule": rule}
            for rule, nouns in PLURALS.items() for noun in nouns.split()]


def write_jsonl(path: Path, rows: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--out", default=str(HERE / "data"), help="folder to write (your_task/data)")
    p.add_argument("--test", type=int, default=40, help="held-out rows (40)")
    a = p.parse_args(argv)
    rows = make_rows()
    random.Random(0).shuffle(rows)  # WHY: every rule in train and in test
    write_jsonl(Path(a.out) / "test.jsonl", rows[:a.test])
    write_jsonl(Path(a.out) / "train.jsonl", rows[a.test:])
    print(f"{len(rows) - a.test} training rows and {a.test} held out in {a.out}")


if __name__ == "__main__":
    main()
