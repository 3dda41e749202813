#!/usr/bin/env python3
"""deploy/ against the real thing (stdlib; run by CTest as deploy_local_test; exit 77 = skipped).

Starts a local `shardserve launch` cluster (2 x 2 on the CPU, the demo model) and a Prometheus
with deploy/prometheus/prometheus-local.yml (ports moved to free ones, otherwise unchanged),
generates a completion, and checks that:
- every target of the config is up and the alert rules are loaded and healthy;
- every metric that the dashboard and the rules reference has series (so the names match what
  the services expose, not only docs/metrics.md), but those only a mixture-of-experts model has;
- every dashboard query and alert expression evaluates without an error.

usage: deploy_local_test.py BIN_DIR
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

from cli_check import scaled  # SHARDSERVE_TEST_TIME_SCALE
from ports import free_port, free_port_block  # noqa: E402 (tools/ci, on the path from cli_check)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SKIP = 77
# Series only a mixture-of-experts model has (the demo model is dense): their panels' queries are
# still evaluated, and tests/deploy_test.py checks their names against docs/metrics.md.
ONLY_WITH_EXPERTS = {"shardserve_worker_expert_rows_total"}


def api(port, path, **params):
    url = f"http://127.0.0.1:{port}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:  # a bad query: 400 with {"status": "error", "error": ...}
        return json.load(e)


def main():
    bindir = sys.argv[1]
    cli = os.path.join(bindir, "shardserve")
    prom = shutil.which("prometheus")
    if not os.access(cli, os.X_OK) or not prom:
        print(f"SKIPPED: needs {cli} (build) and prometheus (Debian package prometheus)")
        return SKIP
    sys.path.insert(0, os.path.dirname(__file__))
    import deploy_test  # the metric extraction of the stdlib test

    work = tempfile.mkdtemp(prefix="shardserve-deploy-")
    procs = []
    failures = []
    try:
        base = free_port_block(5)  # launch's metrics ports: the coordinator's, then the workers'
        grpc_port, prom_port = free_port(), free_port()  # claimed: apart from each other and the block
        # launch's default TLS: its CA and client certificate in cluster.json of our own state
        # directory (tests run in parallel), which `generate` below reads.
        os.environ["SHARDSERVE_STATE_DIR"] = os.path.join(work, "state")
        launch = subprocess.Popen([cli, "launch", "--address", f"127.0.0.1:{grpc_port}", "--log-dir", work + "/logs",
                                   "--metrics-port-base", str(base), "--http-port", "0"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(launch)
        with open(os.path.join(ROOT, "deploy/prometheus/prometheus-local.yml")) as f:
            cfg = f.read()
        for k in range(5):
            cfg = cfg.replace(f"127.0.0.1:{9400 + k}", f"127.0.0.1:{base + k}")
        cfg = cfg.replace("scrape_interval: 5s", "scrape_interval: 1s").replace("evaluation_interval: 5s", "evaluation_interval: 1s")
        shutil.copytree(os.path.join(ROOT, "deploy/prometheus/rules"), os.path.join(work, "rules"))
        with open(os.path.join(work, "prometheus.yml"), "w") as f:
            f.write(cfg)
        promp = subprocess.Popen([prom, "--config.file=" + os.path.join(work, "prometheus.yml"),
                                  "--storage.tsdb.path=" + os.path.join(work, "tsdb"),
                                  f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                                 stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "prometheus.log"), "w"),
                                 start_new_session=True)
        procs.append(promp)

        # wait until the cluster serves: `generate` succeeds
        deadline = time.time() + scaled(180)
        while True:
            g = subprocess.run([cli, "generate", "--address", f"127.0.0.1:{grpc_port}", "--prompt", "And God said",
                                "--max-tokens", "16"], capture_output=True, text=True, timeout=120)
            if g.returncode == 0:
                break
            if time.time() > deadline or launch.poll() is not None:
                print("FAIL: the cluster did not serve:", g.stderr[-2000:])
                return 1
            time.sleep(1)
        subprocess.run([cli, "generate", "--address", f"127.0.0.1:{grpc_port}", "--prompt", "In the beginning",
                        "--max-tokens", "16"], capture_output=True, timeout=120)

        # targets up
        deadline = time.time() + scaled(60)
        while True:
            try:
                t = api(prom_port, "targets")["data"]["activeTargets"]
                up = [x for x in t if x["health"] == "up"]
                if len(t) == 5 and len(up) == 5:
                    break
            except OSError:
                t = []
            if time.time() > deadline:
                print("FAIL: targets not all up:", [(x["scrapeUrl"], x["health"], x.get("lastError")) for x in t])
                return 1
            time.sleep(1)
        print("prometheus: 5 targets up")
        time.sleep(4)  # a few scrapes after the generations, so rates have two points

        metrics = deploy_test.load_metrics()
        exprs = []
        with open(os.path.join(ROOT, "deploy/grafana/shardserve-dashboard.json")) as f:
            dash = json.load(f)
        for p in dash["panels"]:
            for tg in p.get("targets", []):
                exprs.append((f"panel {p['title']!r}", tg["expr"]))
        rules = api(prom_port, "rules")["data"]["groups"]
        loaded = [r for g in rules for r in g["rules"]]
        if len(loaded) < 4:
            failures.append(f"only {len(loaded)} rules loaded")
        for r in loaded:
            if r.get("health") not in ("ok", "unknown"):
                failures.append(f"rule {r['name']}: health {r.get('health')}: {r.get('lastError')}")
            exprs.append((f"rule {r['name']}", r["query"]))
        names = set()
        for where, e in exprs:
            e = e.replace("$__rate_interval", "1m").replace('"$model"', '".*"')
            names |= set(deploy_test.NAME.findall(e))
            res = api(prom_port, "query", query=e)
            if res.get("status") != "success":
                failures.append(f"{where}: {res.get('error')}")
        for n in sorted(names - ONLY_WITH_EXPERTS):
            res = api(prom_port, "query", query=f"count({{__name__=\"{n}\"}})")
            if not res["data"]["result"]:
                failures.append(f"{n}: no series scraped from the cluster")
        print(f"checked {len(exprs)} expressions, {len(names)} series names")
        for f_ in failures:
            print("FAIL: " + f_)
        return 1 if failures else 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
