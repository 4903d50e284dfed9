"""
rewards.py -- rule-based rewards for GSM8K-style math, usable unchanged as TRL reward functions.

The convention we follow is GSM8K's own (Cobbe et al. 2021, arXiv 2110.14168; the
openai/grade-school-math repository): a solution ends with a line `#### <number>`, and the answer is
that number with its thousands commas removed. We compare answers by numeric VALUE, so `$1,234.50`,
`1234.5` and `1,234.500` all match.

Where a completion's final answer is read from, in this order:
    1. the number after `####`
    2. else the last number inside `\\boxed{...}`
    3. else the last number inside `<answer>...</answer>`
    4. else the number right after "answer is"
    5. else the last number anywhere in the text
The model is being optimised against this checker, so it is strict about anything that games it.
Each of these earns nothing (tests/test_rewards.py has one adversarial case per line):
    - hedging: two answers that disagree (`\\boxed{17}` next to `#### 18`, two "answer is"), or a
      marker holding more than one number (`#### 12 or 13`);
    - repeating a marker (two `####` lines, two boxes, two <answer> tags), even with the same
      number;
    - a final number that is one item of a list (`12, 13, 14`): a list commits to nothing;
    - an empty `\\boxed{}` or `####`;
    - an answer that appears only in an echo of the prompt or question (it is removed before
      reading);
    - a completion longer than MAX_CHARS.
Every function here runs in time linear in the text, and never raises on any string.

Nothing here evaluates model output as code. Answers are read with regular expressions and
`Decimal`; calculator annotations `<<48/2=24>>` are computed by `evaluate_arithmetic`, a whitelist
over Python's `ast` (numbers, + - * / and parentheses, bounded in size), never `eval`.
"""

from __future__ import annotations

import ast
import re
from decimal import Decimal
from fractions import Fraction

# WHY: 10,000 characters is ~2.5x the ~4,000 that the paper's 1,024-token cap allows. Past it, a
#      completion is not a GSM8K solution, and the cap keeps every call under a few milliseconds
#      (tested). Raise it for long chains of thought.
MAX_CHARS = 10_000

# A number: optional sign and dollar sign, digits with optional thousands commas (groups of exactly
# 3), optional decimals. "1,2,3" reads as three numbers; "1,234" as one. A trailing period is not
# part of it.
_NUMBER = re.compile(
    # a minus right after a letter, digit or ")" is subtraction, not a sign: "10-5" is 10 and 5
    r"(?P<sign>(?<![\w)])[-−])?"
    r"(?:\\?\$\s?(?P<sign2>[-−])?)?"                                    # "$5", "\\$5", "$-5"
    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"       # "1,234.50", "1234", ".5"
)
_HASH_LINE = re.compile(r"####([^\n]*)")
_ANSWER_IS = re.compile(r"answer is\s*:?\s*\**\s*", re.IGNORECASE)  # the number must follow at once
# A number is one item of a list when another number sits right before or after it, separated only
# by spaces, a comma, semicolon or slash, "or" or "and": "12, 13 or 14", "1 2 3", "$5 and $7".
_LIST_SEP = r"\s*(?:[,;/]|\bor\b|\band\b)?\s*"
_LISTED_BEFORE = re.compile(r"\d" + _LIST_SEP + r"$")
_LISTED_AFTER = re.compile(r"^" + _LIST_SEP + r"(?:\\?\$\s?)?[-−]?\.?\d")


def _numbers(text: str) -> list[Decimal]:
    """Every number in `text`, in order, as exact Decimals."""
    return [_value(m) for m in _NUMBER.finditer(text)]


def _value(match: re.Match) -> Decimal:
    """The exact value of one _NUMBER match: commas and "$" dropped, so "$1,234.50" ->
    Decimal("1234.50")."""
    value = Decimal(match.group("digits").replace(",", ""))
    return -value if (match.group("sign") or match.group("sign2")) else value


def _boxed_contents(text: str) -> list[str]:
    """The contents of every \\boxed{...}, with nested braces matched. Linear in len(text)."""
    contents, start = [], 0
    while (i := text.find("\\boxed{", start)) != -1:
        depth, j = 1, i + len("\\boxed{")
        for brace in _BRACE.finditer(text, j):
            depth += 1 if brace.group() == "{" else -1
            if depth == 0:
                break
        if depth:  # never closed: not a box
            break
        contents.append(text[j: brace.start()])
        start = brace.end()
    return contents


_BRACE = re.compile(r"[{}]")


def _answer_tags(text: str) -> list[str]:
    """The contents of every <answer>...</answer> (case-insensitive). str.find, so linear even for
    thousands of unclosed tags (a lazy regex would rescan the rest of the text from each one)."""
    lower, contents, start = text.lower(), [], 0
    while (i := lower.find("<answer>", start)) != -1 and (j := lower.find("</answer>",
                                                                          i + 8)) != -1:
        contents.append(text[i + 8: j])
        start = j + 9
    return contents


def _only_number(text: str) -> Decimal | None:
    """The number in a marker's contents, or None if it holds none or more than one ("#### 12 or
    13")."""
    numbers = _numbers(text)
    return numbers[0] if len(numbers) == 1 else None


def _listed(text: str, match: re.Match) -> bool:
    """Is this number one item of a list of numbers? (It then commits to nothing.)"""
    return bool(_LISTED_BEFORE.search(text, max(0, match.start() - 20), match.start())
                or _LISTED_AFTER.match(text[match.end(): match.end() + 20]))


def completion_text(completion) -> str:
    """A completion as plain text: a string, or a chat list like [{"role": "assistant", "content":
    ...}]."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion:
        content = completion[-1].get("content", "") if isinstance(completion[-1],
                                                                  dict) else completion[-1]
        if isinstance(content, list):  # multi-part content: [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else ""
    return ""


def extract_answer(text: str) -> Decimal | None:
    """The final numeric answer of a solution, or None if it has none, hedges, or games the
    checker."""
    if len(text) > MAX_CHARS:
        return None
    # Explicit commitments: a #### line, a \boxed{}, an <answer> tag. Each may appear once and hold
    # exactly one number; if there are several kinds, they must agree. Anything else is hedging or
    # spam.
    hashes, boxes, tags = _HASH_LINE.findall(text), _boxed_contents(text), _answer_tags(text)
    if len(hashes) > 1 or len(boxes) > 1 or len(tags) > 1:
        return None
    committed = [_only_number(c) for c in hashes + boxes + tags]
    if committed:
        return committed[0] if None not in committed and len(set(committed)) == 1 else None
    # Softer: "the answer is N", read only when there is no explicit marker. WHY not a hard
    # commitment: GSM8K's own gold solutions say "the final answer is 15 gallons * 8 pints / gallon
    # = 120" mid-way.
    stated = [m for m in (_NUMBER.match(text, a.end()) for a in _ANSWER_IS.finditer(text)) if m]
    if stated:
        values = {_value(m) for m in stated}
        return values.pop() if len(values) == 1 and not any(_listed(text,
                                                                    m) for m in stated) else None
    # Last resort: the last number in the text, unless it ends a list.
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return None if last is None or _listed(text, last) else _value(last)


def gold_answer(answer) -> Decimal:
    """The gold value from a GSM8K answer: the full solution ending in `#### N`, or the bare
    number."""
    value = extract_answer(str(answer))
    if value is None:
        raise ValueError(f"cannot read a final number from the gold answer {str(answer)[-80:]!r}")
    return value


def without_echo(text: str, *echoes) -> str:
    """`text` with every verbatim copy of each echo (the prompt, the question) removed, so that
    numbers the model merely repeated from its input are never read as its answer."""
    for echo in echoes:
        # WHY 8: a very short "echo" could be real work
        if isinstance(echo, str) and len(echo.strip()) >= 8:
            text = text.replace(echo, " ")
    return text


def correctness_reward(completions, answer, prompts=None, question=None, **kwargs) -> list[float]:
    """1.0 where the completion's final answer equals the gold by value, else 0.0. TRL reward
    signature.

    `prompts` and `question` (TRL passes both when the data has them) are removed from the
    completion if the model echoes them, so an answer copied from the input earns nothing.
    """
    n = len(completions)
    prompts = prompts if prompts is not None else [None] * n
    question = question if question is not None else [None] * n
    return [1.0 if extract_answer(without_echo(completion_text(c), p, q)) == gold_answer(a) else 0.0
            for c, a, p, q in zip(completions, answer, prompts, question, strict=True)]


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 where the completion ends in GSM8K's layout: exactly one `####` line, the last one,
    holding a number."""
    out = []
    for c in completions:
        text = completion_text(c).strip()
        if len(text) > MAX_CHARS:
            out.append(0.0)
            continue
        last_line = text.rsplit("\n", 1)[-1].strip()
        ok = (text.count("####") == 1 and last_line.startswith("####")
              and _NUMBER.fullmatch(last_line[4:].strip()))
        out.append(1.0 if ok else 0.0)
    return out


_R1_TAGS = re.compile(r"</?(?:think|answer)>")
_R1_LAYOUT = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.S)


def r1_format_reward(completions, **kwargs) -> list[float]:
    """1.0 where the completion is DeepSeek-R1's layout and nothing else: one `<think>...</think>`
    block with some reasoning in it, then one `<answer>...</answer>` block holding exactly one
    number, with only white space around them.

    Hardened as the answer checker is: a second block, a tag nested or out of order, an empty
    block, text after `</answer>` or before `<think>`, or a text over MAX_CHARS earns 0, so
    spamming tags never pays (tests/test_rewards.py)."""
    out = []
    for c in completions:
        text = completion_text(c).strip()
        # WHY this order: the cheap checks first, so the pattern only ever sees four tags
        ok = (len(text) <= MAX_CHARS
              and _R1_TAGS.findall(text) == ["<think>", "</think>", "<answer>", "</answer>"]
              and (whole := _R1_LAYOUT.fullmatch(text)) is not None
              and whole.group(1).strip() != "" and _only_number(whole.group(2)) is not None)
        out.append(1.0 if ok else 0.0)
    return out


# ----------------------------------------------------------------------------------------------
# Calculator annotations: GSM8K marks each step's arithmetic as <<48/2=24>>
# ----------------------------------------------------------------------------------------------
# WHY: the longest left side in GSM8K's 27,998 annotations has 30 characters
MAX_EXPRESSION_CHARS = 100
MAX_MAGNITUDE = 10 ** 15     # WHY: no GSM8K quantity comes near; bounds every intermediate value
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}


def evaluate_arithmetic(expression: str) -> Fraction | None:
    """The exact value of model-written arithmetic such as "48/2" or "(3+4)*1.5", or None if it is
    anything else: names, attributes, calls, powers (9**9**9**9), numbers with too many digits, huge
    intermediate values, division by zero. Never `eval`: a whitelist over the parsed tree, refusing
    before computing.
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        return None
    expression = expression.replace("×", "*").replace("÷", "/").replace("−", "-").replace(",", "")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))  # WHY str: "0.1" is exactly 1/10, the float is not
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError
            result = _BINARY[type(node.op)](left, right)
            if abs(result) > MAX_MAGNITUDE or result.denominator > MAX_MAGNITUDE:
                raise ValueError("too large")
            return result
        raise ValueError(f"not arithmetic: {type(node).__name__}")

    try:
        result = value(tree.body)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    return result if abs(result) <= MAX_MAGNITUDE and result.denominator <= MAX_MAGNITUDE else None


_ANNOTATION = re.compile(r"<<([^<>=\n]{1,%d})=([^<>\n]{0,40})>>" % MAX_EXPRESSION_CHARS)


def annotation_is_right(expression: str, stated: str) -> bool:
    """Is `expression` (model-written) equal to the `stated` result? Exact for a whole number; a
    stated decimal may be off by up to one unit in its last place (10/3=3.33 and 10/3=3.3 pass,
    10/3=3.2 does not)."""
    value, shown = evaluate_arithmetic(expression), _only_number(stated)
    if value is None or shown is None:
        return False
    decimals = max(0, -shown.as_tuple().exponent)
    return abs(value - Fraction(shown)) <= (Fraction(1, 10 ** decimals) if decimals else 0)


def calculator_process_reward(completions, answer, prompts=None, question=None,
                              **kwargs) -> list[list[tuple]]:
    """Step rewards for process supervision (grpo.GRPOConfig.supervision = "process", paper §4.1.3).

    For each completion, a list of (end, reward) pairs in the order the steps were written: one per
    calculator annotation `<<a op b=c>>` (1.0 if its arithmetic is right, else 0.0; `end` is the
    index just past its `>>`), then the final answer (1.0 if right, else 0.0) at end = len(text).
    Rule-based, like the paper's outcome reward: no learned process reward model. 27,995 of the
    27,998 annotations in GSM8K's gold solutions score 1 (the other 3 use floor division or a
    fraction as the result).
    """
    outcome = correctness_reward(completions, answer, prompts=prompts, question=question)
    steps = []
    for c, final in zip(completions, outcome):
        text = completion_text(c)
        annotations = _ANNOTATION.finditer(text) if len(text) <= MAX_CHARS else []
        calc = [(m.end(), 1.0 if annotation_is_right(m.group(1), m.group(2)) else 0.0)
                for m in annotations]
        steps.append(calc + [(len(text), final)])
    return steps
