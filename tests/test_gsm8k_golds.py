"""Every GSM8K gold solution (train + test, 8,792 items) is read correctly by correctness_reward.

Needs: GSM8K's JSONL files, `python -m pytest --gsm8k-dir=DIR` or GSM8K_DIR (conftest.py; .ci/run
sets it). Skips, saying how to run it, without them. About 2 s.
"""

import json
import re

import pytest

from rewards import correctness_reward

@pytest.fixture(scope="module")
def golds(gsm8k_dir):
    items = []
    for split in ("train", "test"):
        path = gsm8k_dir / f"{split}.jsonl"
        items += [json.loads(line)["answer"] for line in path.read_text().splitlines()
                  if line.strip()]
    return items


def test_all_golds_are_read(golds):
    """Each gold scores 1 against itself, and 0 once its final number is changed (+1)."""
    assert len(golds) == 8792
    changed = []
    for sol in golds:
        head, final = sol.rsplit("####", 1)
        value = int(final.strip().replace(",", ""))    # GSM8K finals are integers, some with commas
        changed.append(f"{head}#### {value + 1}")
    assert correctness_reward(golds, golds) == [1.0] * len(golds)
    assert correctness_reward(changed, golds) == [0.0] * len(golds)
    # and the bare final number works as the gold too, commas and all
    finals = [re.sub(r"\s", "", s.rsplit("####", 1)[1]) for s in golds]
    assert sum(',' in f for f in finals) == 93
    assert correctness_reward(golds, finals) == [1.0] * len(golds)


def test_gold_calculator_annotations_score_as_right_steps(golds):
    """Process supervision's step reward on the golds: 27,995 of GSM8K's 27,998 calculator
    annotations are computed and found right. The 3 others are refused, so they score 0: two use
    floor division (560//10) and one writes a fraction as its result (3/4=3/4). Every gold's final
    step scores 1."""
    from rewards import calculator_process_reward
    steps = calculator_process_reward(golds, golds)
    annotations = [r for s in steps for _, r in s[:-1]]
    assert len(annotations) == 27_998 and sum(annotations) == 27_995
    assert all(s[-1][1] == 1.0 for s in steps)
