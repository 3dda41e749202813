#!/usr/bin/env python3
"""Fails a test run that skipped anything it should not have: the skips a machine without a GPU
must make (a case that says "no CUDA device", or that it needs more CUDA devices than there are)
and those of CPU features the machine lacks ("this CPU lacks ...", "... on this CPU") are
expected; any other skip (a tool or package missing, a set-up that quietly gave up) fails the run,
naming the tests and what they said. The GPU machine's own run judges its skips itself
(tools/gpu/gpu-tests.sh).

    python3 tools/ci/check_skips.py BUILD/ctest-results.xml   # CTest's --output-junit file

Prints the skips by reason; exits 1 on an unexpected one, 2 when the file cannot be read.
"""
import collections
import re
import sys
import xml.etree.ElementTree as ET

# What an expected skip says (its output, where GoogleTest prints GTEST_SKIP()'s message).
EXPECTED = [
    ("no GPU", re.compile(r"no CUDA device|needs \d+ CUDA devices, found \d+")),
    ("a CPU feature this machine lacks", re.compile(r"this CPU lacks|on this CPU\b")),
]


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        root = ET.parse(sys.argv[1]).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"check_skips: cannot read {sys.argv[1]}: {e}", file=sys.stderr)
        return 2
    reasons = collections.Counter()
    unexpected = []
    for case in root.iter("testcase"):
        if case.find("skipped") is None:
            continue
        out = case.findtext("system-out") or ""
        reason = next((name for name, pattern in EXPECTED if pattern.search(out)), None)
        if reason is None:
            said = [line for line in out.splitlines() if "SKIP" in line or "Skipped" in line][:3]
            unexpected.append((case.get("name", "?").split("  #")[0], said))
        else:
            reasons[reason] += 1
    for reason, n in sorted(reasons.items()):
        print(f"check_skips: {n} skipped, as expected: {reason}")
    for name, said in unexpected:
        print(f"check_skips: UNEXPECTED skip: {name}: {' / '.join(said) or '(it said nothing)'}")
    if unexpected:
        print(f"check_skips: {len(unexpected)} unexpected skips: install what they need, or fix them")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
