#!/usr/bin/env python3
"""The chaos benchmark: does a healing cluster lose requests or change their tokens? (issue 27)

    .venv-client/bin/python tools/bench/chaos_bench.py [--bin-dir build/bin] [--model build/bench-model]
        [--nodes 2 --gpus-per-node 2] [--spare-workers N] [--streams 16] [--duration 120]
        [--kill-every 15] [--max-kills K] [--json-out FILE] [--log-dir DIR]

(clients/python/setup-env.sh makes .venv-client: grpcio and the stubs.)

1. Starts `shardserve launch` (plaintext on loopback, JSON logs, --max-worker-restarts 1000, with
   --spare-workers N when given) and waits until it is ready.
2. A pool of --num-prompts requests (random token-id prompts from --seed, --output-len tokens each,
   ignore_eos; even ones greedy, odd ones seeded sampling: temperature 0.8, top-p 0.95, seed = index).
   References: every request of the pool run twice on the undisturbed cluster, --streams at a time.
   The two undisturbed runs must agree (else the comparison below would mean nothing: reported as
   "undisturbed_mismatches").
3. Chaos: --streams threads send the pool's requests round and round for --duration seconds while a
   killer SIGKILLs a random worker that holds a slot every --kill-every seconds (after waiting, up to
   --heal-timeout seconds, for the group to serve again, so that each heal is measured on its own);
   launch restarts it (with spares: a spare takes the slot at once and the restarted process
   comes back as a spare).
4. Report (JSON to --json-out, a markdown table to stdout):
   - requests completed / lost (ended with an error: target 0) / differing (completed, but tokens
     not those of the undisturbed run: target 0), and the requests that were streaming at a kill;
   - the deaths launch logged: each killed worker must have died once, by the signal sent (SIGKILL),
     and no other process at all (a worker or coordinator that crashed and that launch restarted is
     not a heal); each kill must have had a request streaming through it (a token before the kill,
     its end after: the killer waits for one before it kills);
   - the coordinator's heal metrics at the end, by value: shardserve_heals_total and
     shardserve_heal_duration_seconds_count one per kill, shardserve_heal_requests_resumed_total at
     least one per kill, shardserve_heal_requests_failed_total 0, shardserve_cluster_state serving;
   - per kill, the heal time: from the SIGKILL to the first token any stream received after the
     coordinator logged "healed in" (the first resumed token); p50 and max;
   - per kill, its phases from the log timestamps (ms, wall clock, as the client's clock):
     detection (kill -> the coordinator's "LOST"), replacement (LOST -> the replacement registered
     for the slot, or a spare took it: includes launch's restart backoff and the process start),
     rejoin (-> "re-forming": survivors settled), load (-> "healed in": groups joined and the shard
     loaded), resume (-> the first resumed token: the recompute prefill of the held requests).

Bounded in time: every RPC has a deadline, the whole run a hard limit; launch runs in a session of
its own and is stopped (SIGTERM, then SIGKILL to its process group) whatever happens. Every deadline
(--ready-timeout, --heal-timeout, which the coordinator gets too, the RPCs' and the hard limit) is
multiplied by SHARDSERVE_TEST_TIME_SCALE (tools/ci/launch_process.py's time_scale(): slow, instrumented
builds); --duration and --kill-every are not deadlines and stay as given.
Exit status: 0 when no request was lost or differed, every kill healed with a request streaming
through it, and the only deaths were the kills, each by its signal; 1 otherwise, 2 on usage.
"""
import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "clients", "python", "gen"))

import grpc  # noqa: E402
from shardserve.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "ci"))  # launch_process
from launch_process import LaunchProcess, children, scrape_heal_metrics, time_scale  # noqa: E402

# SHARDSERVE_TEST_TIME_SCALE, set by main() before any deadline is used.
TIME_SCALE = 1.0


def log(message):
    print(f"chaos_bench: {message}", flush=True)


# ---- launch and its processes -------------------------------------------------------------------

# launch's flags the benchmark sets itself, with the benchmark's own flag for each where it has one:
# given again by --launch-flag, launch would take the later value while the report says the earlier.
OWN_LAUNCH_FLAGS = {"--model": "--model", "--nodes": "--nodes", "--gpus-per-node": "--gpus-per-node",
                    "--spare-workers": "--spare-workers", "--heal-timeout-seconds": "--heal-timeout",
                    "--log-dir": "--log-dir", "--address": None, "--metrics-port-base": None, "--http-port": None,
                    "--insecure": None, "--log-format": None, "--max-worker-restarts": None}


def launch_flag_errors(launch_flags):
    """What is wrong with the --launch-flag arguments: one line for each that names a flag of launch's
    the benchmark sets itself (OWN_LAUNCH_FLAGS), saying which of its own flags to use instead."""
    errors = []
    for flag in launch_flags:
        name = flag.split("=", 1)[0]
        if name in OWN_LAUNCH_FLAGS:
            own = OWN_LAUNCH_FLAGS[name]
            errors.append(f"--launch-flag={flag}: chaos_bench sets launch's {name} itself"
                          + (f"; give chaos_bench's {own}" if own else ""))
    return errors


class Launch(LaunchProcess):
    """`shardserve launch` of the benchmark's cluster, in a session of its own (tools/ci/launch_process.py)."""

    def __init__(self, args, log_dir):
        cmd = [os.path.join(args.bin_dir, "shardserve"), "launch", "--model", args.model, "--nodes", str(args.nodes),
               "--gpus-per-node", str(args.gpus_per_node), "--address", "127.0.0.1:0", "--metrics-port-base", "0",
               "--http-port", "0", "--insecure", "--log-dir", log_dir, "--log-format", "json",
               "--max-worker-restarts", "1000", "--heal-timeout-seconds", str(math.ceil(args.heal_timeout)),
               "--spare-workers", str(args.spare_workers)] + args.launch_flags
        super().__init__(cmd, log_dir)


def listening_ports(pid):
    """The TCP ports `pid` listens on (its socket inodes matched against /proc/net/tcp{,6})."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return ports


def status(stub):
    return stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=10 * TIME_SCALE)


def slot_holders(stub, launch_pid):
    """{pid: "stage S tp rank R"} of the live worker processes that hold a slot."""
    by_port = {}
    for w in status(stub).workers:
        if w.stage < 0 or w.state == inference_pb2.WORKER_STATE_LOST or not w.address:
            continue
        by_port[int(w.address.rsplit(":", 1)[1])] = f"stage {w.stage} tp rank {w.tp_rank}"
    out = {}
    for pid in children(launch_pid):
        for port in listening_ports(pid):
            if port in by_port:
                out[pid] = by_port[port]
    return out


def wait_serving(stub, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if status(stub).state == "serving":
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    return False


# ---- requests -------------------------------------------------------------------------------------

def make_pool(args, vocab):
    rng = random.Random(args.seed)
    pool = []
    for i in range(args.num_prompts):
        prompt = [rng.randrange(1, vocab) for _ in range(args.input_len)]
        sampling = inference_pb2.SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        if i % 2 == 1:
            sampling.temperature = 0.8
            sampling.top_p = 0.95
            sampling.seed = i
        pool.append(inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt), sampling=sampling))
    return pool


def run_one(stub, request, timeout, on_tokens=None):
    """(ok, tokens, token arrival times, error, start time). on_tokens(n) after each message: the
    tokens received so far."""
    start = time.time()
    tokens, times = [], []
    try:
        for msg in stub.Generate(request, timeout=timeout):
            now = time.time()
            for t in msg.token_ids:
                tokens.append(t)
                times.append(now)
            if on_tokens:
                on_tokens(len(tokens))
        return True, tokens, times, "", start
    except grpc.RpcError as e:
        return False, tokens, times, f"{e.code().name}: {e.details()}", start


def run_pool_once(stub, pool, streams, timeout):
    """Every request of the pool, `streams` at a time: {index: tokens}; raises on any failure."""
    results, errors = {}, []
    lock = threading.Lock()
    next_index = [0]

    def worker():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(pool):
                return
            ok, tokens, _, error, _ = run_one(stub, pool[i], timeout)
            with lock:
                if ok:
                    results[i] = tokens
                else:
                    errors.append(f"request {i}: {error}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("the undisturbed run failed: " + "; ".join(errors[:5]))
    return results


# ---- the coordinator's log ------------------------------------------------------------------------

def read_events(log_dir):
    """(time, subject, message) of every JSON line of coordinator.log, by time."""
    events = []
    try:
        with open(os.path.join(log_dir, "coordinator.log"), errors="replace") as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                try:
                    e = json.loads(line)
                    t = datetime.strptime(e["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
                except (ValueError, KeyError):
                    continue
                events.append((t, e.get("subject", ""), e.get("message", "")))
    except OSError:
        pass
    events.sort(key=lambda e: e[0])
    return events


def read_deaths(output):
    """[(name, pid, how)] of every process launch saw end in its `output` ("shardserve launch: worker
    node0/1 (pid 123) killed by signal 9 (Killed); last lines of ..."), in order. A process started
    as a spare keeps that name when it has taken a slot ("spare node0/0 (pid 124) ...")."""
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in
            re.finditer(r"^shardserve launch: (coordinator|worker \S+|spare \S+) \(pid (\d+)\) (.+?); last lines of ",
                        output, re.M)]


def check_deaths(kills, deaths, sig):
    """The problems with `deaths` (read_deaths) for `kills`: every killed pid must have died once, by
    `sig`, and no other process may have died (a crash that launch restarted is not a heal)."""
    problems = []
    killed = {k["pid"] for k in kills if "pid" in k}
    for k in kills:
        if "pid" not in k:
            continue
        ends = [how for _, pid, how in deaths if pid == k["pid"]]
        if len(ends) != 1:
            problems.append(f"worker pid {k['pid']} ({k['slot']}), killed, ended {len(ends)} times in launch's log")
        elif not re.fullmatch(rf"killed by signal {int(sig)} \(.*\)", ends[0]):
            problems.append(f"worker pid {k['pid']} ({k['slot']}) was sent {sig.name} but {ends[0]}")
    for name, pid, how in deaths:
        if pid not in killed:
            problems.append(f"{name} (pid {pid}) {how}, not killed by the benchmark")
    return problems


def check_heal_metrics(metrics, kills):
    """The problems with the coordinator's heal metrics after `kills` kills, each healed with a request
    streaming through it: one heal and one duration per kill, a resumed request at least per kill,
    none failed, the cluster serving."""
    problems = []
    for name, want in (("shardserve_heals_total", kills), ("shardserve_heal_duration_seconds_count", kills),
                       ("shardserve_heal_requests_failed_total", 0)):
        if metrics[name] != want:
            problems.append(f"{name} is {metrics[name]:g}, expected {want}")
    if metrics["shardserve_heal_requests_resumed_total"] < kills:
        problems.append(f"shardserve_heal_requests_resumed_total is "
                        f"{metrics['shardserve_heal_requests_resumed_total']:g}, expected at least {kills} (one per kill)")
    if metrics["state"] != "serving":
        problems.append(f"the cluster state is {metrics['state']}, expected serving")
    return problems


def first_after(events, t, pattern):
    for when, subject, message in events:
        if when >= t and re.search(pattern, f"{subject}: {message}"):
            return when
    return None


def on_sigterm(*_):
    raise KeyboardInterrupt("SIGTERM")


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# ---- the run --------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", default=os.path.join(ROOT, "build", "bin"))
    p.add_argument("--model", default=os.path.join(ROOT, "build", "bench-model"))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--spare-workers", type=int, default=0)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--duration", type=float, default=120, help="seconds of chaos (default 120)")
    p.add_argument("--kill-every", type=float, default=15, help="seconds between kills (default 15)")
    p.add_argument("--max-kills", type=int, default=0, help="stop killing after K kills (0: no limit)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--seed", type=int, default=0, help="prompts and which worker is killed")
    p.add_argument("--heal-timeout", type=float, default=120, help="the coordinator's --heal-timeout-seconds")
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--log-dir", help="launch's logs (default: a new temporary directory, kept)")
    p.add_argument("--json-out")
    p.add_argument("--launch-flag", dest="launch_flags", action="append", default=[],
                   help="one more argument for launch (repeat: --launch-flag=--worker-threads --launch-flag=1)")
    args = p.parse_args()
    if args.streams < 1 or args.duration <= 0 or args.kill_every <= 0 or args.num_prompts < 1:
        p.error("--streams, --duration, --kill-every and --num-prompts must be positive")
    if errors := launch_flag_errors(args.launch_flags):
        p.error("; ".join(errors))
    global TIME_SCALE
    try:
        TIME_SCALE = time_scale()
    except ValueError as e:
        p.error(str(e))
    args.ready_timeout *= TIME_SCALE
    args.heal_timeout *= TIME_SCALE
    for b in ("shardserve", "shardserve-coordinator", "shardserve-worker"):
        if not os.access(os.path.join(args.bin_dir, b), os.X_OK):
            p.error(f"no {b} in {args.bin_dir}")
    if not os.path.exists(os.path.join(args.model, "config.json")):
        p.error(f"no config.json in {args.model} (tools/fixtures/make_bench_model.py makes the bench model)")
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="chaos_bench.")
    os.makedirs(log_dir, exist_ok=True)
    # Every wait below is bounded; this is the bound of the whole run, whatever hangs.
    hard_limit = args.ready_timeout + 3 * args.duration + 4 * args.heal_timeout + 600 * TIME_SCALE
    watchdog = threading.Timer(hard_limit, lambda: os.kill(os.getpid(), signal.SIGTERM))
    watchdog.daemon = True
    signal.signal(signal.SIGTERM, on_sigterm)

    launch = Launch(args, log_dir)
    report = {"command": " ".join(sys.argv), "launch": " ".join(launch.command), "log_dir": log_dir}
    ok = False
    try:
        watchdog.start()
        address = launch.wait_ready(args.ready_timeout)
        channel = grpc.insecure_channel(address)
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        log(f"cluster ready at {address} (TP={args.gpus_per_node} x PP={args.nodes}, {args.spare_workers} spare(s)); "
            f"logs in {log_dir}")
        request_timeout = args.heal_timeout * 2 + 300 * TIME_SCALE
        pool = make_pool(args, vocab)
        t0 = time.time()
        reference = run_pool_once(stub, pool, args.streams, request_timeout)
        reference_seconds = time.time() - t0
        again = run_pool_once(stub, pool, args.streams, request_timeout)
        undisturbed_mismatches = sum(1 for i in reference if reference[i] != again[i])
        log(f"references: {len(pool)} requests in {reference_seconds:.1f} s; the second undisturbed run differs "
            f"in {undisturbed_mismatches}")

        # ---- chaos ----
        records, kills = [], []
        lock = threading.Lock()
        stop = threading.Event()
        counter = [0]
        received = {}  # streamer thread -> tokens its current request has received

        def streamer():
            me = threading.get_ident()
            while not stop.is_set():
                with lock:
                    i = counter[0] % len(pool)
                    counter[0] += 1
                    received[me] = 0
                ok_, tokens, times, error, start = run_one(stub, pool[i], request_timeout,
                                                           lambda n: received.__setitem__(me, n))
                with lock:
                    received[me] = 0
                    records.append({"index": i, "ok": ok_, "tokens": tokens, "times": times, "error": error,
                                    "start": start, "end": time.time()})

        def some_request_streaming():
            with lock:
                return any(n > 0 for n in received.values())

        rng = random.Random(args.seed)
        chaos_start = time.time()
        threads = [threading.Thread(target=streamer, daemon=True) for _ in range(args.streams)]
        for t in threads:
            t.start()
        next_kill = chaos_start + args.kill_every
        while time.time() < chaos_start + args.duration:
            if time.time() < next_kill or (args.max_kills and len(kills) >= args.max_kills):
                time.sleep(0.1)
                continue
            if not wait_serving(stub, args.heal_timeout):
                log("the group did not serve again within --heal-timeout; no more kills")
                kills.append({"error": "not serving before the next kill"})
                break
            holders = slot_holders(stub, launch.proc.pid)
            if not holders:
                log("no worker process holding a slot was found; no kill")
                next_kill = time.time() + args.kill_every
                continue
            # A kill is a test of healing only with a request streaming through it (bounded wait).
            deadline = time.time() + args.heal_timeout
            while not some_request_streaming() and time.time() < deadline:
                time.sleep(0.01)
            pid = rng.choice(sorted(holders))
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            kills.append({"time": t_kill, "pid": pid, "slot": holders[pid], "signal": "SIGKILL"})
            log(f"t={t_kill - chaos_start:5.1f} s: SIGKILL worker pid {pid} ({holders[pid]})")
            next_kill = t_kill + args.kill_every
        # The last heal ends inside the run: the streams go on until the group serves again (bounded)
        # and a moment longer, so that the first resumed token is seen.
        if kills and not wait_serving(stub, args.heal_timeout):
            log("the group did not serve again after the last kill within --heal-timeout")
        time.sleep(2)
        chaos_seconds = time.time() - chaos_start
        stop.set()
        for t in threads:
            t.join(timeout=request_timeout + 30)
        hung = sum(1 for t in threads if t.is_alive())

        # ---- the figures ----
        events = read_events(log_dir)
        token_times = sorted(t for r in records for t in r["times"])
        heals = []
        for k in kills:
            if "time" not in k:
                continue
            t = k["time"]
            lost = first_after(events, t, r"LOST \(epoch")
            replaced = first_after(events, t, r"as the replacement for slot|spare takes slot")
            reform = first_after(events, replaced or t, r"re-forming: epoch")
            healed = first_after(events, t, r"healed in")
            resumed = next((x for x in token_times if healed is not None and x >= healed), None)
            # Requests that had streamed a token before the kill and ended after it.
            streaming = sum(1 for r in records if r["times"] and r["times"][0] < t < r["end"])
            h = {"slot": k["slot"], "pid": k["pid"], "at_s": round(t - chaos_start, 3), "streaming": streaming}
            for name, a, b in (("detection_s", t, lost), ("replacement_s", lost, replaced),
                               ("rejoin_s", replaced, reform), ("load_s", reform, healed),
                               ("resume_s", healed, resumed), ("heal_s", t, resumed)):
                h[name] = round(b - a, 3) if a is not None and b is not None else None
            k.update(h)
            heals.append(h)
        completed = [r for r in records if r["ok"]]
        lost_requests = [r for r in records if not r["ok"]]
        differing = [r for r in completed if r["tokens"] != reference[r["index"]]]
        disturbed = [r for r in records if any(r["start"] < k.get("time", -1) < r["end"] for k in kills)]
        deaths = read_deaths(launch.output())
        death_problems = check_deaths(kills, deaths, signal.SIGKILL)
        kills_unstreamed = [h["at_s"] for h in heals if h["streaming"] == 0]
        heal_metrics = scrape_heal_metrics(log_dir)
        metric_problems = check_heal_metrics(heal_metrics, len([k for k in kills if "time" in k]))
        heal_times = [h["heal_s"] for h in heals if h["heal_s"] is not None]
        phase_names = ("detection_s", "replacement_s", "rejoin_s", "load_s", "resume_s")
        phases = {n: statistics.median([h[n] for h in heals if h[n] is not None])
                  for n in phase_names if any(h[n] is not None for h in heals)}
        report.update({
            "layout": f"TP={args.gpus_per_node} x PP={args.nodes}", "spare_workers": args.spare_workers,
            "streams": args.streams, "duration_s": round(chaos_seconds, 1), "kill_every_s": args.kill_every,
            "time_scale": TIME_SCALE,
            "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
            "pool": len(pool), "reference_seconds": round(reference_seconds, 1),
            "undisturbed_mismatches": undisturbed_mismatches,
            "requests_completed": len(completed), "requests_lost": len(lost_requests),
            "requests_differing": len(differing), "requests_streaming_at_a_kill": len(disturbed),
            "threads_hung": hung, "tokens": sum(len(r["tokens"]) for r in completed),
            "kills": len([k for k in kills if "time" in k]), "heals_measured": len(heal_times),
            "deaths": [{"process": n, "pid": pid, "how": how} for n, pid, how in deaths],
            "death_problems": death_problems, "kills_without_a_streaming_request_at": kills_unstreamed,
            "heal_metrics": heal_metrics, "heal_metric_problems": metric_problems,
            "heal_p50_s": percentile(heal_times, 0.5), "heal_max_s": max(heal_times) if heal_times else None,
            "phase_median_s": phases, "heals": heals,
            "lost_errors": [r["error"] for r in lost_requests][:20],
            "differing_requests": [{"index": r["index"], "first_difference": next(
                (j for j, (a, b) in enumerate(zip(r["tokens"], reference[r["index"]])) if a != b),
                min(len(r["tokens"]), len(reference[r["index"]])))} for r in differing][:20],
        })
        ok = (not lost_requests and not differing and not hung and undisturbed_mismatches == 0 and
              report["kills"] > 0 and len(heal_times) == report["kills"] and not death_problems and
              not kills_unstreamed and not metric_problems)
        report["passed"] = ok
    except KeyboardInterrupt as e:
        report["error"] = f"interrupted ({e})"
    except Exception as e:  # noqa: BLE001 - reported, and launch is stopped below
        report["error"] = str(e)
    finally:
        watchdog.cancel()
        launch.stop()

    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    if "error" in report:
        log(f"FAILED: {report['error']}")
        return 1
    print_table(report)
    return 0 if ok else 1


def fmt(v):
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def print_table(r):
    print(f"\n### Chaos: {r['layout']}, {r['spare_workers']} spare(s), {r['streams']} streams, {r['duration_s']} s, "
          f"a worker SIGKILLed every {r['kill_every_s']} s\n")
    print("| completed | lost | differing | streaming at a kill | kills | heal p50 (s) | heal max (s) | "
          "undisturbed runs differ |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {r['requests_completed']} | {r['requests_lost']} | {r['requests_differing']} | "
          f"{r['requests_streaming_at_a_kill']} | {r['kills']} | {fmt(r['heal_p50_s'])} | {fmt(r['heal_max_s'])} | "
          f"{r['undisturbed_mismatches']} |")
    print("\n| kill at (s) | slot | streaming | detection | replacement | rejoin | load | resume | heal (s) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for h in r["heals"]:
        print(f"| {h['at_s']:.1f} | {h['slot']} | {h['streaming']} | {fmt(h['detection_s'])} | "
              f"{fmt(h['replacement_s'])} | {fmt(h['rejoin_s'])} | {fmt(h['load_s'])} | {fmt(h['resume_s'])} | "
              f"{fmt(h['heal_s'])} |")
    if r["lost_errors"]:
        print("\nlost: " + "; ".join(r["lost_errors"][:5]))
    for problem in r["death_problems"]:
        print(f"\ndeaths: {problem}")
    for problem in r["heal_metric_problems"]:
        print(f"\nmetrics: {problem}")
    if r["kills_without_a_streaming_request_at"]:
        print(f"\nno request was streaming at the kill(s) at {r['kills_without_a_streaming_request_at']} s")
    print(f"\n{'PASSED' if r['passed'] else 'FAILED'} (logs in {r['log_dir']})")


if __name__ == "__main__":
    sys.exit(main())
