"""Makes the top-level modules (grpo.py, rewards.py, ...) importable from tests/ and registers
markers."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~10 s; deselect with -m 'not slow'")


@pytest.fixture(autouse=True)
def _no_process_wide_malloc_setting(monkeypatch):
    """WHY: memory.return_freed_memory (which --update-in-backward calls) sets glibc's mmap
    threshold for the whole process, and no call undoes it: every later test in this pytest
    process would map and fault in each block of 1 MB or more afresh (7x slower for 2 MB tensors).
    tests/test_memory.py checks it in fresh processes, and that step_in_backward calls it."""
    import memory
    monkeypatch.setattr(memory, "return_freed_memory", lambda: None)
