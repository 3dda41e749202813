#!/usr/bin/env python3
"""Every libFuzzer target is built, run in CI and documented: for each shardserve_fuzzer(NAME) of
fuzz/CMakeLists.txt, fails, naming the target and what it lacks, unless
  - fuzz/NAME_fuzzer.cc exists and fuzz/corpus/NAME/ holds at least one seed;
  - tools/ci/fuzz.sh lists it in TARGETS (what `fuzz.sh build` builds and `ci` runs) and gives it a
    MAX_LEN and a CI_RUNS count, and, where the target writes its own seeds (WriteSeeds, passed to
    fuzz/seeds.h's WriteSeedsIfAsked or message_stream.h's Initialize), lists it in SEED_WRITERS (whose
    written seeds `fuzz.sh ci` checks against the committed ones);
  - docs/security.md's "Fuzzing" has its row in the table of targets (what it calls, its input, what
    it checks) and in the table of long runs;
and fails on a name that tools/ci/fuzz.sh lists with no such target.

usage: fuzz_targets_test.py [--root REPO]
"""
import argparse
import os
import re
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    root = parser.parse_args().root
    read = lambda *path: open(os.path.join(root, *path), encoding="utf-8").read()

    cmake = re.sub(r"#.*", "", read("fuzz", "CMakeLists.txt"))
    targets = [t for t in re.findall(r"^\s*shardserve_fuzzer\((\w+)", cmake, re.M) if t != "name"]
    script = read("tools", "ci", "fuzz.sh")
    listed = re.search(r"^TARGETS=\(([^)]*)\)", script, re.M).group(1).split()
    max_len = set(re.findall(r"\[(\w+)\]=\d+", re.search(r"^declare -A MAX_LEN=\(([^)]*)\)", script, re.M).group(1)))
    ci_runs = set(re.findall(r"\[(\w+)\]=\d+", re.search(r"^declare -A CI_RUNS=\(([^)]*)\)", script, re.M).group(1)))
    seed_writers = re.search(r"^SEED_WRITERS=\(([^)]*)\)", script, re.M).group(1).split()
    security = read("docs", "security.md")
    rows = re.findall(r"^\| `(\w+)_fuzzer`[^|]*\| ([^|]*)\|", security, re.M)
    described = {name for name, second in rows if not re.match(r"\s*[\d,]+\s*$", second)}
    long_runs = {name for name, second in rows if re.match(r"\s*[\d,]+\s*$", second)}

    problems = []
    if not targets:
        problems.append("fuzz/CMakeLists.txt declares no target (shardserve_fuzzer(NAME ...))")
    for name in targets:
        lacks = []
        if not os.path.isfile(os.path.join(root, "fuzz", f"{name}_fuzzer.cc")):
            lacks.append(f"fuzz/{name}_fuzzer.cc")
        corpus = os.path.join(root, "fuzz", "corpus", name)
        if not os.path.isdir(corpus) or not os.listdir(corpus):
            lacks.append(f"seeds in fuzz/corpus/{name}/")
        for what, have in (("TARGETS", listed), ("MAX_LEN", max_len), ("CI_RUNS", ci_runs)):
            if name not in have:
                lacks.append(f"tools/ci/fuzz.sh's {what} entry")
        source = os.path.join(root, "fuzz", f"{name}_fuzzer.cc")
        writes = os.path.isfile(source) and re.search(r"(WriteSeedsIfAsked|Initialize)\(WriteSeeds\)",
                                                      open(source, encoding="utf-8").read())
        if writes and name not in seed_writers:
            lacks.append("tools/ci/fuzz.sh's SEED_WRITERS entry (it writes its own seeds)")
        if name not in described:
            lacks.append("a row in docs/security.md's table of targets")
        if name not in long_runs:
            lacks.append("a row in docs/security.md's table of long runs")
        if lacks:
            problems.append(f"{name}_fuzzer lacks " + ", ".join(lacks))
    for name in sorted((set(listed) | set(seed_writers)) - set(targets)):
        problems.append(f"tools/ci/fuzz.sh lists {name}, which fuzz/CMakeLists.txt does not build")
    for problem in problems:
        print(f"fuzz_targets_test: {problem}")
    if problems:
        sys.exit(1)
    print(f"fuzz_targets_test: {len(targets)} targets, each built, seeded, run in CI and documented")


if __name__ == "__main__":
    main()
