"""own_task_example.py, the README's "train on your own task" template, runs and learns.

Needs: torch, transformers. CPU, offline, about half a minute.
"""

from recipe import own_task_example


def test_own_task_example_learns_to_reverse_digits():
    lines = []
    history = own_task_example.main(steps=150, log=lines.append)
    start, end = sum(history[:10]) / 10, sum(history[-10:]) / 10
    assert start < 0.2, history[:10]          # chance is 0.1 per position
    assert end > start + 0.15, (start, end)
    assert any("->" in line for line in lines)  # it printed greedy answers
