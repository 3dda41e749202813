#!/usr/bin/env python3
"""shardserve against llama.cpp on the same weights and the same VM (docs/performance.md).

    tools/bench/bench_llamacpp.py [--family F] prepare               the GGUF files of the bench model
    tools/bench/bench_llamacpp.py [--family F] decode  [--rounds R]  llama-bench against shardserve bench at 1 stream
    tools/bench/bench_llamacpp.py [--family F] agree   [--tokens N]  greedy tokens of every format against float32's
    tools/bench/bench_llamacpp.py [--family F] servers [--rounds R]  llama-server against shardserve launch's HTTP port
    tools/bench/bench_llamacpp.py speculative [--rounds R]          both servers with and without a draft model, 1 stream
    tools/bench/bench_llamacpp.py report  FILE.jsonl [--run ID]   medians and ratios of its records (of one run)

Needs llama.cpp built by tools/bench/build-llamacpp.sh (LCPP, default /work/llamacpp-build) and shardserve's
Release or RelWithDebInfo binaries (BIN, default build/bin). Standard library only, apart from
`prepare`, which runs tools/bench/bench_model_to_gguf.py in the venv build-llamacpp.sh makes (numpy, gguf).

--family llama (default), qwen3, gemma3 or qwen3moe: the bench model of that family
(tools/fixtures/make_bench_model.py --family F, whose docstring gives the shapes) in MODEL (default
build/bench-model, build/bench-model-F for the others), its GGUF files and records in OUT (default
build/lcpp-bench, build/lcpp-bench-F).

agree is the correctness check to run before any speed figure of a family: greedy ids after the same
prompt ids (--prompts random ones of --prompt-len ids) from llama.cpp and from shardserve, both on the
float32 weights (llama.cpp with a float32 KV cache, -ctk f32 -ctv f32); it exits 1 unless the two engines' float32 ids are the same for all --tokens of every
prompt. With random weights two logits can be near-equal, so that the engines' different summation
orders pick different tokens: then it says after how many tokens they part, and other prompts
(--prompt-seed) show whether it is a near-tie or a difference in the math.

Formats, each the same weights in both engines (the bench model of tools/fixtures/make_bench_model.py):
  f32   bench-f32.gguf (tools/bench/bench_model_to_gguf.py)   shardserve --worker-matmul-dtype f32
  bf16  llama-quantize BF16                             shardserve --worker-matmul-dtype bf16
  int8  llama-quantize Q8_0                             shardserve --quantization int8
  int4  llama-quantize Q4_0                             shardserve --quantization int4
llama-quantize keeps the embedding and the LM head (tied or not) in float32 (--token-embedding-type f32,
--output-tensor-type f32), as shardserve keeps them in every format here, and the norms and an MoE
router in float32, as both always do.

decode: per round, per format and thread count (1, 2), llama-bench (-p 128 -n 128 -r 3: prompt and
generation tokens/s, means of its 3 repetitions) and then `shardserve bench --compare tp1
--worker-threads T --concurrency 1` with 128 in / 128 out (decode tokens/s = 1 / ITL p50, prompt
tokens/s = 128 / TTFT p50); the engine that goes first alternates from round to round.
servers: per round, per format, llama-server (-np 32, continuous batching, -c 32 x 512) and
`shardserve launch` (one CPU worker, --http-port), each driven by `shardserve bench --backend openai`
at 1 stream and at 32 with the same token-id prompts (bench draws them from --vocab-size with --seed
0, never an EOS id; both servers take a list of ids as the prompt, so no tokenizer is involved).
speculative: speculative decoding with a draft model in both engines, on a model with a real language
(run it with MODEL=models/demo, whose draft is --draft, default models/demo-draft, both as float32
GGUF files in OUT): per round, llama-server (-np 1) and `shardserve launch`, each without and with the
draft (llama-server --spec-type draft-simple -md with --spec-draft-n-max K --spec-draft-n-min 0
--spec-draft-p-min P; shardserve --speculative draft
--num-speculative-tokens K), driven by `shardserve bench --backend openai` at 1 stream with the same
token-id prompts, greedy; the order of the four servers reverses from round to round. llama-server's
log gives its draft's acceptance.
--shardserve-args 'NAME=FLAGS' (repeatable; decode and servers) adds a shardserve variant with more
launch / bench flags, e.g. --shardserve-args 'act8=--activation-quantization int8': its records say
engine "shardserve[NAME]" and the report puts it beside plain shardserve, each against llama.cpp.
Every process this script starts is in a session of its own and is killed with its group at exit.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LCPP = os.environ.get("LCPP", "/work/llamacpp-build")
LBIN = os.path.join(LCPP, "build", "bin")
BIN = os.environ.get("BIN", os.path.join(ROOT, "build", "bin"))
FAMILIES = ("llama", "qwen3", "gemma3", "qwen3moe")  # make_bench_model.py --family
FAMILY = "llama"
MODEL = OUT = None  # set by main() from --family, or the environment's MODEL and OUT
VOCAB = 4096  # tools/fixtures/make_bench_model.py

sys.path.insert(0, os.path.join(ROOT, "tools", "ci"))
from ports import free_port  # noqa: E402  (each server its own port, claimed: never one just released)

FORMATS = {  # name: (GGUF file, llama-quantize type, shardserve flags)
    "f32": ("bench-f32.gguf", None, ["--worker-matmul-dtype", "f32"]),
    "bf16": ("bench-bf16.gguf", "BF16", ["--worker-matmul-dtype", "bf16"]),
    "int8": ("bench-q8_0.gguf", "Q8_0", ["--quantization", "int8"]),
    "int4": ("bench-q4_0.gguf", "Q4_0", ["--quantization", "int4"]),
}

_children = []


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def gguf(fmt):
    return os.path.join(OUT, FORMATS[fmt][0])


def start(cmd, logfile, env=None):
    f = open(logfile, "w")
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    _children.append(p)
    return p


def stop(p, grace=20):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if p in _children:
        _children.remove(p)


def stop_all(*_):
    for p in list(_children):
        stop(p, 5)
    sys.exit(130)


def wait_http(url, proc, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode} before it served (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(1)
    sys.exit(f"{what} did not answer 200 on {url} within {timeout} s")


def run_json(cmd, timeout=1800):
    """Runs cmd; returns its stdout parsed as JSON (bench --json, llama-bench -o json), None when it failed
    (bench's exit code 1, some requests failed, still returns its JSON: the failures are counted in it)."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        log(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
        if r.returncode != 1 or not r.stdout.strip():  # bench: 1 = some requests failed, JSON still written
            return None
    return json.loads(r.stdout)


def loadavg():
    return os.getloadavg()[0]


# ---- prepare ------------------------------------------------------------------------------------------

def prepare(_):
    os.makedirs(OUT, exist_ok=True)
    if not os.path.exists(os.path.join(MODEL, "config.json")):
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fixtures", "make_bench_model.py"),
                        "--family", FAMILY, MODEL], check=True)
    f32 = gguf("f32")
    if not os.path.exists(f32):
        subprocess.run([os.path.join(LCPP, "venv", "bin", "python"), os.path.join(ROOT, "tools", "bench", "bench_model_to_gguf.py"),
                        MODEL, f32], check=True)
    for fmt, (name, qtype, _) in FORMATS.items():
        if qtype and not os.path.exists(gguf(fmt)):
            subprocess.run([os.path.join(LBIN, "llama-quantize"), "--token-embedding-type", "f32",
                            "--output-tensor-type", "f32", f32, gguf(fmt), qtype], check=True)
    for fmt in FORMATS:
        log(f"{fmt}: {gguf(fmt)} ({os.path.getsize(gguf(fmt)) / 2**20:.1f} MiB)")


# ---- decode -------------------------------------------------------------------------------------------

def llama_bench(fmt, threads, n_in, n_out, extra):
    j = run_json([os.path.join(LBIN, "llama-bench"), "-m", gguf(fmt), "-p", str(n_in), "-n", str(n_out),
                  "-t", str(threads), "-r", "3", "-o", "json", *extra])
    if not j:
        return None
    pp = next(x for x in j if x["n_prompt"] > 0 and x["n_gen"] == 0)
    tg = next(x for x in j if x["n_gen"] > 0 and x["n_prompt"] == 0)
    return {"prompt_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"]}


def variants(a):
    """The shardserve engines of a run: [(engine name, extra flags)], plain shardserve first."""
    out = [("shardserve", [])]
    for v in a.shardserve_args or []:
        name, sep, flags = v.partition("=")
        if not sep or not name or " " in name:
            sys.exit(f"--shardserve-args wants NAME=FLAGS, got {v!r}")
        out.append((f"shardserve[{name}]", flags.split()))
    return out


def shardserve_bench_one(fmt, threads, n_in, n_out, requests, extra=()):
    j = run_json([os.path.join(BIN, "shardserve"), "bench", "--model", MODEL, "--compare", "tp1",
                  "--worker-threads", str(threads), *FORMATS[fmt][2], *extra, "--concurrency", "1",
                  "--num-requests", str(requests), "--input-len", str(n_in), "--output-len", str(n_out),
                  "--warmup", "1", "--json", "--log-dir", os.path.join(OUT, "logs", f"decode-{fmt}-t{threads}")])
    if not j or j["runs"][0].get("error") or j["runs"][0]["failed"]:
        log(f"shardserve {fmt} t{threads}: {j and j['runs'][0].get('error')}")
        return None
    r = j["runs"][0]
    return {"prompt_tok_s": n_in / r["ttft_p50_s"], "decode_tok_s": 1.0 / r["itl_p50_s"],
            "output_tok_s": r["output_tokens_per_s"], "weight_bytes": sum(r["worker_weight_bytes"])}


def decode(a):
    out = open(a.out, "a")
    run = run_id()
    for rnd in range(1, a.rounds + 1):
        for fmt in a.formats.split(","):
            for t in (int(x) for x in a.threads.split(",")):
                engines = [("llama.cpp", [])] + variants(a)
                order = engines if rnd % 2 else engines[::-1]
                for engine, extra in order:
                    la = loadavg()
                    if engine == "llama.cpp":
                        r = llama_bench(fmt, t, a.input_len, a.output_len, a.llama_args.split())
                    else:
                        r = shardserve_bench_one(fmt, t, a.input_len, a.output_len, a.requests, extra)
                    rec = {"kind": "decode", "run": run, "family": FAMILY, "round": rnd, "format": fmt, "threads": t,
                           "engine": engine,
                           "load_before": la, "load_after": loadavg(), **(r or {"error": True})}
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    log(json.dumps(rec))
    report_file(a.out, run)


# ---- agree --------------------------------------------------------------------------------------------

def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_server(fmt, port, threads, parallel, ctx, extra=()):
    p = start([os.path.join(LBIN, "llama-server"), "-m", gguf(fmt), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-np", str(parallel), "-c", str(ctx), "-cb", "-fa", "off", "--no-webui",
               "--alias", "bench", *extra], os.path.join(OUT, "logs", f"llama-server-{fmt}.log"))
    wait_http(f"http://127.0.0.1:{port}/health", p, 300, f"llama-server ({fmt})")
    return p


def agree_prompts(a):
    """The prompts' ids: --prompt, or --prompts prompts of --prompt-len ids each, drawn by
    random.Random(--prompt-seed + i) from 2 .. VOCAB - 1 (never the BOS or EOS id, 0 and 1)."""
    if a.prompt:
        return [[int(x) for x in a.prompt.split(",")]]
    import random
    rngs = [random.Random(a.prompt_seed + i) for i in range(a.prompts)]
    return [[rng.randrange(2, VOCAB) for _ in range(a.prompt_len)] for rng in rngs]


def agree(a):
    """Greedy ids after the same prompt ids: llama.cpp (llama-server /completion, return_tokens; its KV
    cache float32 for f32, its default float16 for the others) for each GGUF of --formats, shardserve (generate-ids: float32 products, so f32, int8 and int4); each against both
    engines' float32 ids. Exit status 1 unless the two engines' float32 ids are the same for every prompt."""
    os.makedirs(os.path.join(OUT, "logs"), exist_ok=True)
    formats = a.formats.split(",")
    if "f32" not in formats:
        sys.exit("agree: --formats must include f32, the reference of every other")
    prompts = agree_prompts(a)
    ids = {}  # (engine, format, prompt index): ids
    for fmt in formats:
        a.port = free_port()
        # float32 weights with a float32 KV cache, as shardserve's float32 worker keeps it (llama.cpp's
        # default float16 cache parts from both shardserve and transformers at near-ties).
        p = llama_server(fmt, a.port, 1, 1, 1024, ["-ctk", "f32", "-ctv", "f32"] if fmt == "f32" else [])
        try:
            for i, prompt in enumerate(prompts):
                r = post(f"http://127.0.0.1:{a.port}/completion",
                         {"prompt": prompt, "n_predict": a.tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                          "return_tokens": True, "cache_prompt": False})
                ids[("llama.cpp", fmt, i)] = r["tokens"]
        finally:
            stop(p)
    # generate-ids computes its products in float32 (on the checkpoint's bf16 values, the float32 GGUF's
    # values), whatever the CPU: shardserve's bf16 products are not covered here.
    for fmt, flags in (("f32", []), ("int8", ["--quantization", "int8"]), ("int4", ["--quantization", "int4"])):
        if fmt not in formats:
            continue
        for i, prompt in enumerate(prompts):
            r = subprocess.run([os.path.join(BIN, "shardserve"), "generate-ids", "--model", MODEL, "--max-new-tokens",
                                str(a.tokens), *flags, *map(str, prompt)], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"shardserve generate-ids ({fmt}) failed ({r.returncode}): {r.stderr.strip()}")
            ids[("shardserve", fmt, i)] = [int(x) for x in r.stdout.split()][-a.tokens:]

    def lead(x, y):
        return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))

    def same(x, y):
        return f"{sum(u == v for u, v in zip(x, y))}/{len(x)} (first {lead(x, y)} in a row)"
    print(f"family {FAMILY}: {MODEL}")
    agreed = []
    for i, prompt in enumerate(prompts):
        ref_l, ref_s = ids[("llama.cpp", "f32", i)], ids[("shardserve", "f32", i)]
        print(f"prompt {i}, {len(prompt)} ids: {prompt}")
        for (engine, fmt, j), x in ids.items():
            if j == i:
                print(f"  {engine:10s} {fmt:4s} vs llama.cpp f32 {same(x, ref_l):24s} vs shardserve f32 "
                      f"{same(x, ref_s):24s} {x}")
        agreed.append(lead(ref_l, ref_s) if len(ref_l) == len(ref_s) == a.tokens else 0)
    print(f"float32 llama.cpp and shardserve agree on the first {', '.join(map(str, agreed))} of {a.tokens} "
          f"greedy tokens ({len(prompts)} prompts)")
    if min(agreed) < a.tokens:
        print("FAIL")
        sys.exit(1)
    print("ok")


# ---- servers ------------------------------------------------------------------------------------------

def bench_openai(base_url, concurrency, requests, n_in, n_out, tag):
    j = run_json([os.path.join(BIN, "shardserve"), "bench", "--backend", "openai", "--base-url", base_url,
                  "--vocab-size", str(VOCAB), "--concurrency", str(concurrency), "--num-requests", str(requests),
                  "--input-len", str(n_in), "--output-len", str(n_out), "--warmup", "2", "--json"])
    if not j:
        return {"error": True}
    keys = ("completed", "failed", "duration_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
            "itl_p99_s", "e2e_p50_s", "resent_on_new_connection")
    rec = {k: j.get(k) for k in keys}
    rec["tpot_s"] = tpot(j, n_out)
    rec["errors"] = j.get("errors")
    return rec


def tpot(j, n_out):
    """Time per output token after the first: (e2e p50 - TTFT p50) / (n_out - 1) (medians, not per request)."""
    if j.get("e2e_p50_s") is None or j.get("ttft_p50_s") is None or n_out < 2:
        return None
    return (j["e2e_p50_s"] - j["ttft_p50_s"]) / (n_out - 1)


def shardserve_launch(fmt, port, threads, tmp, extra=()):
    env = dict(os.environ, SHARDSERVE_STATE_DIR=os.path.join(tmp, "state"))
    p = start([os.path.join(BIN, "shardserve"), "launch", "--model", MODEL, "--nodes", "1", "--gpus-per-node", "1",
               "--device", "cpu", "--worker-threads", str(threads), "--insecure", "--address", "127.0.0.1:0",
               "--metrics-port-base", "0", "--http-port", str(port), "--log-dir", os.path.join(tmp, "logs"),
               *FORMATS[fmt][2], *extra], os.path.join(OUT, "logs", f"launch-{fmt}.log"), env=env)
    wait_http(f"http://127.0.0.1:{port}/health", p, 600, f"shardserve launch ({fmt})")  # 503 until loaded
    return p


def servers(a):
    out = open(a.out, "a")
    run = run_id()
    os.makedirs(os.path.join(OUT, "logs"), exist_ok=True)
    for rnd in range(1, a.rounds + 1):
        for fmt in a.formats.split(","):
            engines = [("llama.cpp", [])] + variants(a)
            order = engines if rnd % 2 else engines[::-1]
            for engine, extra in order:
                with tempfile.TemporaryDirectory(prefix="lcpp-bench-") as tmp:
                    port = free_port()
                    if engine == "llama.cpp":
                        p = llama_server(fmt, port, a.threads, 32, 32 * a.slot_ctx, a.llama_args.split())
                    else:
                        p = shardserve_launch(fmt, port, a.threads, tmp, extra)
                    try:
                        for conc, reqs in ((1, a.requests_1), (32, a.requests_32)):
                            la = loadavg()
                            r = bench_openai(f"http://127.0.0.1:{port}/v1", conc, reqs, a.input_len, a.output_len,
                                             f"{engine}-{fmt}-{conc}")
                            if r.get("error"):  # once more; the record says so
                                r = dict(bench_openai(f"http://127.0.0.1:{port}/v1", conc, reqs, a.input_len,
                                                      a.output_len, f"{engine}-{fmt}-{conc}"), retried=True)
                            rec = {"kind": "servers", "run": run, "family": FAMILY, "round": rnd, "format": fmt,
                                   "engine": engine, "streams": conc,
                                   "load_before": la, "load_after": loadavg(), **r}
                            out.write(json.dumps(rec) + "\n")
                            out.flush()
                            log(json.dumps(rec))
                    finally:
                        stop(p)
    report_file(a.out, run)


# ---- speculative ---------------------------------------------------------------------------------------

def llama_acceptance(logfile):
    """llama-server's draft acceptance over the run, from its log's per-request lines
    ("draft acceptance = 0.57895 (   44 accepted /    76 generated), mean len =  3.32"): (accepted, generated)."""
    import re
    accepted = generated = 0
    for line in open(logfile, errors="replace"):
        m = re.search(r"draft acceptance = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) generated\)", line)
        if m:
            accepted += int(m.group(1))
            generated += int(m.group(2))
    return accepted, generated


def speculative(a):
    out = open(a.out, "a")
    run = run_id()
    fmt = "f32"
    if not os.path.exists(gguf(fmt)):
        sys.exit(f"{gguf(fmt)} is missing: run `prepare` first (with the same MODEL and OUT)")
    draft = os.path.join(OUT, "draft-f32.gguf")
    if not os.path.exists(draft):
        subprocess.run([os.path.join(LCPP, "venv", "bin", "python"), os.path.join(ROOT, "tools", "bench", "bench_model_to_gguf.py"),
                        a.draft, draft], check=True)
    k = str(a.num_speculative_tokens)
    servers_ = [("llama.cpp", "none", []),
                ("llama.cpp", "draft", ["--spec-type", "draft-simple", "-md", draft, "--spec-draft-n-max", k,
                                        "--spec-draft-n-min", "0", "--spec-draft-p-min", str(a.draft_p_min),
                                        "-td", str(a.threads)]),
                ("shardserve", "none", []),
                ("shardserve", "draft", ["--speculative", "draft", "--draft-model", os.path.abspath(a.draft),
                                         "--num-speculative-tokens", k])]
    for rnd in range(1, a.rounds + 1):
        for engine, variant, extra in (servers_ if rnd % 2 else servers_[::-1]):
            with tempfile.TemporaryDirectory(prefix="lcpp-bench-") as tmp:
                port = free_port()
                if engine == "llama.cpp":
                    p = llama_server(fmt, port, a.threads, 1, a.slot_ctx, extra)
                else:
                    p = shardserve_launch(fmt, port, a.threads, tmp, extra)
                try:
                    la = loadavg()
                    r = bench_openai(f"http://127.0.0.1:{port}/v1", 1, a.requests, a.input_len, a.output_len,
                                     f"{engine}-{variant}")
                    rec = {"kind": "speculative", "run": run, "round": rnd, "engine": engine, "draft": variant,
                           "k": a.num_speculative_tokens, "load_before": la, "load_after": loadavg(), **r}
                finally:
                    stop(p)
                if engine == "llama.cpp" and variant == "draft":
                    rec["accepted"], rec["proposed"] = llama_acceptance(os.path.join(OUT, "logs", f"llama-server-{fmt}.log"))
                out.write(json.dumps(rec) + "\n")
                out.flush()
                log(json.dumps(rec))
    report_file(a.out, run)


# ---- report -------------------------------------------------------------------------------------------

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def run_id():
    """A run's records carry its start time: the output file gathers every run (it is opened to
append), and the table a run prints at its end is of its own records only."""
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def report_file(path, run=None):
    recs = [json.loads(l) for l in open(path) if l.strip()]
    if run is not None:
        recs = [r for r in recs if r.get("run") == run]
        if not recs:
            sys.exit(f"{path}: no record of run {run}")
        print(f"run {run}: {len(recs)} records of {path}")
    loads = [r[k] for r in recs for k in ("load_before", "load_after")]
    dec = [r for r in recs if r["kind"] == "decode" and not r.get("error")]
    if dec:
        print("| format | threads | llama.cpp decode tok/s | shardserve decode tok/s | ratio | llama.cpp prompt tok/s "
              "| shardserve prompt tok/s | ratio | rounds |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for fmt in FORMATS:
            for t in sorted({r["threads"] for r in dec}):
                rows = [r for r in dec if r["format"] == fmt and r["threads"] == t]
                if not rows:
                    continue
                for engine in sorted({r["engine"] for r in rows} - {"llama.cpp"}):
                    cells = []
                    for key in ("decode_tok_s", "prompt_tok_s"):
                        l = med(r[key] for r in rows if r["engine"] == "llama.cpp")
                        s = med(r[key] for r in rows if r["engine"] == engine)
                        cells += [f"{l:.1f}", f"{s:.1f}", f"{s / l:.2f}x"]
                    label = fmt if engine == "shardserve" else f"{fmt} {engine[len('shardserve'):]}"
                    print(f"| {label} | {t} | " + " | ".join(cells) + f" | {len({r['round'] for r in rows})} |")
    srv = [r for r in recs if r["kind"] == "servers" and not r.get("error")]
    if srv:
        print("| format | streams | engine | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT ms | ITL p50 ms "
              "| failed | rounds |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for fmt in FORMATS:
            for conc in sorted({r["streams"] for r in srv}):
                tput = {}
                engines = ["llama.cpp"] + sorted({r["engine"] for r in srv} - {"llama.cpp"})
                for engine in engines:
                    rows = [r for r in srv if r["format"] == fmt and r["streams"] == conc and r["engine"] == engine]
                    if not rows:
                        continue
                    tput[engine] = med(r["output_tokens_per_s"] for r in rows)
                    ms = lambda k: med(r[k] for r in rows) * 1e3
                    print(f"| {fmt} | {conc} | {engine} | {tput[engine]:.1f} | {ms('ttft_p50_s'):.0f} | "
                          f"{ms('ttft_p99_s'):.0f} | {ms('tpot_s'):.1f} | {ms('itl_p50_s'):.1f} | "
                          f"{sum(r['failed'] or 0 for r in rows)} | {len(rows)} |")
                for engine in engines[1:]:
                    if "llama.cpp" in tput and engine in tput:
                        print(f"| {fmt} | {conc} | {engine} / llama.cpp | {tput[engine] / tput['llama.cpp']:.2f}x "
                              "| | | | | | |")
    spec = [r for r in recs if r["kind"] == "speculative" and not r.get("error")]
    if spec:
        print("| engine | draft | output tok/s (rounds) | median | against none | guesses accepted |")
        print("|---|---|---|---:|---:|---|")
        for engine in ("llama.cpp", "shardserve"):
            none = med(r["output_tokens_per_s"] for r in spec if r["engine"] == engine and r["draft"] == "none")
            for variant in ("none", "draft"):
                rows = [r for r in spec if r["engine"] == engine and r["draft"] == variant]
                if not rows:
                    continue
                tput = med(r["output_tokens_per_s"] for r in rows)
                acc, prop = sum(r.get("accepted", 0) for r in rows), sum(r.get("proposed", 0) for r in rows)
                accepted = f"{100 * acc / prop:.0f}% of {prop}" if prop else "-"
                rounds = ", ".join(f"{r['output_tokens_per_s']:.1f}" for r in rows)
                print(f"| {engine} | {variant} | {rounds} | {tput:.1f} | {tput / none:.2f}x | {accepted} |")
    if loads:
        print(f"load average (1 min) over the runs: {min(loads):.1f} to {max(loads):.1f}, median {med(loads):.1f}")


def main():
    global FAMILY, MODEL, OUT
    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=FAMILIES, default="llama", help="the bench model's family")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare")
    d = sub.add_parser("decode")
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--formats", default="f32,bf16,int8,int4")
    d.add_argument("--threads", default="1,2")
    d.add_argument("--input-len", type=int, default=128)
    d.add_argument("--output-len", type=int, default=128)
    d.add_argument("--requests", type=int, default=3)
    d.add_argument("--out", help="default OUT/decode.jsonl")
    d.add_argument("--llama-args", default="", help="more llama-bench flags, e.g. '--poll 0'")
    d.add_argument("--shardserve-args", action="append", metavar="NAME=FLAGS",
                   help="a shardserve variant with more bench flags (repeatable)")
    g = sub.add_parser("agree")
    g.add_argument("--tokens", type=int, default=32)
    g.add_argument("--formats", default="f32,bf16,int8,int4", help="f32 alone is the correctness check")
    g.add_argument("--prompt", help="comma-separated ids (one prompt); default --prompts random prompts")
    g.add_argument("--prompts", type=int, default=4)
    g.add_argument("--prompt-len", type=int, default=96,
                   help="longer than the Gemma 3 bench model's sliding window (64), so that it slides")
    g.add_argument("--prompt-seed", type=int, default=0, help="the first prompt's seed; the others count on")
    s = sub.add_parser("servers")
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--formats", default="f32,int8,int4")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--input-len", type=int, default=128)
    s.add_argument("--output-len", type=int, default=64)
    s.add_argument("--requests-1", type=int, default=4)
    s.add_argument("--requests-32", type=int, default=64)
    s.add_argument("--slot-ctx", type=int, default=512)
    s.add_argument("--out", help="default OUT/servers.jsonl")
    s.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '--poll 0'")
    s.add_argument("--shardserve-args", action="append", metavar="NAME=FLAGS",
                   help="a shardserve variant with more launch flags (repeatable), e.g. "
                        "'act8=--activation-quantization int8'")
    sp = sub.add_parser("speculative")
    sp.add_argument("--rounds", type=int, default=2)
    sp.add_argument("--draft", default=os.path.join(ROOT, "models", "demo-draft"), help="the draft model's directory")
    sp.add_argument("--num-speculative-tokens", type=int, default=4, help="K: guesses a step at most, in both")
    sp.add_argument("--draft-p-min", type=float, default=0.0,
                    help="llama-server's: the draft stops guessing below this probability (its default 0)")
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--input-len", type=int, default=64)
    sp.add_argument("--output-len", type=int, default=128)
    sp.add_argument("--requests", type=int, default=16)
    sp.add_argument("--slot-ctx", type=int, default=512)
    sp.add_argument("--out", help="default OUT/speculative.jsonl")
    r = sub.add_parser("report")
    r.add_argument("file")
    r.add_argument("--run", help="only the records of this run (its start time, each record's \"run\"); "
                                 "default every record in the file")
    a = ap.parse_args()
    FAMILY = a.family
    suffix = "" if FAMILY == "llama" else "-" + FAMILY
    MODEL = os.environ.get("MODEL", os.path.join(ROOT, "build", "bench-model" + suffix))
    OUT = os.environ.get("OUT", os.path.join(ROOT, "build", "lcpp-bench" + suffix))
    if a.cmd in ("decode", "servers", "speculative") and a.out is None:
        a.out = os.path.join(OUT, a.cmd + ".jsonl")
    os.makedirs(os.path.join(OUT, "logs"), exist_ok=True)
    try:
        {"prepare": prepare, "decode": decode, "agree": agree, "servers": servers, "speculative": speculative,
         "report": lambda a: report_file(a.file, a.run)}[a.cmd](a)
    finally:
        for p in list(_children):
            stop(p, 5)


if __name__ == "__main__":
    main()
