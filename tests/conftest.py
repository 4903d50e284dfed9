"""Makes the top-level modules (grpo.py, rewards.py, ...) importable from tests/, registers
markers, and finds GSM8K for the tests that need it: `python -m pytest --gsm8k-dir=DIR` (a folder
with GSM8K's train.jsonl and test.jsonl), or the GSM8K_DIR environment variable; without either
those tests skip and say how to run them."""
import os
import sys
from pathlib import Path

import pytest


# WHY: the repository root (grpo.py and the folders machinery/, recipe/, compare/), and tests/ for
#      the helpers tests share (test_engine.tiny_gpt2, ...)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


GSM8K_HOW = ("GSM8K is not given: run `python -m pytest --gsm8k-dir=DIR` (or set GSM8K_DIR), "
             "DIR a folder with GSM8K's train.jsonl and test.jsonl")


def pytest_addoption(parser):
    # NOTE: written --gsm8k-dir=DIR, with "=": given as two words, pytest reads DIR as a test path
    #       before it has loaded this file, and stops at the option it does not know yet.
    parser.addoption("--gsm8k-dir", default=os.environ.get("GSM8K_DIR", ""),
                     help="--gsm8k-dir=DIR: a folder with GSM8K's train.jsonl and test.jsonl, for "
                          "the tests that read it (default: $GSM8K_DIR; without it they skip)")


def pytest_report_header(config):
    where = config.getoption("--gsm8k-dir")
    return f"GSM8K: {where}" if where else f"GSM8K: {GSM8K_HOW}; its tests will skip"


@pytest.fixture(scope="session")
def gsm8k_dir(pytestconfig) -> Path:
    """The folder with GSM8K's JSONL files; skips the test, saying how to run it, without one, and
    fails on a folder that lacks them (a wrong path is a mistake, not a reason to skip)."""
    where = pytestconfig.getoption("--gsm8k-dir")
    if not where:
        pytest.skip(GSM8K_HOW)
    missing = [f for f in ("train.jsonl", "test.jsonl") if not (Path(where) / f).is_file()]
    if missing:
        pytest.fail(f"--gsm8k-dir={where}: no {missing[0]} there", pytrace=False)
    return Path(where)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~10 s; deselect with -m 'not slow'")
