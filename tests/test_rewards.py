"""The GSM8K answer checker in rewards.py: a table of completions and what each must score.

Needs: nothing beyond the standard library. Instant. The full-data check is in test_gsm8k_golds.py.
"""

from decimal import Decimal

import pytest

from rewards import completion_text, correctness_reward, extract_answer, format_reward, gold_answer

GOLD_72 = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
           "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")

# (completion, gold, expected reward, why)
CASES = [
    ("#### 72", GOLD_72, 1.0, "plain GSM8K layout against the full gold solution"),
    ("#### 72", "72", 1.0, "bare-number gold"),
    ("#### 73", GOLD_72, 0.0, "wrong number"),
    ("She sold 24 then 72.\n#### 72", GOLD_72, 1.0, "reasoning before the #### line"),
    ("#### 1,000", "1000", 1.0, "thousands comma in the completion"),
    ("#### 1000", "#### 1,000", 1.0, "thousands comma in the gold"),
    ("#### $1,234.50", "1234.5", 1.0, "dollar sign, comma, trailing zero"),
    ("#### 1,234.500", "$1,234.50", 1.0, "equal by value, not by string"),
    ("#### 007", "7", 1.0, "leading zeros"),
    ("#### -5", "-5", 1.0, "negative"),
    ("#### 5", "-5", 0.0, "sign matters"),
    ("#### −5", "-5", 1.0, "unicode minus"),
    ("#### $-5", "-5", 1.0, "minus after the dollar sign"),
    ("#### 50%", "50", 1.0, "percent sign"),
    ("#### 72 clips", GOLD_72, 1.0, "unit after the number"),
    ("#### 72.", GOLD_72, 1.0, "trailing period"),
    ("#### 72.0", GOLD_72, 1.0, "trailing .0"),
    ("The total is \\boxed{72}.", GOLD_72, 1.0, "\\boxed{}"),
    ("\\boxed{\\$1,000}", "1000", 1.0, "\\boxed{} with an escaped dollar and a comma"),
    ("\\boxed{72 \\text{ clips}}", GOLD_72, 1.0, "\\boxed{} with nested braces and a unit"),
    ("<answer>72</answer>", GOLD_72, 1.0, "answer tags"),
    ("<reasoning>24+48</reasoning><answer> 72 </answer>", GOLD_72, 1.0, "answer tags after reasoning"),
    ("So the answer is 72.", GOLD_72, 1.0, "'answer is'"),
    ("The answer is: $72", GOLD_72, 1.0, "'answer is:' with a dollar"),
    ("24 + 48 = 72", GOLD_72, 1.0, "last number in the text"),
    ("72 clips, or maybe 71", GOLD_72, 0.0, "last number is the final answer"),
    ("1,2,3,72", GOLD_72, 1.0, "a comma list is not a thousands number: last number is 72"),
    ("10-5=72", GOLD_72, 1.0, "subtraction, not a negative"),
    ("#### 72\n#### 71", GOLD_72, 0.0, "hedging: two #### lines that disagree"),
    ("\\boxed{72}\n#### 73", GOLD_72, 0.0, "hedging: box and #### disagree"),
    ("\\boxed{17} #### 18", "18", 0.0, "hedging: the example from the spec"),
    ("<answer>72</answer> \\boxed{71}", GOLD_72, 0.0, "hedging: answer tag and box disagree"),
    ("The answer is 71. No wait, the answer is 72.", GOLD_72, 0.0, "hedging: two 'answer is' that disagree"),
    ("\\boxed{72}\n#### 72", GOLD_72, 1.0, "two commitments that agree are not hedging"),
    ("\\boxed{} 72", GOLD_72, 0.0, "an empty box commits to nothing and earns nothing"),
    ("#### \n72", GOLD_72, 0.0, "an empty #### line commits to nothing"),
    ("I don't know", GOLD_72, 0.0, "no number at all"),
    ("", GOLD_72, 0.0, "empty completion"),
    ("The answer is 15 gallons * 8 = 120 pints\n#### 120", "120", 1.0, "#### outranks 'answer is' (a real GSM8K gold)"),
    ("The answer is 72.\n#### 72", GOLD_72, 1.0, "'answer is' and #### agree"),
    ("The answer is not 5; 6 + 66 = 72\n#### 72", GOLD_72, 1.0, "'answer is' with no number right after it commits to nothing"),
]


@pytest.mark.parametrize("completion, gold, expected, why", CASES, ids=[c[3] for c in CASES])
def test_correctness_table(completion, gold, expected, why):
    assert correctness_reward([completion], [gold]) == [expected], why


def test_chat_completions_are_read():
    """TRL passes conversational completions as lists of messages; the last message's content is read."""
    chat = [[{"role": "assistant", "content": "#### 72"}],
            [{"role": "assistant", "content": [{"type": "text", "text": "#### 71"}]}]]
    assert correctness_reward(chat, [GOLD_72, GOLD_72]) == [1.0, 0.0]
    assert completion_text([{"role": "assistant", "content": "hi"}]) == "hi"


def test_trl_calling_convention():
    """TRL calls reward functions by keyword, with prompts and every dataset column as extra keywords."""
    out = correctness_reward(prompts=["q1", "q2"], completions=["#### 1", "#### 3"], answer=["1", "2"],
                             question=["q1", "q2"])
    assert out == [1.0, 0.0]


def test_extract_answer_values():
    assert extract_answer("#### $1,234.50") == Decimal("1234.5")
    assert extract_answer("#### -0") == 0
    assert extract_answer("nothing") is None
    assert gold_answer(GOLD_72) == 72


def test_unreadable_gold_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="cannot read a final number from the gold answer"):
        correctness_reward(["#### 1"], ["no number here"])


def test_lengths_must_match():
    with pytest.raises(ValueError):
        correctness_reward(["#### 1", "#### 2"], ["1"])


@pytest.mark.parametrize("completion, expected", [
    ("Work.\n#### 72", 1.0),
    ("#### 1,000", 1.0),
    ("#### -3.5  ", 1.0),
    ("#### 72\nmore text", 0.0),         # the #### line must be the last
    ("text #### 72", 0.0),               # on its own line
    ("#### 72\n#### 72", 0.0),           # exactly one
    ("#### seventy-two", 0.0),           # a number
    ("\\boxed{72}", 0.0),                 # GSM8K's layout, not LaTeX's
])
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]
