#!/usr/bin/env python3
"""`shardserve bench` end to end, with real processes on loopback (stdlib only).

1. `bench --compare tp1` starts a local cluster of the demo model (models/demo) on a free port,
   runs 6 requests at concurrency 2 and prints JSON: one run, 6 completed, 0 failed, positive
   output tokens/s, TTFT p50 <= p99, per-worker peak RSS and weight bytes; afterwards no
   shardserve process of its session is left (pgrep -s on the binaries of BIN_DIR).
2. `bench --address` on a port nobody listens on fails within seconds, non-zero, naming the address.
3. Ctrl-C: SIGINT to bench while it loads a cluster: exit 130 within seconds, nothing left behind.
4. Flag forwarding: `bench --compare pp2/serial,pp2/serial` with scheduler flags and
   --worker-threads and --worker-memory-gb; the command lines in each round's log dir (pp2_serial,
   then pp2_serial_2: a layout run twice keeps both rounds' logs) carry them (--micro-batches 1 from
   /serial), and both runs complete.
5. The multi-turn chat load: `bench --compare tp1,tp1/no-prefix-caching --chat-turns 3` with a
   shared system prompt: every turn completes in both; the first run has prefix caching on and
   reports cached prompt tokens (more than the system prompt's full blocks alone, since later
   turns find their history), the second has it off (--no-prefix-caching in its coordinator's
   command line) and reports none; the input tokens are the same in both (the same prompts).
6. The OpenAI backend beside gRPC: `bench --compare tp1,tp1/http` runs the same load over the
   coordinator's gRPC API and over its OpenAI HTTP API (streamed /v1/completions): both complete
   every request with the same input and output token counts (6 x 8 each), positive TTFT.
7. `bench --backend openai --base-url` against a real `launch` cluster's HTTP port, and
   `bench` over gRPC against the same cluster (its cluster.json, mutual TLS): the same completed
   requests and token counts. Then the multi-turn chat load over HTTP against the same cluster
   (`--chat-turns 3`, /v1/chat/completions, no --vocab-size): every turn completes with its output
   tokens, later turns find their history in the prefix cache (cached prompt tokens), and each
   turn's answer is sent back in the next turn's messages: the same load with --output-len 16
   instead of 8 (the same messages, from the same seed) has more input tokens.
8. `--backend openai` at a port nobody listens on: exit 1 within seconds, naming the URL and the
   refused connection.
9. Bad flags refused with exit 2 and a message naming the flag: --backend other, openai without
   --base-url or --vocab-size (but for the chat load), an https or portless URL, --base-url with
   gRPC, --address with openai.
10. Expert parallelism and the collectives' transport: `bench --compare tp2,tp2/ep/gloo` on a
   mixture-of-experts fixture runs both, the /ep layout's coordinator with --expert-parallel, the
   /gloo layout's workers with --collectives gloo (their logs: Gloo TCP; tp2's: shared memory).
11. Structured outputs: `bench --compare tp1,tp1/json,tp1/http/json` runs the same load without a
   constraint, with tools/bench/bench_schema.json over gRPC and over HTTP: every request completes
   with exactly --output-len tokens in each (bench checks each constrained output is the start of a
   JSON text); a schema whose instances end sooner (a boolean) fails every request, saying why.
   Bad --json-schema files and combinations are refused with exit 2, naming the file.

bench runs in a session of its own (start_new_session), so "left behind" means a process of that
session, and tests running beside this one in parallel are not counted. Every wait is bounded.

usage: bench_test.py BIN_DIR [--old-binaries]
  --old-binaries: for developing against binaries without worker --threads and the scheduler
  flags: cases 1 and 3 pass --worker-threads 0, case 4 is reported SKIPPED.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from cli_check import free_port, free_ports, scaled  # scaled: SHARDSERVE_TEST_TIME_SCALE

DEADLINE_S = scaled(240)  # per bench invocation; the demo model loads in well under a second


def run_bench(bench_args, timeout=DEADLINE_S):
    """Runs `shardserve bench ...` in a new session; returns (rc, stdout, stderr, session id)."""
    proc = subprocess.Popen([os.path.join(BIN, "shardserve"), "bench", *bench_args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        fail(f"bench did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err, proc.pid


def leftovers(sid):
    """shardserve processes of BIN_DIR still in session `sid` (pgrep -s; none is the answer wanted)."""
    r = subprocess.run(["pgrep", "-a", "-s", str(sid), "-f", os.path.join(BIN, "shardserve")], capture_output=True,
                       text=True)
    return r.stdout.strip()


def kill_session(sid):
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def case_compare_tp1(work, old_binaries):
    args = ["--compare", "tp1", "--num-requests", "6", "--concurrency", "2", "--input-len", "8", "--output-len", "8",
            "--json", "--log-dir", os.path.join(work, "tp1-logs")]
    if old_binaries:
        args += ["--worker-threads", "0"]
    start = time.monotonic()
    rc, out, err, sid = run_bench(args)
    left = leftovers(sid)
    kill_session(sid)
    check(not left, f"processes left behind after bench exited:\n{left}")
    check(rc == 0, f"bench --compare tp1 exited {rc}\nstdout:\n{out}\nstderr:\n{err}")
    try:
        result = json.loads(out)
    except ValueError as e:
        fail(f"stdout is not JSON ({e}):\n{out}")
    runs = result.get("runs")
    check(isinstance(runs, list) and len(runs) == 1, f"expected 1 run, got {runs!r}")
    r = runs[0]
    for key in ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s",
                "itl_p90_s", "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "completed", "failed", "duration_s", "concurrency",
                "request_rate", "input_len", "output_len", "num_requests", "layout", "worker_peak_rss_bytes",
                "worker_weight_bytes"):
        check(key in r, f"run lacks key {key}: {r}")
    check(r["layout"] == "tp1" and r["error"] is None, f"layout/error: {r['layout']!r} {r['error']!r}")
    check(r["completed"] == 6 and r["failed"] == 0, f"completed {r['completed']}, failed {r['failed']}: {r['errors']}")
    check(r["total_output_tokens"] == 48, f"total_output_tokens {r['total_output_tokens']}, expected 6 x 8")
    check(r["output_tokens_per_s"] > 0, f"output_tokens_per_s {r['output_tokens_per_s']}")
    check(0 < r["ttft_p50_s"] <= r["ttft_p99_s"], f"ttft p50 {r['ttft_p50_s']} p99 {r['ttft_p99_s']}")
    check(0 < r["itl_p50_s"] <= r["itl_p99_s"], f"itl p50 {r['itl_p50_s']} p99 {r['itl_p99_s']}")
    check(r["concurrency"] == 2 and r["request_rate"] is None and r["num_requests"] == 6, "load keys")
    rss, weights = r["worker_peak_rss_bytes"], r["worker_weight_bytes"]
    check(len(rss) == 1 and rss[0] > 0, f"worker_peak_rss_bytes {rss}")
    # The demo model: 2,361,024 bf16 parameters = 4.7 MB; a TP=1 worker holds all of them.
    check(len(weights) == 1 and 4_000_000 < weights[0] < 50_000_000, f"worker_weight_bytes {weights}")
    check(rss[0] >= weights[0], f"peak RSS {rss[0]} below the weights {weights[0]}")
    print(f"ok: --compare tp1: 6/6 completed, {r['output_tokens_per_s']:.1f} output tok/s, "
          f"TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms, peak RSS {rss[0] / 2**20:.1f} MiB, no process left "
          f"({time.monotonic() - start:.1f} s)")


def case_nobody_listens():
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    rc, out, err, sid = run_bench(["--address", address, "--num-requests", "2"], timeout=30)
    took = time.monotonic() - start
    kill_session(sid)
    check(rc not in (0, None), f"bench against {address} (nobody listening) exited {rc}")
    check("cannot reach the coordinator at " + address in err, f"unclear error:\n{err}")
    check(took < 15, f"took {took:.1f} s to give up")
    print(f"ok: nobody at {address}: exit {rc} after {took:.2f} s: {err.strip().splitlines()[-1][:100]}")


def case_interrupt(work, old_binaries):
    logs = os.path.join(work, "int-logs")
    args = ["--compare", "tp1,pp2", "--num-requests", "100000", "--concurrency", "2", "--input-len", "8",
            "--output-len", "64", "--log-dir", logs]
    if old_binaries:
        args += ["--worker-threads", "0"]
    with open(os.path.join(work, "int.stderr"), "w+") as errf:
        proc = subprocess.Popen([os.path.join(BIN, "shardserve"), "bench", *args], stdout=subprocess.DEVNULL,
                                stderr=errf, start_new_session=True)
        deadline = time.monotonic() + scaled(60)
        while "serving on" not in open(errf.name).read():
            if proc.poll() is not None or time.monotonic() > deadline:
                kill_session(proc.pid)
                proc.wait()
                fail(f"bench never reported serving:\n{open(errf.name).read()}")
            time.sleep(0.1)
        time.sleep(1)  # requests in flight
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            proc.wait()
            fail("bench did not stop within 30 s of SIGINT")
        took = time.monotonic() - start
        left = leftovers(proc.pid)
        kill_session(proc.pid)
        check(not left, f"processes left behind after SIGINT:\n{left}")
        check(rc == 130, f"exit {rc} after SIGINT, expected 130:\n{open(errf.name).read()}")
    print(f"ok: SIGINT during the load: exit 130 after {took:.2f} s, no process left")


def case_forwarding(work, old_binaries):
    if old_binaries:
        print("SKIPPED: flag forwarding needs a coordinator with --micro-batches/--max-num-seqs and a worker with "
              "--threads (--old-binaries)")
        return
    logs = os.path.join(work, "fwd-logs")
    rc, out, err, sid = run_bench(["--compare", "pp2/serial,pp2/serial", "--num-requests", "2", "--concurrency", "2",
                                   "--input-len", "8", "--output-len", "4", "--warmup", "0", "--json",
                                   "--max-num-seqs", "4", "--block-size", "16", "--worker-threads", "1",
                                   "--worker-memory-gb", "3", "--log-dir", logs])
    left = leftovers(sid)
    kill_session(sid)
    check(not left, f"processes left behind after bench exited:\n{left}")
    for round_dir in ("pp2_serial", "pp2_serial_2"):
        with open(os.path.join(logs, round_dir, "commands.sh")) as f:
            lines = f.read().splitlines()
        coordinator = [l for l in lines if "shardserve-coordinator" in l]
        workers = [l for l in lines if "shardserve-worker" in l]
        check(len(coordinator) == 1, f"{round_dir}/commands.sh: {lines}")
        for flag in ("--nodes 2", "--gpus-per-node 1", "--max-num-seqs 4", "--block-size 16", "--micro-batches 1"):
            check(flag in coordinator[0], f"coordinator command lacks '{flag}': {coordinator[0]}")
        check(len(workers) == 2 and all(w.endswith("--threads 1 --memory-gb 3.000") for w in workers),
              f"worker commands: {workers}")
    check(rc == 0, f"bench --compare pp2/serial,pp2/serial exited {rc}\nstderr:\n{err}")
    runs = json.loads(out)["runs"]
    check(len(runs) == 2, f"runs: {runs}")
    for r in runs:
        check(r["completed"] == 2 and r["failed"] == 0 and r["serial"], f"pp2/serial run: {r}")
    print("ok: pp2/serial twice: --micro-batches 1, --max-num-seqs, --block-size to the coordinator, --threads to "
          "both workers, each round's logs kept; 2/2 completed in each")


def case_chat(work):
    logs = os.path.join(work, "chat-logs")
    rc, out, err, sid = run_bench(["--compare", "tp1,tp1/no-prefix-caching", "--chat-turns", "3",
                                   "--system-prompt-len", "40", "--num-requests", "6", "--concurrency", "2",
                                   "--input-len", "10", "--output-len", "8", "--warmup", "0", "--json",
                                   "--log-dir", logs])
    left = leftovers(sid)
    kill_session(sid)
    check(not left, f"processes left behind after bench exited:\n{left}")
    check(rc == 0, f"bench --compare tp1,tp1/no-prefix-caching --chat-turns 3 exited {rc}\nstderr:\n{err}")
    with open(os.path.join(logs, "tp1_no-prefix-caching", "commands.sh")) as f:
        check("--no-prefix-caching" in f.read(), "the /no-prefix-caching coordinator lacks --no-prefix-caching")
    on, off = json.loads(out)["runs"]
    for r in (on, off):
        check(r["completed"] == 6 and r["failed"] == 0, f"{r['layout']}: {r['completed']} completed: {r['errors']}")
        check(r["chat_turns"] == 3 and r["system_prompt_len"] == 40, f"{r['layout']}: chat keys")
    # Turn k's prompt: 40 + k x 10 + (k - 1) x 8 tokens: 50, 68, 86 per conversation.
    check(on["total_input_tokens"] == off["total_input_tokens"] == 2 * (50 + 68 + 86),
          f"input tokens {on['total_input_tokens']} and {off['total_input_tokens']}, expected {2 * (50 + 68 + 86)}")
    check(on["prefix_caching"] is True and off["prefix_caching"] is False, "prefix_caching keys")
    check(on["total_cached_prompt_tokens"] > 2 * 32, f"cached prompt tokens {on['total_cached_prompt_tokens']}")
    check(off["total_cached_prompt_tokens"] == 0, f"cached with caching off: {off['total_cached_prompt_tokens']}")
    print(f"ok: chat load: {on['total_cached_prompt_tokens']} of {on['total_input_tokens']} prompt tokens cached "
          "with prefix caching on, 0 off")


def case_expert_parallel(work):
    """`bench --compare tp2,tp2/ep/gloo` on a mixture-of-experts fixture: both layouts complete; the
    /ep one's coordinator runs with --expert-parallel (its commands.sh), the other's without; the
    /gloo one's workers move tensors over Gloo's TCP (--collectives gloo; their logs say so), the
    other's through shared memory (the default on CPUs)."""
    logs = os.path.join(work, "ep-logs")
    model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models", "qwen3_moe_tf5")
    rc, out, err, sid = run_bench(["--compare", "tp2,tp2/ep/gloo", "--model", model, "--num-requests", "4",
                                   "--concurrency", "2", "--input-len", "8", "--output-len", "8", "--warmup", "0",
                                   "--json", "--log-dir", logs])
    left = leftovers(sid)
    kill_session(sid)
    check(not left, f"processes left behind after bench exited:\n{left}")
    check(rc == 0, f"bench --compare tp2,tp2/ep/gloo exited {rc}\nstderr:\n{err}")
    with open(os.path.join(logs, "tp2_ep_gloo", "commands.sh")) as f:
        commands = f.read()
    check("--expert-parallel" in commands, "the /ep coordinator lacks --expert-parallel")
    check("--collectives gloo" in commands, "the /gloo workers lack --collectives gloo")
    with open(os.path.join(logs, "tp2", "commands.sh")) as f:
        commands = f.read()
    check("--expert-parallel" not in commands, "the tp2 coordinator has --expert-parallel")
    check("--collectives" not in commands, "the tp2 workers have --collectives")
    for layout, transport in (("tp2", "shared memory"), ("tp2_ep_gloo", "Gloo TCP")):
        for rank in (0, 1):
            with open(os.path.join(logs, layout, f"worker-node0-{rank}.log")) as f:
                log = f.read()
            check(f"collectives: TP group: {transport}" in log,
                  f"{layout} worker {rank} does not log 'collectives: TP group: {transport}':\n{log[-2000:]}")
    for r in json.loads(out)["runs"]:
        check(r["completed"] == 4 and r["failed"] == 0, f"{r['layout']}: {r['completed']} completed: {r['errors']}")
    print("ok: tp2,tp2/ep/gloo: the /ep layout's coordinator has --expert-parallel, its workers Gloo's TCP, "
          "tp2's shared memory; both complete")


def case_json_schema(work):
    """--compare tp1,tp1/json,tp1/http/json with the committed schema; a schema that ends too soon."""
    rc, out, err, sid = run_bench(["--compare", "tp1,tp1/json,tp1/http/json", "--num-requests", "4",
                                   "--concurrency", "2", "--input-len", "8", "--output-len", "12", "--warmup", "1",
                                   "--json", "--log-dir", os.path.join(work, "json-logs")])
    left = leftovers(sid)
    kill_session(sid)
    check(not left, f"processes left behind after bench exited:\n{left}")
    check(rc == 0, f"bench --compare tp1,tp1/json,tp1/http/json exited {rc}\nstdout:\n{out}\nstderr:\n{err}")
    free, grpc, http = json.loads(out)["runs"]
    check(free["json_schema"] is None, f"tp1: json_schema {free['json_schema']!r}")
    for r in (grpc, http):
        check(str(r["json_schema"]).endswith(os.path.join("tools", "bench", "bench_schema.json")),
              f"{r['layout']}: json_schema {r['json_schema']!r}")
    check(http["backend"] == "openai", f"tp1/http/json: backend {http['backend']}")
    for r in (free, grpc, http):
        check(r["completed"] == 4 and r["failed"] == 0, f"{r['layout']}: {r['completed']} completed: {r['errors']}")
        check(r["total_output_tokens"] == 48, f"{r['layout']}: {r['total_output_tokens']} output tokens, want 4 x 12")

    short = os.path.join(work, "boolean.json")
    with open(short, "w") as f:
        f.write('{"type": "boolean"}')
    rc, out, err, sid = run_bench(["--compare", "tp1/json", "--json-schema", short, "--num-requests", "2",
                                   "--input-len", "8", "--output-len", "12", "--warmup", "0", "--json",
                                   "--log-dir", os.path.join(work, "json-short-logs")])
    kill_session(sid)
    check(rc == 1, f"bench with a boolean schema exited {rc}, expected 1\n{err}")
    r = json.loads(out)["runs"][0]
    check(r["completed"] == 0 and r["failed"] == 2, f"boolean schema: {r['completed']} completed, {r['failed']} failed")
    message = r["errors"][0]["message"] if r["errors"] else ""
    check("the output ended where the schema allows" in message and "FINISH_REASON_STOP" in message,
          f"boolean schema: unclear error {message!r}")
    print(f"ok: tp1, tp1/json, tp1/http/json: 4/4 each, 48 output tokens each; output tok/s {free['output_tokens_per_s']:.1f}"
          f" / {grpc['output_tokens_per_s']:.1f} / {http['output_tokens_per_s']:.1f}; a boolean schema fails 2/2: "
          f"{message[:80]}...")


def case_json_schema_flags(work):
    not_json = os.path.join(work, "not.json")
    with open(not_json, "w") as f:
        f.write('{"type": ')
    listed = os.path.join(work, "list.json")
    with open(listed, "w") as f:
        f.write('[{"type": "string"}]')
    missing = os.path.join(work, "missing.json")
    good = os.path.join(work, "good.json")
    with open(good, "w") as f:
        f.write('{"type": "array"}')
    cases = [
        (["--json-schema", missing, "--address", "127.0.0.1:1"], f"--json-schema {missing}: cannot open the file"),
        (["--json-schema", not_json, "--address", "127.0.0.1:1"], f"--json-schema {not_json}: is not JSON"),
        (["--compare", "tp1/json", "--json-schema", listed], f"--json-schema {listed}: must be a JSON object"),
        (["--compare", "tp1", "--json-schema", good], "the schema of its /json layouts, and none is given"),
        (["--compare", "tp1/jsn"], "layout 'tp1/jsn' is not"),
    ]
    for args, want in cases:
        rc, out, err, sid = run_bench(args, timeout=30)
        kill_session(sid)
        check(rc == 2 and want in err, f"bench {' '.join(args)}: exit {rc}, wanted 2 and {want!r} in:\n{err}")
    print(f"ok: {len(cases)} bad --json-schema files and combinations refused with exit 2")


def case_http_vs_grpc(work):
    rc, out, err, sid = run_bench(["--compare", "tp1,tp1/http", "--num-requests", "6", "--concurrency", "2",
                                   "--input-len", "8", "--output-len", "8", "--json",
                                   "--log-dir", os.path.join(work, "http-logs")])
    left = leftovers(sid)
    kill_session(sid)
    check(not left, f"processes left behind after bench exited:\n{left}")
    check(rc == 0, f"bench --compare tp1,tp1/http exited {rc}\nstdout:\n{out}\nstderr:\n{err}")
    grpc, http = json.loads(out)["runs"]
    check(grpc["backend"] == "grpc" and http["backend"] == "openai", f"backends {grpc['backend']} {http['backend']}")
    for r in (grpc, http):
        check(r["completed"] == 6 and r["failed"] == 0, f"{r['layout']}: {r['completed']} completed: {r['errors']}")
        check(r["total_output_tokens"] == 48 and r["total_input_tokens"] == 48,
              f"{r['layout']}: tokens in {r['total_input_tokens']} out {r['total_output_tokens']}, expected 48 each")
        check(0 < r["ttft_p50_s"] <= r["ttft_p99_s"], f"{r['layout']}: ttft {r['ttft_p50_s']} {r['ttft_p99_s']}")
    print(f"ok: tp1 over gRPC and over HTTP: 6/6 each, 48 tokens in and out each; output tok/s "
          f"{grpc['output_tokens_per_s']:.1f} vs {http['output_tokens_per_s']:.1f}")


def case_openai_launch(work):
    """--backend openai against `shardserve launch`'s HTTP port; gRPC against the same cluster."""
    log_dir = os.path.join(work, "launch")
    http_port, grpc_port = free_ports(2)
    env = dict(os.environ, SHARDSERVE_STATE_DIR=os.path.join(log_dir, "state"))
    launch = subprocess.Popen([os.path.join(BIN, "shardserve"), "launch", "--metrics-port-base", "0",
                               "--log-dir", log_dir, "--address", f"127.0.0.1:{grpc_port}",
                               "--http-port", str(http_port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{http_port}/v1"
    try:
        deadline = time.monotonic() + scaled(120)
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            check(launch.poll() is None and time.monotonic() < deadline, "launch did not serve /health in 120 s")
            time.sleep(0.25)
        load = ["--num-requests", "4", "--concurrency", "2", "--input-len", "12", "--output-len", "6", "--json"]
        proc = subprocess.run([os.path.join(BIN, "shardserve"), "bench", "--backend", "openai", "--base-url", base,
                               "--vocab-size", "4096", *load], capture_output=True, text=True, timeout=DEADLINE_S)
        check(proc.returncode == 0, f"bench --backend openai exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        http = json.loads(proc.stdout)
        proc = subprocess.run([os.path.join(BIN, "shardserve"), "bench", *load], capture_output=True, text=True,
                              env=env, timeout=DEADLINE_S)
        check(proc.returncode == 0, f"bench over gRPC exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        grpc = json.loads(proc.stdout)
        chats = []
        for output_len in ("8", "16"):
            chat = ["--chat-turns", "3", "--system-prompt-len", "40", "--num-requests", "6", "--concurrency", "2",
                    "--input-len", "10", "--output-len", output_len, "--warmup", "1", "--json"]
            proc = subprocess.run([os.path.join(BIN, "shardserve"), "bench", "--backend", "openai", "--base-url",
                                   base, *chat], capture_output=True, text=True, timeout=DEADLINE_S)
            check(proc.returncode == 0,
                  f"bench --backend openai {' '.join(chat)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
            chats.append(json.loads(proc.stdout))
    finally:
        if launch.poll() is None:
            launch.send_signal(signal.SIGTERM)
        try:
            launch.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.communicate()
    check(http["backend"] == "openai" and http["base_url"] == base and grpc["backend"] == "grpc", "backend keys")
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
        check(http[key] == grpc[key], f"{key}: {http[key]} over HTTP, {grpc[key]} over gRPC")
    check(http["completed"] == 4 and http["total_output_tokens"] == 24 and http["total_input_tokens"] == 48,
          f"HTTP: {http['completed']} completed, {http['total_input_tokens']} in, {http['total_output_tokens']} out")
    check(len(http["model"]) > 0 and http["model"] == grpc["model"], f"model {http['model']!r} vs {grpc['model']!r}")
    print(f"ok: launch's HTTP port and its gRPC API: 4/4 each, 48 tokens in and 24 out each")
    short, long = chats
    for r, out in ((short, 8), (long, 16)):
        check(r["backend"] == "openai" and r["chat_turns"] == 3 and r["system_prompt_len"] == 40, f"chat keys: {r}")
        check(r["completed"] == 6 and r["failed"] == 0, f"chat over HTTP: {r['completed']} completed: {r['errors']}")
        check(r["total_output_tokens"] == 6 * out, f"chat output tokens {r['total_output_tokens']}, want 6 x {out}")
        # At least the words: 3 x 40 system + 10 + 20 + 30 message words per conversation.
        check(r["total_input_tokens"] >= 2 * (3 * 40 + 60), f"chat input tokens {r['total_input_tokens']}")
        # Prefix caching is on (launch's default): the system prompt, then the history, are found.
        check(r["total_cached_prompt_tokens"] > 0, f"no cached prompt tokens: {r}")
    # The same messages with longer answers: more input tokens, since every answer goes back to the
    # server in the next turn's messages.
    check(long["total_input_tokens"] > short["total_input_tokens"],
          f"input tokens {long['total_input_tokens']} with 16-token answers, {short['total_input_tokens']} with 8")
    print(f"ok: chat over HTTP: 6/6 turns twice; input tokens {short['total_input_tokens']} with 8-token answers, "
          f"{long['total_input_tokens']} with 16; cached {short['total_cached_prompt_tokens']}")


def case_openai_nobody_listens():
    base = f"http://127.0.0.1:{free_port()}/v1"
    start = time.monotonic()
    rc, out, err, sid = run_bench(["--backend", "openai", "--base-url", base, "--vocab-size", "100",
                                   "--num-requests", "2"], timeout=30)
    took = time.monotonic() - start
    kill_session(sid)
    check(rc == 1, f"bench --backend openai at {base} (nobody listening) exited {rc}\n{err}")
    check(f"cannot reach {base}/models" in err and "connection refused" in err, f"unclear error:\n{err}")
    check(took < 15, f"took {took:.1f} s to give up")
    print(f"ok: nobody at {base}: exit 1 after {took:.2f} s: {err.strip().splitlines()[-1][:120]}")


def case_bad_flags():
    base = "http://127.0.0.1:1/v1"
    cases = [
        (["--backend", "smoke-signals"], "--backend must be grpc or openai"),
        (["--backend", "openai", "--vocab-size", "100"], "needs --base-url"),
        (["--backend", "openai", "--base-url", base], "needs --vocab-size"),
        (["--backend", "openai", "--base-url", "https://x:1/v1", "--vocab-size", "100"], "https"),
        (["--backend", "openai", "--base-url", "http://127.0.0.1:notaport/v1", "--vocab-size", "100"], "port"),
        (["--backend", "openai", "--base-url", base, "--vocab-size", "1"], "--vocab-size must be"),
        (["--base-url", base], "--base-url applies to --backend openai only"),
        (["--backend", "openai", "--base-url", base, "--chat-turns", "2", "--num-requests", "3"], "multiple of"),
        (["--backend", "openai", "--base-url", base, "--vocab-size", "100", "--address", "x:1"], "--address"),
        (["--backend", "openai", "--base-url", base, "--vocab-size", "100", "--compare", "tp1"], "--compare"),
        (["--compare", "tp1/adaptive"], "/adaptive adapts the guesses of /ngram, /draft, /mtp or /eagle3"),
        (["--compare", "tp1/draft/eagle3"], "/mtp, /eagle3, /adaptive"),
    ]
    for args, want in cases:
        rc, out, err, sid = run_bench(args, timeout=30)
        kill_session(sid)
        check(rc == 2 and want in err, f"bench {' '.join(args)}: exit {rc}, wanted 2 and {want!r} in:\n{err}")
    print(f"ok: {len(cases)} bad flag combinations refused with exit 2")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    BIN = os.path.abspath(sys.argv[1])
    old = "--old-binaries" in sys.argv[2:]
    work = tempfile.mkdtemp(prefix="bench_test.")
    try:
        case_nobody_listens()
        case_openai_nobody_listens()
        case_bad_flags()
        case_compare_tp1(work, old)
        case_interrupt(work, old)
        case_forwarding(work, old)
        if not old:
            case_chat(work)
            case_expert_parallel(work)
            case_http_vs_grpc(work)
            case_json_schema_flags(work)
            case_json_schema(work)
            case_openai_launch(work)
    except SystemExit:
        print(f"logs kept in {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    print("PASS")
