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
    ("<reasoning>24+48</reasoning><answer> 72 </answer>", GOLD_72, 1.0,
     "answer tags after reasoning"),
    ("So the answer is 72.", GOLD_72, 1.0, "'answer is'"),
    ("The answer is: $72", GOLD_72, 1.0, "'answer is:' with a dollar"),
    ("24 + 48 = 72", GOLD_72, 1.0, "last number in the text"),
    ("72 clips, or maybe 71", GOLD_72, 0.0, "last number is the final answer"),
    ("1,2,3,72", GOLD_72, 0.0,
     "a comma list is not a thousands number, and a list commits to nothing"),
    ("10-5=72", GOLD_72, 1.0, "subtraction, not a negative"),
    ("#### 72\n#### 71", GOLD_72, 0.0, "hedging: two #### lines that disagree"),
    ("\\boxed{72}\n#### 73", GOLD_72, 0.0, "hedging: box and #### disagree"),
    ("\\boxed{17} #### 18", "18", 0.0, "hedging: a box and a #### that disagree"),
    ("<answer>72</answer> \\boxed{71}", GOLD_72, 0.0, "hedging: answer tag and box disagree"),
    ("The answer is 71. No wait, the answer is 72.", GOLD_72, 0.0,
     "hedging: two 'answer is' that disagree"),
    ("\\boxed{72}\n#### 72", GOLD_72, 1.0, "two commitments that agree are not hedging"),
    ("\\boxed{} 72", GOLD_72, 0.0, "an empty box commits to nothing and earns nothing"),
    ("#### \n72", GOLD_72, 0.0, "an empty #### line commits to nothing"),
    ("I don't know", GOLD_72, 0.0, "no number at all"),
    ("", GOLD_72, 0.0, "empty completion"),
    ("The answer is 15 gallons * 8 = 120 pints\n#### 120", "120", 1.0,
     "#### outranks 'answer is' (a real GSM8K gold)"),
    ("The answer is 72.\n#### 72", GOLD_72, 1.0, "'answer is' and #### agree"),
    ("The answer is not 5; 6 + 66 = 72\n#### 72", GOLD_72, 1.0,
     "'answer is' with no number right after it commits to nothing"),
]


@pytest.mark.parametrize("completion, gold, expected, why", CASES, ids=[c[3] for c in CASES])
def test_correctness_table(completion, gold, expected, why):
    assert correctness_reward([completion], [gold]) == [expected], why


def test_chat_completions_are_read():
    """TRL passes conversational completions as lists of messages; the last message's content is
    read."""
    chat = [[{"role": "assistant", "content": "#### 72"}],
            [{"role": "assistant", "content": [{"type": "text", "text": "#### 71"}]}]]
    assert correctness_reward(chat, [GOLD_72, GOLD_72]) == [1.0, 0.0]
    assert completion_text([{"role": "assistant", "content": "hi"}]) == "hi"


def test_trl_calling_convention():
    """TRL calls reward functions by keyword, with prompts and every dataset column as extra
    keywords."""
    out = correctness_reward(prompts=["q1", "q2"], completions=["#### 1", "#### 3"],
                             answer=["1", "2"],
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


# --- adversarial completions: built to game the checker, each must earn nothing ------------------
QUESTION = "Tom has 3 bags of 24 marbles and gives away 72. How many marbles did Tom have before?"
GAMES = [
    ("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 72 73",
     "number list, space-separated"),
    ("It is 70, 71, 72", "number list with commas, gold last"),
    ("70 or 71 or 72", "number list with 'or', gold last"),
    ("70\n71\n72", "number list one per line, gold last"),
    ("$70 and $72", "number list with dollars"),
    ("#### 72 or 73", "hedging inside one #### line"),
    ("#### 71, 72", "a list inside one #### line"),
    ("#### 72\n#### 72", "a repeated #### line"),
    ("#### 71\n#### 72", "conflicting #### lines, gold last"),
    ("#### 72\n#### 71", "conflicting #### lines, gold first"),
    ("\\boxed{72} \\boxed{72}", "a repeated box"),
    ("\\boxed{}", "an empty box"),
    ("\\boxed{} \\boxed{72}", "an empty box next to a full one"),
    ("\\boxed{71, 72, 73}", "a list inside a box"),
    ("<answer>72</answer>" * 50, "answer-tag spam"),
    ("<answer></answer><answer>72</answer>", "an empty tag next to a full one"),
    ("The answer is 72 or 73.", "'answer is' followed by a list"),
    (QUESTION, "the answer only inside an echo of the question"),
    (QUESTION + " I am not sure.", "an echo of the question and no answer of its own"),
    ("Let me think. " + "1 + 1 = 2. " * 1000 + "#### 72", "a very long output (past MAX_CHARS)"),
    ("7" * 20_000, "a number with thousands of digits"),
]


@pytest.mark.parametrize("completion, why", GAMES, ids=[g[1] for g in GAMES])
def test_adversarial_completions_earn_nothing(completion, why):
    assert correctness_reward([completion], ["72"], question=[QUESTION]) == [0.0], why
    assert format_reward([completion]) == [0.0], why


def test_the_honest_answer_still_earns_next_to_each_game():
    """The strict rules must not cost honest solutions: the same gold with a plain answer scores
    1."""
    honest = ["#### 72", "3*24=<<3*24=72>>72\n#### 72", "So 3 * 24 = 72", "\\boxed{72}",
              QUESTION + "\n3*24=72\n#### 72", "The answer is 72."]
    assert correctness_reward(honest, ["72"] * len(honest),
                              question=[QUESTION] * len(honest)) == [1.0] * 6


# --- fuzz: never raises, always fast -------------------------------------------------------------
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

# Text built from the pieces the checker looks for, so the fuzzer reaches every branch quickly.
PIECES = st.sampled_from(["####", "\\boxed{", "{", "}", "<answer>", "</answer>", "answer is", "$",
                          "-", "−",
                          ",", ".", " ", "\n", "or", "and", "1", "72", "1,000", "3.5", "<<", ">>",
                          "=", "*"])
TEXT = st.one_of(st.text(max_size=2000), st.lists(PIECES, max_size=400).map("".join),
                 st.tuples(st.lists(PIECES, max_size=50).map("".join), st.integers(1, 2500)).map(
                     lambda t: t[0] * t[1]))


# The rewards read model-written text, so a regular expression that backtracks without bound
# would stall training. The fast tier checks that they never raise and give 0 or 1; the slow
# tier times them, with bounds far above a healthy call (about a millisecond) and far below a
# backtracking one (seconds and up), so a busy machine does not fail them.
CALL_BOUND_S = 0.1


def slowest_of_3_best(fn, *args) -> float:
    """Seconds for one call: the best of 3, so a busy machine's stalls do not count."""
    import time
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXT)
def test_fuzz_rewards_never_raise(text):
    text = text[:100_000]
    assert correctness_reward([text], ["72"]) in ([0.0], [1.0])
    assert format_reward([text]) in ([0.0], [1.0])


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXT)
def test_fuzz_rewards_take_milliseconds(text):
    text = text[:100_000]
    assert slowest_of_3_best(correctness_reward, [text], ["72"]) < CALL_BOUND_S
    assert slowest_of_3_best(format_reward, [text]) < CALL_BOUND_S


WORST_CASES = [
    "<answer>" * 12_500,                        # 100 KB of unclosed tags
    "\\boxed{" * 14_000,                         # 100 KB of unclosed boxes
    "\\boxed{" * 5000 + "}" * 5000,              # deeply nested boxes
    "1," * 50_000,                              # 100 KB number list
    "9" * 100_000,                              # one 100,000-digit number
    ("answer is 1 " * 900)[:9_999],        # just under MAX_CHARS: the slowest paths that still read
    "\\boxed{" + "{}" * 4995,
    ("1 2, 3 or " * 1000)[:9_999],
    ("#### 1\n" * 1428)[:9_999],
]


@pytest.mark.parametrize("text", WORST_CASES)
def test_worst_case_inputs_give_0_or_1(text):
    assert correctness_reward([text], ["72"]) in ([0.0], [1.0])
    assert format_reward([text]) in ([0.0], [1.0])


@pytest.mark.slow
@pytest.mark.parametrize("text", WORST_CASES)
def test_worst_case_inputs_take_milliseconds(text):
    assert slowest_of_3_best(correctness_reward, [text], ["72"]) < CALL_BOUND_S
    assert slowest_of_3_best(format_reward, [text]) < CALL_BOUND_S


# --- safe arithmetic for model-written calculator annotations ------------------------------------
from fractions import Fraction  # noqa: E402

from rewards import evaluate_arithmetic  # noqa: E402


@pytest.mark.parametrize("expression, value", [
    ("48/2", Fraction(24)), ("48+24", Fraction(72)),
    ("63000-9400-9100-8300-9200-8900", Fraction(18100)),
    ("(3+4)*1.5", Fraction(21, 2)), ("100*.25", Fraction(25)), ("-5+2", Fraction(-3)),
    ("10/3", Fraction(10, 3)),
    ("0.1+0.2", Fraction(3, 10)),   # exact: not 0.30000000000000004
    ("2×3", Fraction(6)), ("1,000*2", Fraction(2000)),
])
def test_arithmetic_is_exact(expression, value):
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('echo hacked')",   # a call
    "os.system",                                 # an attribute
    "x + 1",                                     # a name
    "9**9**9**9",                             # an exponent tower: ** is not in the whitelist at all
    "2**10",
    "9" * 5000,                                  # a number with thousands of digits
    "1" + "*99999999999999" * 6,                 # a product far past MAX_MAGNITUDE
    "1/0",
    "[1, 2][0]", "lambda: 1", "1 if 1 else 2", "1 < 2", "'72'", "True + 1", "1e999",
    "(" * 5000 + "1" + ")" * 5000,
    "", "  ", "1 +", "1; 2",
])
def test_arithmetic_refuses_anything_else(expression):
    assert evaluate_arithmetic(expression) is None


@pytest.mark.slow
@pytest.mark.parametrize("expression", ["9**9**9**9", "9" * 5000, "1" + "*99999999999999" * 6,
                                        "(" * 5000 + "1" + ")" * 5000])
def test_arithmetic_refuses_the_costly_ones_quickly(expression):
    assert slowest_of_3_best(evaluate_arithmetic, expression) < CALL_BOUND_S


# --- step rewards for process supervision --------------------------------------------------------
from rewards import annotation_is_right, calculator_process_reward  # noqa: E402


def test_calculator_process_reward_hand_worked():
    """'3*4=<<3*4=12>>12' is right and ends at character 14; '12+5=<<12+5=18>>18' is wrong (17) and
    ends at 33; the final answer 18 is wrong against the gold 17, at the end of the text (43)."""
    text = "3*4=<<3*4=12>>12\n12+5=<<12+5=18>>18\n#### 18"
    assert calculator_process_reward([text], ["#### 17"]) == [[(14, 1.0), (33, 0.0), (43, 0.0)]]
    assert calculator_process_reward(["#### 17"], ["17"]) == [[(7, 1.0)]]  # no annotations
    assert calculator_process_reward(["<<9**9**9**9=1>> #### 1"], ["1"]) == [[(16, 0.0), (23, 1.0)]]


@pytest.mark.parametrize("expression, stated, right", [
    ("48/2", "24", True), ("48/2", "25", False), ("10/3", "3.33", True), ("10/3", "3.3", True),
    ("10/3", "3.2", False), ("10/3", "3", False), ("7*8", "$56", True), ("7*8", "56 or 57", False),
    ("x*8", "56", False), ("1/0", "0", False),
])
def test_annotation_is_right(expression, stated, right):
    assert annotation_is_right(expression, stated) is right


# (completion, r1_format_reward, why): DeepSeek-R1's layout, and the ways to game it
R1_CASES = [
    ("<think>48/2 = 24, and 48 + 24 = 72</think><answer>72</answer>", 1.0, "the layout"),
    ("  <think>\n24 then 72\n</think>\n\n<answer> 72 </answer>\n", 1.0, "white space around"),
    ("<think>ok</think><answer>$1,234.50</answer>", 1.0, "one number, as the checker reads it"),
    ("<answer>72</answer><think>why</think>", 0.0, "answer before thinking"),
    ("<think></think><answer>72</answer>", 0.0, "an empty think block"),
    ("<think>  </think><answer>72</answer>", 0.0, "a blank think block"),
    ("<think>a</think><answer></answer>", 0.0, "an empty answer"),
    ("<think>a</think><answer>72 or 73</answer>", 0.0, "two numbers in the answer"),
    ("<think>a</think><answer>seventy-two</answer>", 0.0, "no number in the answer"),
    ("<think>a</think><answer>72</answer> so 72", 0.0, "text after the answer"),
    ("So: <think>a</think><answer>72</answer>", 0.0, "text before thinking"),
    ("<think>a</think><think>b</think><answer>72</answer>", 0.0, "two think blocks"),
    ("<think>a</think><answer>72</answer><answer>72</answer>", 0.0, "two answer blocks"),
    ("<think>a<answer>72</answer></think><answer>72</answer>", 0.0, "an answer inside the think"),
    ("<think><think>a</think></think><answer>72</answer>", 0.0, "nested think"),
    ("<think>a</think><answer>72", 0.0, "the answer never closed"),
    ("<think>a<answer>72</answer>", 0.0, "the think never closed"),
    ("72", 0.0, "no tags"),
    ("#### 72", 0.0, "GSM8K's layout is not R1's"),
    ("<think>" + "a" * 20_000 + "</think><answer>72</answer>", 0.0, "over MAX_CHARS"),
    ("<think>a</think><answer>72</answer>" * 300, 0.0, "tag spam"),
]


@pytest.mark.parametrize("completion, expected, why", R1_CASES, ids=[c[2] for c in R1_CASES])
def test_r1_format_reward(completion, expected, why):
    from rewards import r1_format_reward
    assert r1_format_reward([completion]) == [expected], why


def test_r1_answers_are_read_by_the_correctness_checker():
    """Under --template r1 the correctness reward reads the <answer> block, once."""
    assert correctness_reward(["<think>48 then 24</think><answer>72</answer>"], [GOLD_72]) == [1.0]
    assert correctness_reward(["<think>72</think><answer>70</answer>"], [GOLD_72]) == [0.0]
