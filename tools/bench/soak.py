#!/usr/bin/env python3
"""The soak test: mixed traffic for a set time against a TP2 x PP2 CPU cluster, a worker SIGKILLed every
few minutes, and checks that nothing was lost, wrong or leaked (docs/security.md, "Soak").

    nice -n 10 .venv-client/bin/python tools/bench/soak.py [--minutes 30] [--kill-every 120] [--clients 3]
        [--bin-dir build-cpu/bin] [--model models/demo] [--json-out FILE] [--log-dir DIR]

(clients/python/setup-env.sh makes .venv-client: grpcio and the stubs.) Not run by CI: it takes minutes.

1. Starts `shardserve launch` (TP=2 x PP=2: --nodes 2 --gpus-per-node 2, plaintext on 127.0.0.1, the
   OpenAI HTTP API and the coordinator's /metrics on free ports, JSON logs, --max-worker-restarts 1000).
2. A pool of requests: prompts made of one of four long shared prefixes and a short suffix of their own
   (so that most of a prompt's KV comes from the prefix cache), each sent as a gRPC Generate (greedy, or
   seeded sampling), an HTTP /v1/completions and an HTTP /v1/chat/completions (greedy), every one with
   ignore_eos and max_tokens from 16 to 40. References: the pool run twice on the undisturbed cluster,
   which must agree.
3. The soak: --clients threads each send one request after another (a pause of --pause seconds between
   them) for --minutes: a pool entry with an action drawn at random: complete it (gRPC streaming; HTTP
   streaming or not), cancel it (gRPC: cancel() after a few tokens), give it a short deadline (gRPC),
   or disconnect (HTTP: close the connection mid-stream, or while a non-streaming answer is awaited).
   Every --kill-every seconds, once the group serves and a client has a request in flight (waited for
   up to KILL_WAIT_S), a random worker holding a slot is SIGKILLed;
   launch restarts it and the group heals (docs/healing.md). A sampler reads every process's RSS and
   thread count (/proc/PID/status) every --sample-every seconds.
4. Checks, each failure named in the exit message:
   - 0 requests lost or wrong: a completed request has max_tokens tokens, a finish reason, and the
     reference's tokens (gRPC) or text (HTTP); a cancelled or deadlined one ends in CANCELLED or
     DEADLINE_EXCEEDED and what it received is a prefix of the reference; any other error is a loss;
   - every kill healed: shardserve_heals_total went up by the number of kills,
     shardserve_heal_requests_failed_total stayed 0;
   - at the end, idle again (waited for up to --settle seconds): shardserve_kv_blocks_used,
     shardserve_requests_running and shardserve_requests_waiting 0, and every process's thread count
     at most its idle count measured after the reference pass (a restarted worker: that of the worker
     it replaced);
   - RSS flat: for every process that lived through the whole soak, the growth of its mean RSS from the
     first quarter of the samples to the last at most --max-rss-growth-mib MiB.

Every process it starts is stopped whatever happens (launch runs in a session of its own: SIGTERM, then
SIGKILL to the session), and a watchdog bounds the whole run. Exit status: 0 when every check passed, 1
otherwise (with a line `soak: FAILED: ...` per failure), 2 on usage.
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "clients", "python", "gen"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "ci"))  # launch_process, ports

import grpc  # noqa: E402
from shardserve.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

import chaos_bench  # noqa: E402
from chaos_bench import slot_holders, wait_serving  # noqa: E402
from launch_process import LaunchProcess, children, metric_sum as metric  # noqa: E402
from ports import free_port, free_port_block  # noqa: E402

WORDS = ("the river ran past the mill and the old stone bridge where children counted boats in the "
         "morning light while merchants argued over the price of wool salt grain and copper").split()
SUFFIXES = ["What happened next?", "Tell it again, shorter.", "Who was there?", "Why did it matter?",
            "Describe the bridge.", "And in the evening?", "What did the merchants sell?", "Finish the story."]

# How long a kill waits, when its time comes, for a client to have a request in flight.
KILL_WAIT_S = 30.0

# The served model's name (the checkpoint directory's base name), set by main().
MODEL_NAME = ""


def log(message):
    print(f"soak: {message}", flush=True)


def proc_status(pid):
    """(rss_kib, threads) of `pid`, or None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    rss = re.search(r"^VmRSS:\s+(\d+)", text, re.M)
    threads = re.search(r"^Threads:\s+(\d+)", text, re.M)
    if not rss or not threads:
        return None  # a zombie
    return int(rss.group(1)), int(threads.group(1))


def processes(launch_pid):
    """{pid: name} of launch and its children; a worker's name is its command line (a restarted worker
    gets the same one, so it names the slot's process across restarts)."""
    out = {launch_pid: "launch"}
    for pid in children(launch_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if not argv:
            continue
        base = os.path.basename(argv[0])
        out[pid] = {"shardserve-coordinator": "coordinator",
                    "shardserve-worker": "worker " + " ".join(argv[1:])}.get(base, base)
    return out


def short(name):
    """A process name for the report: a worker's --node and --metrics-listen port (unique per worker)."""
    if not name.startswith("worker "):
        return name
    argv = name.split()
    node = argv[argv.index("--node") + 1] if "--node" in argv else "?"
    port = argv[argv.index("--metrics-listen") + 1].rsplit(":", 1)[-1] if "--metrics-listen" in argv else "?"
    return f"worker {node} (metrics :{port})"


# ---- metrics ------------------------------------------------------------------------------------

def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


# ---- the pool -----------------------------------------------------------------------------------

def make_pool(seed, prompts):
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(70)) for _ in range(4)]
    pool = []
    for i in range(prompts):
        text = f"{prefixes[i % 4]}. {SUFFIXES[i % len(SUFFIXES)]} ({i})"
        max_tokens = rng.randrange(16, 41)
        pool.append({"api": "grpc", "prompt": text, "max_tokens": max_tokens, "seed": None})
        pool.append({"api": "grpc", "prompt": text, "max_tokens": max_tokens, "seed": i})  # seeded sampling
        pool.append({"api": "completions", "prompt": text, "max_tokens": max_tokens})
        pool.append({"api": "chat", "prompt": text, "max_tokens": max_tokens})
    return pool


class Outcome:
    """What one request ended with: `answer` (token ids or text received), `finish` (set when complete),
    `error` (a status code name or an HTTP error, None when none)."""

    def __init__(self, answer, finish=None, error=None):
        self.answer, self.finish, self.error = answer, finish, error


def grpc_request(entry):
    sampling = inference_pb2.SamplingParams(max_tokens=entry["max_tokens"], ignore_eos=True)
    if entry["seed"] is not None:
        sampling.temperature, sampling.top_p, sampling.seed = 0.8, 0.95, entry["seed"]
    return inference_pb2.GenerateRequest(text=entry["prompt"].encode(), sampling=sampling)


def run_grpc(stub, entry, timeout, cancel_after=None):
    """cancel_after: cancel the call once that many tokens arrived."""
    call = stub.Generate(grpc_request(entry), timeout=timeout)
    tokens, finish = [], None
    try:
        for msg in call:
            tokens += msg.token_ids
            if msg.finish_reason:
                finish = inference_pb2.FinishReason.Name(msg.finish_reason)
            if cancel_after is not None and len(tokens) >= cancel_after and not finish:
                call.cancel()
        return Outcome(tokens, finish)
    except grpc.RpcError as e:
        return Outcome(tokens, None, f"{e.code().name}: {e.details()}")


def http_body(entry, stream):
    body = {"model": MODEL_NAME, "max_tokens": entry["max_tokens"], "temperature": 0, "ignore_eos": True, "stream": stream}
    if entry["api"] == "chat":
        body["messages"] = [{"role": "user", "content": entry["prompt"]}]
    else:
        body["prompt"] = entry["prompt"]
    return json.dumps(body).encode()


def http_path(entry):
    return "/v1/chat/completions" if entry["api"] == "chat" else "/v1/completions"


def choice_text(choice, streamed):
    if "text" in choice:
        return choice["text"] or ""
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


def run_http(port, entry, stream, timeout):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", http_path(entry), http_body(entry, stream), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Outcome("", None, f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}")
        if not stream:
            body = json.loads(resp.read())
            c = body["choices"][0]
            return Outcome(choice_text(c, False), c.get("finish_reason"))
        text, finish, done = "", None, False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return Outcome(text, None, f"stream error: {json.dumps(event['error'])[:300]}")
            for c in event.get("choices", []):
                text += choice_text(c, True)
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
        if not done:
            return Outcome(text, None, "the stream ended without data: [DONE]")
        return Outcome(text, finish)
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        return Outcome("", None, f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def disconnect_http(port, entry, stream, rng):
    """Sends the request and closes the connection: mid-stream after a couple of events, or (not
    streaming) while the answer is awaited. Nothing to check but that the server takes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        body = http_body(entry, stream)
        s.sendall(b"POST " + http_path(entry).encode() + b" HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if stream:
            got = b""
            while got.count(b"data:") < rng.randrange(1, 4):
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        else:
            time.sleep(rng.uniform(0.05, 0.5))
    return Outcome("", None, None)


# ---- the checks ---------------------------------------------------------------------------------

def judge_requests(records, reference, t0):
    """({action: count}, lost, wrong) of the soak's `records` ({"index", "action", "answer", "finish",
    "error", "start"}) against `reference` ({pool index: answer}); `lost` and `wrong` say which and why.
    Lost: ended with an error that is not its own cancellation (grpc cancel: CANCELLED; grpc deadline:
    DEADLINE_EXCEEDED); an HTTP disconnect whose request could not even be sent. Wrong: completed without
    a finish reason or with another answer than the reference, or cancelled after receiving something
    that is not a prefix of the reference."""
    by_action, lost, wrong = {}, [], []
    for r in records:
        by_action[r["action"]] = by_action.get(r["action"], 0) + 1
        ref = reference[r["index"]]
        what = f"{r['action']} of pool entry {r['index']} at t={r['start'] - t0:.1f} s"
        if r["action"].startswith("http disconnect"):
            if r["error"]:
                lost.append(f"{what}: {r['error']}")
            continue
        own_end = {"grpc cancel": "CANCELLED:", "grpc deadline": "DEADLINE_EXCEEDED:"}.get(r["action"])
        expected_stop = bool(r["error"] and own_end and r["error"].startswith(own_end))
        if r["error"] and not expected_stop:
            lost.append(f"{what}: {r['error']}")
        elif expected_stop:
            if ref[:len(r["answer"])] != r["answer"]:
                wrong.append(f"{what}: what it received before it ended is not a prefix of the reference")
        elif not r["finish"]:
            wrong.append(f"{what}: ended without a finish reason")
        elif r["answer"] != ref:
            wrong.append(f"{what}: {'tokens' if r['action'].startswith('grpc') else 'text'} differ from the reference")
    return by_action, lost, wrong


def rss_growth(samples, start, end, every):
    """For every process sampled from `start` (within 2 intervals) to `end` (within 3), at least 8 times:
    its mean RSS over the first quarter of its samples and over the last, and the growth between them.
    `samples`: (time, pid, name, rss_kib, threads); `every`: the sampling interval (s). A process that
    started or ended during the soak (a killed worker, its replacement) is left out."""
    by_pid = {}
    for t, pid, name, kib, _ in samples:
        by_pid.setdefault((pid, name), []).append((t, kib))
    out = []
    for (pid, name), series in sorted(by_pid.items(), key=lambda x: x[0][1]):
        if series[0][0] > start + 2 * every or series[-1][0] < end - 3 * every or len(series) < 8:
            continue
        q = len(series) // 4
        first = sum(k for _, k in series[:q]) / q / 1024
        last = sum(k for _, k in series[-q:]) / q / 1024
        out.append({"process": short(name), "pid": pid, "first_quarter_mib": round(first, 1),
                    "last_quarter_mib": round(last, 1), "growth_mib": round(last - first, 1),
                    "max_mib": round(max(k for _, k in series) / 1024, 1), "samples": len(series)})
    return out


# ---- the run ------------------------------------------------------------------------------------

def on_sigterm(*_):
    raise KeyboardInterrupt("SIGTERM")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    default_bin = os.path.join(ROOT, "build-cpu", "bin")
    if not os.path.isdir(default_bin):
        default_bin = os.path.join(ROOT, "build", "bin")
    p.add_argument("--bin-dir", default=default_bin)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "demo"))
    p.add_argument("--minutes", type=float, default=30, help="length of the soak (default 30)")
    p.add_argument("--kill-every", type=float, default=120, help="seconds between worker kills (default 120)")
    p.add_argument("--clients", type=int, default=3, help="concurrent client threads (default 3)")
    p.add_argument("--pause", type=float, default=0.5, help="seconds each client waits between requests")
    p.add_argument("--prompts", type=int, default=16, help="prompts in the pool (each sent 4 ways)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-every", type=float, default=5, help="seconds between RSS / thread samples")
    p.add_argument("--max-rss-growth-mib", type=float, default=16,
                   help="allowed growth of a process's mean RSS, first quarter to last (MiB)")
    p.add_argument("--settle", type=float, default=60, help="seconds to wait for the idle counts at the end")
    p.add_argument("--heal-timeout", type=float, default=120, help="the coordinator's --heal-timeout-seconds")
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--log-dir", help="launch's logs (default: a new temporary directory, kept)")
    p.add_argument("--json-out")
    args = p.parse_args()
    if args.minutes <= 0 or args.kill_every <= 0 or args.clients < 1 or args.prompts < 1 or args.sample_every <= 0:
        p.error("--minutes, --kill-every, --clients, --prompts and --sample-every must be positive")
    for b in ("shardserve", "shardserve-coordinator", "shardserve-worker"):
        if not os.access(os.path.join(args.bin_dir, b), os.X_OK):
            p.error(f"no {b} in {args.bin_dir}")
    if not os.path.exists(os.path.join(args.model, "config.json")):
        p.error(f"no config.json in {args.model}")
    global MODEL_NAME
    MODEL_NAME = os.path.basename(os.path.normpath(args.model))
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="soak.")
    os.makedirs(log_dir, exist_ok=True)
    request_timeout = 2 * args.heal_timeout + 120
    hard_limit = args.ready_timeout + args.minutes * 60 + 2 * request_timeout + args.settle + 600
    watchdog = threading.Timer(hard_limit, lambda: os.kill(os.getpid(), signal.SIGTERM))
    watchdog.daemon = True
    signal.signal(signal.SIGTERM, on_sigterm)

    metrics_port = free_port_block(5)  # the coordinator's, then the 4 workers'
    http_port = free_port()  # claimed: apart from the block
    cmd = [os.path.join(args.bin_dir, "shardserve"), "launch", "--model", args.model, "--nodes", "2",
           "--gpus-per-node", "2", "--address", "127.0.0.1:0", "--metrics-port-base", str(metrics_port),
           "--http-port", str(http_port), "--insecure", "--log-dir", log_dir, "--log-format", "json",
           "--max-worker-restarts", "1000", "--heal-timeout-seconds", str(int(args.heal_timeout))]
    failures = []
    report = {"command": " ".join(sys.argv), "log_dir": log_dir}
    launch = LaunchProcess(cmd, log_dir)
    report["launch"] = " ".join(cmd)
    try:
        watchdog.start()
        address = launch.wait_ready(args.ready_timeout)
        stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(address))
        log(f"cluster ready at {address} (TP=2 x PP=2), HTTP :{http_port}, metrics :{metrics_port}; logs in {log_dir}")

        pool = make_pool(args.seed, args.prompts)

        def run_complete(entry, rng):
            if entry["api"] == "grpc":
                return run_grpc(stub, entry, request_timeout)
            return run_http(http_port, entry, rng.random() < 0.5, request_timeout)

        def reference_pass():
            results, errors, lock, nxt = {}, [], threading.Lock(), [0]

            def worker():
                rng = random.Random()
                while True:
                    with lock:
                        i = nxt[0]
                        nxt[0] += 1
                    if i >= len(pool):
                        return
                    o = run_complete(pool[i], rng)
                    with lock:
                        if o.error or not o.finish:
                            errors.append(f"{pool[i]['api']} request {i}: {o.error or 'no finish reason'}")
                        results[i] = o.answer
            threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(args.clients, 4))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(request_timeout + 30)
            if errors:
                raise RuntimeError("the undisturbed reference pass failed: " + "; ".join(errors[:5]))
            return results

        t0 = time.time()
        reference = reference_pass()
        again = reference_pass()
        undisturbed = [i for i in reference if reference[i] != again[i]]
        log(f"references: {len(pool)} requests in {time.time() - t0:.1f} s (twice); the second pass differs in "
            f"{len(undisturbed)}")
        if undisturbed:
            failures.append(f"the two undisturbed reference passes differ in {len(undisturbed)} requests "
                            f"(e.g. {pool[undisturbed[0]]['api']} request {undisturbed[0]})")
        for i, e in enumerate(pool):
            if e["api"] == "grpc" and len(reference[i]) != e["max_tokens"]:
                failures.append(f"reference {i}: {len(reference[i])} tokens, not max_tokens {e['max_tokens']}")

        # Idle counts: after the reference passes (every pool and cache has been used), once quiet: the
        # most of 5 samples a second apart (a gRPC server's pollers come and go by one or two).
        time.sleep(3)
        idle_threads = {}
        for _ in range(5):
            for pid, name in processes(launch.pid).items():
                st = proc_status(pid)
                if st:
                    idle_threads[name] = max(idle_threads.get(name, 0), st[1])
            time.sleep(1)
        before = scrape(metrics_port)
        heals_before = metric(before, "shardserve_heals_total")
        failed_before = metric(before, "shardserve_heal_requests_failed_total")
        log("idle threads: " + ", ".join(f"{short(n)} {c}" for n, c in sorted(idle_threads.items())))

        # ---- the soak ----
        records, samples, kills = [], [], []
        lock = threading.Lock()
        stop = threading.Event()
        counter = [0]
        active = [0]  # requests the clients have started and not yet recorded (under lock)

        def client(k):
            rng = random.Random(args.seed * 1000 + k)
            while not stop.is_set():
                i = rng.randrange(len(pool))
                entry = pool[i]
                r = rng.random()
                with lock:  # so that a kill made under the lock while active[0] > 0 lies within a record
                    start = time.time()
                    active[0] += 1
                if entry["api"] == "grpc":
                    if r < 0.6:
                        action, o = "grpc stream", run_grpc(stub, entry, request_timeout)
                    elif r < 0.85:
                        action = "grpc cancel"
                        o = run_grpc(stub, entry, request_timeout, cancel_after=rng.randrange(1, entry["max_tokens"]))
                    else:
                        action, o = "grpc deadline", run_grpc(stub, entry, rng.uniform(0.2, 2.0))
                else:
                    stream = rng.random() < 0.5
                    if r < 0.75:
                        action, o = f"http {'stream' if stream else 'unary'}", run_http(http_port, entry, stream,
                                                                                       request_timeout)
                    else:
                        action = f"http disconnect {'mid-stream' if stream else 'waiting'}"
                        try:
                            o = disconnect_http(http_port, entry, stream, rng)
                        except OSError as e:
                            o = Outcome("", None, f"{type(e).__name__}: {e}")
                with lock:
                    counter[0] += 1
                    active[0] -= 1
                    records.append({"index": i, "action": action, "answer": o.answer, "finish": o.finish,
                                    "error": o.error, "start": start, "end": time.time()})
                stop.wait(args.pause)

        def sampler():
            while not stop.is_set():
                now = time.time()
                for pid, name in processes(launch.pid).items():
                    st = proc_status(pid)
                    if st:
                        samples.append((now, pid, name, st[0], st[1]))
                stop.wait(args.sample_every)

        rng = random.Random(args.seed)
        soak_start = time.time()
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
        threads.append(threading.Thread(target=sampler, daemon=True))
        for t in threads:
            t.start()
        next_kill = soak_start + args.kill_every
        next_note = soak_start + 60
        end = soak_start + args.minutes * 60
        while time.time() < end:
            now = time.time()
            if now >= next_note:
                log(f"t={now - soak_start:6.0f} s: {counter[0]} requests, {len(kills)} kills")
                next_note += 60
            if now < next_kill:
                time.sleep(0.2)
                continue
            if not wait_serving(stub, args.heal_timeout):
                failures.append(f"the group did not serve again within {args.heal_timeout:.0f} s after kill {len(kills)}")
                break
            holders = slot_holders(stub, launch.pid)
            if not holders:
                failures.append("no worker process holding a slot was found to kill")
                break
            pid = rng.choice(sorted(holders))
            # The kill should find requests in flight (the check below): with a few clients and pauses
            # between their requests, a moment with none comes now and then.
            waited_until = time.time() + KILL_WAIT_S
            while True:
                with lock:
                    if active[0] > 0 or time.time() >= waited_until:
                        os.kill(pid, signal.SIGKILL)
                        kills.append({"time": time.time(), "t": round(time.time() - soak_start, 1), "pid": pid,
                                      "slot": holders[pid]})
                        break
                time.sleep(0.01)
            log(f"t={time.time() - soak_start:6.0f} s: SIGKILL worker pid {pid} ({holders[pid]})")
            next_kill = time.time() + args.kill_every
        if kills and not wait_serving(stub, args.heal_timeout):
            failures.append(f"the group did not serve again within {args.heal_timeout:.0f} s after the last kill")
        stop.set()
        for t in threads:
            t.join(request_timeout + 30)
        if any(t.is_alive() for t in threads):
            failures.append(f"{sum(t.is_alive() for t in threads)} client threads still running after the soak")
        soak_end = time.time()
        soak_seconds = soak_end - soak_start

        # ---- requests: lost or wrong ----
        by_action, lost, wrong = judge_requests(records, reference, soak_start)
        log(f"requests: {len(records)} in {soak_seconds:.0f} s ({len(records) / soak_seconds:.2f}/s): " +
            ", ".join(f"{a} {n}" for a, n in sorted(by_action.items())) + f"; lost {len(lost)}, wrong {len(wrong)}")
        failures += [f"request lost: {x}" for x in lost[:10]] + [f"request wrong: {x}" for x in wrong[:10]]
        if len(lost) + len(wrong) > 20:
            failures.append(f"... {len(lost) + len(wrong) - 20} more lost or wrong requests")

        in_flight = [sum(1 for r in records if r["start"] < k["time"] < r["end"]) for k in kills]
        if kills:
            log(f"requests in flight at each kill: {in_flight}")
        if any(n == 0 for n in in_flight):
            failures.append(f"a kill found no request in flight (in flight at each kill: {in_flight})")

        # ---- heals ----
        text = scrape(metrics_port)
        queried = metric(text, "shardserve_prefix_cache_queries_tokens_total")
        hit_rate = metric(text, "shardserve_prefix_cache_hits_tokens_total") / queried if queried else 0.0
        server_side = {"http 499": metric(text, "shardserve_http_requests_total", status="499"),
                       "grpc CANCELLED": metric(text, "shardserve_requests_total", code="CANCELLED"),
                       "grpc DEADLINE_EXCEEDED": metric(text, "shardserve_requests_total", code="DEADLINE_EXCEEDED")}
        log(f"prefix cache hit rate {hit_rate:.1%}; the coordinator counted " +
            ", ".join(f"{k} {v:.0f}" for k, v in server_side.items()))
        if hit_rate == 0:
            failures.append("no prefix cache hit")
        heals = metric(text, "shardserve_heals_total") - heals_before
        heal_failed = metric(text, "shardserve_heal_requests_failed_total") - failed_before
        resumed = metric(text, "shardserve_heal_requests_resumed_total")
        log(f"kills {len(kills)}, heals {heals:.0f}, requests resumed through heals {resumed:.0f}, "
            f"failed by heals {heal_failed:.0f}")
        if heals != len(kills):
            failures.append(f"{len(kills)} workers killed but shardserve_heals_total went up by {heals:.0f}")
        if heal_failed:
            failures.append(f"shardserve_heal_requests_failed_total went up by {heal_failed:.0f}")

        # ---- idle again ----
        deadline = time.time() + args.settle
        while True:
            text = scrape(metrics_port)
            gauges = {g: metric(text, g) for g in ("shardserve_kv_blocks_used", "shardserve_requests_running",
                                                    "shardserve_requests_waiting")}
            end_threads = {}
            for pid, name in processes(launch.pid).items():
                st = proc_status(pid)
                if st:
                    end_threads[name] = st[1]
            over = {n: (c, idle_threads.get(n)) for n, c in end_threads.items()
                    if idle_threads.get(n) is None or c > idle_threads[n]}
            if (not any(gauges.values()) and not over) or time.time() > deadline:
                break
            time.sleep(1)
        log("at the end: " + ", ".join(f"{g} {v:.0f}" for g, v in gauges.items()) + "; threads " +
            ", ".join(f"{short(n)} {c} (idle {idle_threads.get(n, '?')})" for n, c in sorted(end_threads.items())))
        for g, v in gauges.items():
            if v:
                failures.append(f"{g} is {v:.0f} after {args.settle:.0f} s idle, not 0")
        for n, (c, idle) in sorted(over.items()):
            failures.append(f"{short(n)} has {c} threads {args.settle:.0f} s after the soak; idle count "
                            f"{'unknown (a process not there when idle)' if idle is None else idle}")
        if set(end_threads) != set(idle_threads):
            failures.append("the processes at the end are not those at the start: " +
                            f"{sorted(map(short, set(idle_threads) ^ set(end_threads)))}")

        # ---- RSS ----
        rss = rss_growth(samples, soak_start, soak_end, args.sample_every)
        for r in rss:
            log(f"RSS {r['process']} (pid {r['pid']}): first quarter {r['first_quarter_mib']} MiB, last quarter "
                f"{r['last_quarter_mib']} MiB, growth {r['growth_mib']:+.1f} MiB, max {r['max_mib']} MiB")
            if r["growth_mib"] > args.max_rss_growth_mib:
                failures.append(f"RSS of {r['process']} grew {r['growth_mib']:.1f} MiB from the first quarter of the "
                                f"soak to the last (allowed {args.max_rss_growth_mib} MiB)")
        if not rss:
            failures.append("no process lived through the whole soak with 8 RSS samples or more (a soak shorter than "
                            "8 x --sample-every is too short to say whether RSS is flat)")
        report.update({"minutes": args.minutes, "soak_seconds": round(soak_seconds, 1), "clients": args.clients,
                       "pause_s": args.pause, "requests": len(records), "by_action": by_action,
                       "requests_per_second": round(len(records) / soak_seconds, 2), "lost": lost, "wrong": wrong,
                       "kills": kills, "in_flight_at_kills": in_flight, "heals": heals,
                       "prefix_cache_hit_rate": round(hit_rate, 3), "server_side": server_side, "resumed": resumed, "gauges_at_end": gauges,
                       "idle_threads": {short(n): c for n, c in idle_threads.items()},
                       "end_threads": {short(n): c for n, c in end_threads.items()}, "rss": rss,
                       "rss_samples_mib": [[round(t - soak_start, 1), pid, short(n), round(kib / 1024, 1)]
                                           for t, pid, n, kib, _ in samples]})
    except KeyboardInterrupt as e:
        failures.append(f"interrupted ({e})")
    except Exception as e:  # noqa: BLE001 - reported, and launch is stopped below
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        watchdog.cancel()
        launch.stop()
    left = [pid for pid in children(launch.pid)]
    if left:
        failures.append(f"processes left after stopping launch: {left}")
    report["failures"] = failures
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    for f in failures:
        log(f"FAILED: {f}")
    log("PASSED" if not failures else f"FAILED ({len(failures)} checks; logs in {log_dir})")
    return 0 if not failures else 1


if __name__ == "__main__":
    chaos_bench.TIME_SCALE = 1.0
    sys.exit(main())
