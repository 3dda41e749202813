#!/usr/bin/env python3
"""xgrammar's compile and mask times on bench_grammar's cases, vocabulary and walks.

bench_grammar (tools/bench/bench_grammar.cc) times shardserve's grammar engine; with
--write-walks FILE it writes the vocabulary it used and the tokens of every walk. This script
compiles the same cases (tests/fixtures/grammar/cases.json) with xgrammar over that vocabulary, as
tools/fixtures/make_grammar_fixtures.py does (compact JSON, strict mode), and times
fill_next_token_bitmask at every step of the same walks, so that the two tables compare the same
work. Each case is compiled --runs times (a compiler with its cache off, --threads threads) and
walked --runs times; each mask counts as its median over the runs, as in bench_grammar, in wall
time and in the thread's CPU time (which a loaded machine's waits for a core do not inflate). A
mask's time is taken around the Python call, so it includes the call's own overhead (about a
microsecond).

  tools/bench/xgrammar-env.sh                                # .venv-xgrammar: xgrammar (and torch)
  build/bin/bench_grammar --runs 3 --compiles 1 --write-walks /tmp/walks.json
  .venv-xgrammar/bin/python tools/bench/bench_xgrammar.py /tmp/walks.json [--runs 3] [--threads 1]
"""
import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time

import xgrammar as xgr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(ROOT, "tests/fixtures/grammar/cases.json")
sys.path.insert(0, os.path.join(ROOT, "tools/fixtures"))
from make_grammar_fixtures import grammar_of  # noqa: E402  (each case as the fixtures compile it)


def percentile(values, p):
    """The same rank as bench_grammar's Percentile: sorted[min(n - 1, floor(p * n))]."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("walks", help="the file bench_grammar --write-walks wrote")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="xgrammar's compile threads (max_threads)")
    args = ap.parse_args()

    recorded = json.load(open(args.walks))
    vocab = [bytes.fromhex(h) for h in recorded["vocab"]]
    eos = recorded["eos"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=eos)
    cases = {c["name"]: c for c in json.load(open(CASES))}
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    print(f"xgrammar {importlib.metadata.version('xgrammar')}, vocabulary {len(vocab)} tokens, {args.threads} compile thread(s), "
          f"{args.runs} runs")
    print(f"{'case':30s} {'compile_ms':>10s} {'masks':>6s} {'p50_us':>10s} {'p99_us':>10s} {'max_us':>10s} "
          f"{'cpu_p50_us':>10s} {'cpu_p99_us':>10s} {'refused':>8s}")
    all_us, all_cpu_us, compile_medians = [], [], []
    for rec in recorded["cases"]:
        grammar = grammar_of(cases[rec["name"]])
        compile_ms, run_us, run_cpu_us, refused = [], [], [], 0
        for _ in range(args.runs):
            compiler = xgr.GrammarCompiler(info, max_threads=args.threads, cache_enabled=False)
            t0 = time.perf_counter()
            compiled = compiler.compile_grammar(grammar)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
            us, cpu_us, refused = [], [], 0
            for walk in rec["walks"]:
                m = xgr.GrammarMatcher(compiled)
                # As bench_grammar: one mask before each token the walk accepts.
                for token in walk:
                    c0 = time.thread_time_ns()
                    t0 = time.perf_counter_ns()
                    m.fill_next_token_bitmask(bitmask)
                    us.append((time.perf_counter_ns() - t0) / 1e3)
                    cpu_us.append((time.thread_time_ns() - c0) / 1e3)
                    if not m.accept_token(token):
                        refused += 1  # a token the engines disagree on (cases.json says where)
                        break
            run_us.append(us)
            run_cpu_us.append(cpu_us)
        steps = min(len(u) for u in run_us)
        mask_us = [statistics.median(u[k] for u in run_us) for k in range(steps)]
        mask_cpu_us = [statistics.median(u[k] for u in run_cpu_us) for k in range(steps)]
        all_us += mask_us
        all_cpu_us += mask_cpu_us
        compile_medians.append(statistics.median(compile_ms))
        print(f"{rec['name']:30s} {statistics.median(compile_ms):10.1f} {len(mask_us):6d} {percentile(mask_us, 0.5):10.1f} "
              f"{percentile(mask_us, 0.99):10.1f} {percentile(mask_us, 1.0):10.1f} {percentile(mask_cpu_us, 0.5):10.1f} "
              f"{percentile(mask_cpu_us, 0.99):10.1f} {refused:8d}")
        sys.stdout.flush()
    print(f"{'all':30s} {statistics.median(compile_medians):10.1f} {len(all_us):6d} {percentile(all_us, 0.5):10.1f} "
          f"{percentile(all_us, 0.99):10.1f} {percentile(all_us, 1.0):10.1f} {percentile(all_cpu_us, 0.5):10.1f} "
          f"{percentile(all_cpu_us, 0.99):10.1f}")
    print(f"compile: median of the cases' medians {statistics.median(compile_medians):.1f} ms, "
          f"largest {max(compile_medians):.1f} ms")


if __name__ == "__main__":
    main()
