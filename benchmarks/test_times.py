"""
benchmarks/test_times.py -- docs/tests.md's table: each test file's tests, how many are slow, and
its seconds, from one pytest run's JUnit XML.

    python -m pytest --gsm8k-dir=DIR --junitxml=benchmarks/results/tests/junit.xml
    python -m pytest --collect-only -q -m slow > benchmarks/results/tests/slow.txt
    cd benchmarks/results/tests && python ../../test_times.py junit.xml slow.txt

Prints one markdown row per file (file | tests | slow | seconds), then the totals, then one line of
JSON. The seconds are pytest's own per-test times (setup and teardown included), summed by file.
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from collections import defaultdict


def file_of(classname: str) -> str:
    """A JUnit classname ('tests.test_lora' or 'tests.test_lora.TestX') as its file."""
    parts = classname.split(".")
    module = next(i for i, p in enumerate(parts) if p.startswith("test_"))
    return "/".join(parts[:module + 1]) + ".py"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", help="pytest --junitxml's file")
    ap.add_argument("slow", help="pytest --collect-only -q -m slow's output")
    a = ap.parse_args(argv)
    slow = defaultdict(int)
    for line in open(a.slow):
        m = re.match(r"^(tests/\S+\.py)::", line)
        if m:
            slow[m.group(1)] += 1
    tests, seconds, outcome = defaultdict(int), defaultdict(float), defaultdict(int)
    for case in ET.parse(a.junit).getroot().iter("testcase"):
        f = file_of(case.get("classname"))
        tests[f] += 1
        seconds[f] += float(case.get("time", 0))
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcome[kind] += 1
    print("| file | tests | slow | seconds |\n|---|---|---|---|")
    for f in sorted(tests, key=lambda f: -seconds[f]):
        print(f"| `{f}` | {tests[f]} | {slow[f]} | {seconds[f]:.1f} |")
    total = sum(seconds.values())
    print(f"| all | {sum(tests.values())} | {sum(slow.values())} | {total:.1f} |")
    print(json.dumps({"files": {f: {"tests": tests[f], "slow": slow[f],
                                    "seconds": round(seconds[f], 1)} for f in sorted(tests)},
                      "tests": sum(tests.values()), "slow": sum(slow.values()),
                      "seconds": round(total, 1), "outcomes": dict(outcome)}))


if __name__ == "__main__":
    main()
