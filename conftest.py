"""Makes the top-level modules (grpo.py, rewards.py, ...) importable from tests/ and registers
markers."""
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~10 s; deselect with -m 'not slow'")
