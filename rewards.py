"""
rewards.py -- rule-based rewards for GSM8K-style math, usable unchanged as TRL reward functions.

The convention we follow is GSM8K's own (Cobbe et al. 2021, arXiv 2110.14168; the openai/grade-school-math
repository): a solution ends with a line `#### <number>`, and the answer is that number with its thousands
commas removed. We compare answers by numeric VALUE, so `$1,234.50`, `1234.5` and `1,234.500` all match.

Where a completion's final answer is read from, in this order:
    1. the number after `####`
    2. else the last number inside `\\boxed{...}`
    3. else the last number inside `<answer>...</answer>`
    4. else the number right after "answer is"
    5. else the last number anywhere in the text
A completion that commits to two different answers (two `####` lines that disagree, `\\boxed{17}` next to
`#### 18`, or two "answer is" that disagree) is hedging, and earns nothing; so does an empty
`\\boxed{}` or `####`, which commits to no answer at all.

Nothing here evaluates model output as code: answers are read with regular expressions and `Decimal`.
"""

from __future__ import annotations

import re
from decimal import Decimal

# A number: optional sign and dollar sign, digits with optional thousands commas (groups of exactly 3),
# optional decimals. "1,2,3" reads as three numbers; "1,234" as one. A trailing period is not part of it.
_NUMBER = re.compile(
    # a minus right after a letter, digit or ")" is subtraction, not a sign: "10-5" reads as 10 and 5
    r"(?P<sign>(?<![\w)])[-−])?"
    r"(?:\\?\$\s?(?P<sign2>[-−])?)?"                                    # "$5", "\\$5", "$-5"
    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"       # "1,234.50", "1234", ".5"
)
_HASH_LINE = re.compile(r"####([^\n]*)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_IS = re.compile(r"answer is\s*:?\s*\**\s*", re.IGNORECASE)  # the number must follow at once


def _numbers(text: str) -> list[Decimal]:
    """Every number in `text`, in order, as exact Decimals."""
    return [_value(m) for m in _NUMBER.finditer(text)]


def _value(match: re.Match) -> Decimal:
    """The exact value of one _NUMBER match: commas and "$" dropped, so "$1,234.50" -> Decimal("1234.50")."""
    value = Decimal(match.group("digits").replace(",", ""))
    return -value if (match.group("sign") or match.group("sign2")) else value


def _boxed_contents(text: str) -> list[str]:
    """The contents of every \\boxed{...}, with nested braces matched."""
    contents, start = [], 0
    while (i := text.find("\\boxed{", start)) != -1:
        depth, j = 1, i + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:  # never closed: not a box
            break
        contents.append(text[i + len("\\boxed{"): j - 1])
        start = j
    return contents


def completion_text(completion) -> str:
    """A completion as plain text: a string, or a chat list like [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion:
        content = completion[-1].get("content", "") if isinstance(completion[-1], dict) else completion[-1]
        if isinstance(content, list):  # multi-part content: [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else ""
    return ""


def extract_answer(text: str) -> Decimal | None:
    """The final numeric answer of a solution, or None if it has none or hedges between answers."""
    # Explicit commitments: each #### line, each \boxed{}, each <answer> tag. A marker with no number in it
    # commits to nothing. All must agree, or the completion is hedging.
    committed = [(_numbers(line) or [None])[0] for line in _HASH_LINE.findall(text)]
    committed += [(_numbers(c) or [None])[-1] for c in _boxed_contents(text) + _ANSWER_TAG.findall(text)]
    if committed:
        return committed[0] if None not in committed and len(set(committed)) == 1 else None
    # Softer: "the answer is N", read only when there is no explicit marker. WHY not a hard commitment:
    # GSM8K's own gold solutions say "the final answer is 15 gallons * 8 pints / gallon = 120" mid-way.
    stated = [_value(m) for m in (_NUMBER.match(text, a.end()) for a in _ANSWER_IS.finditer(text)) if m]
    if stated:
        return stated[0] if len(set(stated)) == 1 else None
    # Last resort: the last number in the text.
    nums = _numbers(text)
    return nums[-1] if nums else None


def gold_answer(answer) -> Decimal:
    """The gold value from a GSM8K answer: the full solution ending in `#### N`, or the bare number."""
    value = extract_answer(str(answer))
    if value is None:
        raise ValueError(f"cannot read a final number from the gold answer {str(answer)[-80:]!r}")
    return value


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's final answer equals the gold by value, else 0.0. TRL reward signature."""
    return [1.0 if extract_answer(completion_text(c)) == gold_answer(a) else 0.0
            for c, a in zip(completions, answer, strict=True)]




def format_reward(completions, **kwargs) -> list[float]:
    """1.0 where the completion ends in GSM8K's layout: exactly one `####` line, the last one, holding a number."""
    out = []
    for c in completions:
        text = completion_text(c).strip()
        last_line = text.rsplit("\n", 1)[-1].strip()
        ok = text.count("####") == 1 and last_line.startswith("####") and _NUMBER.fullmatch(last_line[4:].strip())
        out.append(1.0 if ok else 0.0)
    return out
