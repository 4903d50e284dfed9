"""Makes the top-level modules (grpo.py, rewards.py, ...) importable from tests/ and registers
markers."""
import os
import sys


# WHY: the repository root (grpo.py and the folders machinery/, recipe/, compare/), and tests/ for
#      the helpers tests share (test_engine.tiny_gpt2, ...)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~10 s; deselect with -m 'not slow'")
