#!/usr/bin/env python3
"""Checks deploy/ without external tools (stdlib only; run by CTest as deploy_metrics_test).

- Every metric that the Grafana dashboard and the Prometheus alert rules reference exists in the
  list of docs/metrics.md (histogram series _bucket/_sum/_count map to their histogram; _bucket
  etc. only on histograms), and every label they group, match or print by is a label of the
  metrics in that expression. A missing docs/metrics.md is a failure: it is the list checked against.
- The dashboard: valid JSON, datasource as a template variable used by every panel and target,
  the panels the deployment docs promise, unique ids.
- The Dockerfiles: multi-stage, the stated bases, a numeric non-root USER, an ENTRYPOINT.
"""
import json
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DASHBOARD = os.path.join(ROOT, "deploy/grafana/shardserve-dashboard.json")
RULES = os.path.join(ROOT, "deploy/prometheus/rules/shardserve.rules.yml")
METRICS_MD = os.path.join(ROOT, "docs/metrics.md")

# Labels Prometheus itself adds to every series (target labels of deploy/prometheus configs).
TARGET_LABELS = {"job", "instance", "component", "namespace", "pod", "container"}
NAME = re.compile(r"\bshardserve_[a-z_]+\b")

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


def load_metrics():
    if not os.path.exists(METRICS_MD):
        fail("docs/metrics.md not found: the dashboard and rules have no metric list to be checked against")
        return {}
    metrics = {}
    row = re.compile(r"^\|\s*`(shardserve_[a-z_]+)`\s*\|\s*([a-z]+)\s*\|([^|]*)\|")
    with open(METRICS_MD, encoding="utf-8") as f:
        for line in f:
            m = row.match(line.strip())
            if m:
                labels = [l.strip() for l in m.group(3).replace("`", "").split(",") if l.strip()]
                metrics[m.group(1)] = (m.group(2), labels)
    if not metrics:
        fail("docs/metrics.md has no metric table rows (| `name` | type | labels | meaning |)")
    print(f"docs/metrics.md: {len(metrics)} metrics")
    return metrics


def resolve(name, metrics):
    """The documented metric a series name belongs to, or None."""
    if name in metrics:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if base in metrics:
                if metrics[base][0] not in ("histogram", "summary"):
                    fail(f"{name}: {base} is a {metrics[base][0]}, it has no {suffix} series")
                if suffix == "_bucket" and metrics[base][0] != "histogram":
                    fail(f"{name}: only histograms have _bucket")
                return base
    return None


def check_expr(where, expr, metrics, legend=""):
    names = set(NAME.findall(expr))
    if not names and "shardserve" not in where:
        fail(f"{where}: no shardserve metric in {expr!r}")
    labels = set(TARGET_LABELS)
    hist = False
    for n in sorted(names):
        base = resolve(n, metrics)
        if base is None:
            fail(f"{where}: {n} is not in docs/metrics.md")
            continue
        labels.update(metrics[base][1])
        hist |= n.endswith("_bucket")
    if hist:
        labels.add("le")
    used = set()
    for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        used.update(l.strip() for l in grp.split(",") if l.strip())
    for sel in re.findall(r"\{([^}]*)\}", expr):
        used.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", sel))
    for m in re.findall(r"label_values\([^,]*,\s*([a-zA-Z_]+)\)", expr):
        used.add(m)
    used.update(re.findall(r"\{\{\s*([a-zA-Z_]+)\s*\}\}", legend))
    for l in sorted(used - labels):
        fail(f"{where}: label {l!r} is not a label of {sorted(names)} ({expr!r})")
    return names


def check_dashboard(metrics):
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    tv = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
    if tv.get("datasource", {}).get("type") != "datasource" or tv["datasource"].get("query") != "prometheus":
        fail("dashboard: no Prometheus datasource template variable 'datasource'")
    referenced = set()
    for v in tv.values():
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            referenced |= check_expr(f"dashboard variable {v['name']}", q, metrics)
            if v.get("datasource", {}).get("uid") != "${datasource}":
                fail(f"dashboard variable {v['name']}: datasource is not ${{datasource}}")
    ids, titles = set(), []
    for p in dash["panels"]:
        if p["id"] in ids:
            fail(f"dashboard: duplicate panel id {p['id']}")
        ids.add(p["id"])
        if p["type"] == "row":
            continue
        titles.append(p["title"])
        if p.get("datasource", {}).get("uid") != "${datasource}":
            fail(f"panel {p['title']!r}: datasource is not ${{datasource}}")
        if not p.get("targets"):
            fail(f"panel {p['title']!r}: no targets")
        for t in p.get("targets", []):
            if t.get("datasource", {}).get("uid") != "${datasource}":
                fail(f"panel {p['title']!r} target {t.get('refId')}: datasource is not ${{datasource}}")
            referenced |= check_expr(f"panel {p['title']!r}", t["expr"], metrics, t.get("legendFormat", ""))
    want = ["tokens/s", "Time to first token", "Inter-token latency", "end to end", "running / waiting",
            "Queue time", "KV cache", "Step time", "Collective time", "Worker health"]
    for w in want:
        if not any(w.lower() in t.lower() for t in titles):
            fail(f"dashboard: no panel titled like {w!r}")
    for pct in ("0.5", "0.9", "0.99"):
        if not any(f"histogram_quantile({pct}," in t["expr"] for p in dash["panels"] for t in p.get("targets", [])):
            fail(f"dashboard: no p{pct} quantile")
    print(f"dashboard: {len(titles)} panels, metrics {len(referenced)}")
    return referenced


def check_rules(metrics):
    """Each rule's expr (block scalar or one line) and the metric names in annotations."""
    with open(RULES, encoding="utf-8") as f:
        lines = f.read().splitlines()
    referenced, alerts = set(), {}
    i, current = 0, None
    while i < len(lines):
        s = lines[i].strip()
        if s.startswith("- alert:"):
            current = s.split(":", 1)[1].strip()
            alerts[current] = {"lines": []}
        if current and not s.startswith("#"):
            alerts[current]["lines"].append(lines[i])
        if s.startswith("expr:") and current:
            indent = len(lines[i]) - len(lines[i].lstrip())
            value = s[len("expr:"):].strip()
            if value in ("|", ">", "|-", ">-"):
                block = []
                i += 1
                while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                    block.append(lines[i].strip())
                    i += 1
                value = " ".join(block)
                alerts[current]["expr"] = value
                continue
            alerts[current]["expr"] = value
        i += 1
    for name, a in alerts.items():
        if "expr" not in a:
            fail(f"alert {name}: no expr")
            continue
        referenced |= check_expr(f"alert {name}", a["expr"], metrics)
        text = "\n".join(a["lines"])
        for key in ("summary:", "description:", "for:", "severity:"):
            if key not in text:
                fail(f"alert {name}: no {key}")
        for n in NAME.findall(text):
            if resolve(n, metrics) is None:
                fail(f"alert {name}: annotation names {n}, not in docs/metrics.md")
        for l in re.findall(r"\$labels\.([a-zA-Z_]+)", text):
            labels = set(TARGET_LABELS)
            for n in NAME.findall(a["expr"]):
                b = resolve(n, metrics)
                if b:
                    labels.update(metrics[b][1])
            if l not in labels:
                fail(f"alert {name}: $labels.{l} is not a label of its expression")
    exprs = {n: a.get("expr", "") for n, a in alerts.items()}
    def has(pred, what):
        if not any(pred(e) for e in exprs.values()):
            fail(f"rules: no alert for {what}")
    has(lambda e: "shardserve_worker_up" in e and "== 0" in e, "a worker down")
    has(lambda e: "histogram_quantile(0.99" in e and "shardserve_time_to_first_token_seconds_bucket" in e, "TTFT p99")
    has(lambda e: "shardserve_kv_blocks_used" in e and "shardserve_kv_blocks_total" in e, "KV cache nearly full")
    has(lambda e: 'code!="OK"' in e and "shardserve_requests_total" in e, "the error rate")
    print(f"rules: {len(alerts)} alerts, metrics {len(referenced)}")
    return referenced


def check_dockerfiles():
    for name, base_re in (("coordinator", r"debian:12-slim"), ("worker", r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-ubuntu24\.04")):
        path = os.path.join(ROOT, f"deploy/docker/Dockerfile.{name}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        # instructions, continuation lines joined, comments dropped
        logical, cur = [], ""
        for line in text.splitlines():
            if line.strip().startswith("#"):
                continue
            cur += line.rstrip("\\") + " " if line.rstrip().endswith("\\") else line
            if not line.rstrip().endswith("\\"):
                if cur.strip():
                    logical.append(cur.strip())
                cur = ""
        froms = [l for l in logical if l.upper().startswith("FROM ")]
        if len(froms) < 2 or " AS " not in froms[0].upper():
            fail(f"Dockerfile.{name}: not multi-stage (a named build stage, then the runtime stage)")
        if froms and not re.search(base_re, froms[-1]):
            fail(f"Dockerfile.{name}: runtime stage is {froms[-1]!r}, expected {base_re}")
        last = logical[logical.index(froms[-1]):] if froms else logical
        users = [l.split(None, 1)[1] for l in last if l.upper().startswith("USER ")]
        if not users or users[-1].split(":")[0] in ("root", "0"):
            fail(f"Dockerfile.{name}: the runtime stage has no non-root USER")
        elif not re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", users[-1].strip()):
            # The kubelet can enforce runAsNonRoot only on a numeric user; deploy/k8s runs 10001.
            fail(f"Dockerfile.{name}: USER {users[-1]!r} is not a numeric non-root uid:gid")
        if not any("tools/ci/install-deps.sh" in l for l in logical if l.upper().startswith("RUN ")):
            fail(f"Dockerfile.{name}: the build stage does not run tools/ci/install-deps.sh")
        if not any(l.upper().startswith("ENTRYPOINT ") for l in last):
            fail(f"Dockerfile.{name}: no ENTRYPOINT")
        for l in logical:
            if l.upper().startswith("COPY ") and "--from" not in l:
                for src in l.split()[1:-1]:
                    if not src.startswith("-") and src != "." and not os.path.exists(os.path.join(ROOT, src)):
                        fail(f"Dockerfile.{name}: COPY source {src} does not exist")
        print(f"Dockerfile.{name}: {len(froms)} stages, USER {users[-1] if users else '-'}")


def main():
    metrics = load_metrics()
    check_dashboard(metrics)
    check_rules(metrics)
    check_dockerfiles()
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print("deploy_test.py: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
