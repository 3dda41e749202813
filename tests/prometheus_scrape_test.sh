#!/usr/bin/env bash
# A real Prometheus (Debian package prometheus) scrapes a real local cluster: `shardserve launch`
# (1 node x 2 workers, the demo model) with its metrics on a free port range, Prometheus on a free
# port scraping the coordinator and both workers every second. After some text is generated, the
# PromQL queries below must see the tokens, the time-to-first-token histogram and the workers'
# steps, and every target must be up. The cluster logs with --log-format json: every line of every
# process's log must be a JSON object with ts, level, service and message, and the requests' lines
# must carry request_id. Everything is killed and reaped on exit; bounded by DEADLINE.
#
# usage: prometheus_scrape_test.sh BIN_DIR     (exit 77: skipped, no prometheus binary)
set -euo pipefail

BIN=${1:?usage: prometheus_scrape_test.sh BIN_DIR}
DEADLINE=$((SECONDS + 120))
command -v prometheus >/dev/null || { echo "SKIPPED: no prometheus binary (tools/ci/install-deps.sh installs it)"; exit 77; }
command -v python3 >/dev/null || { echo "SKIPPED: no python3"; exit 77; }

WORK=$(mktemp -d /tmp/prometheus_scrape_test.XXXXXX)
LAUNCH_PID="" PROM_PID=""
cleanup() {
  local rc=$?
  for pid in $PROM_PID $LAUNCH_PID; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in $PROM_PID $LAUNCH_PID; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ "$rc" -ne 0 ]; then
    echo "---- logs (kept in $WORK) ----"
    tail -n 20 "$WORK"/*.log "$WORK"/logs/*.log 2>/dev/null || true
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# Free ports (tools/ci/ports.py: outside the ephemeral range, claimed): one for gRPC, one for
# Prometheus, and a run of 3 consecutive ones for the metrics.
read -r GRPC_PORT PROM_PORT METRICS_BASE < <(PYTHONPATH="$(dirname "$0")/../tools/ci" python3 -c \
  'import ports; print(ports.free_port(), ports.free_port(), ports.free_port_block(3))')
[ -n "${METRICS_BASE:-}" ] || { echo "FAIL: no free port range"; exit 1; }
ADDRESS=127.0.0.1:$GRPC_PORT
TARGETS="'127.0.0.1:$METRICS_BASE', '127.0.0.1:$((METRICS_BASE + 1))', '127.0.0.1:$((METRICS_BASE + 2))'"

# launch's default TLS: cluster.json (CA, client certificate) in a state directory of our own,
# which `generate` below reads (tests run in parallel).
export SHARDSERVE_STATE_DIR="$WORK/state"
"$BIN/shardserve" launch --nodes 1 --gpus-per-node 2 --address "$ADDRESS" --metrics-port-base "$METRICS_BASE" \
  --http-port 0 --log-dir "$WORK/logs" --log-format json --ready-timeout-seconds 60 >"$WORK/launch.log" 2>&1 &
LAUNCH_PID=$!

cat >"$WORK/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: shardserve
    static_configs:
      - targets: [$TARGETS]
YML
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!

until grep -q "ready" "$WORK/launch.log"; do
  kill -0 "$LAUNCH_PID" 2>/dev/null || { echo "FAIL: shardserve launch exited"; exit 1; }
  [ $SECONDS -lt $DEADLINE ] || { echo "FAIL: the cluster did not get ready"; exit 1; }
  sleep 0.2
done
for i in 1 2; do
  "$BIN/shardserve" generate --address "$ADDRESS" --prompt "And God said" --max-tokens 16 --ignore-eos >"$WORK/generate$i.log" 2>&1
done

# The value of a scalar-result PromQL query (the first sample), or "" when there is none yet.
query() {
  python3 - "$PROM_PORT" "$1" <<'PY'
import json, sys, urllib.parse, urllib.request
url = "http://127.0.0.1:%s/api/v1/query?query=%s" % (sys.argv[1], urllib.parse.quote(sys.argv[2]))
try:
    body = json.load(urllib.request.urlopen(url, timeout=2))
except Exception:
    sys.exit(0)
result = body.get("data", {}).get("result", [])
if body.get("status") == "success" and result:
    print(result[0]["value"][1])
PY
}

# Waits until `query` returns a value for which the python expression `check` (on v) holds.
expect() {
  local promql=$1 check=$2 value=""
  while :; do
    value=$(query "$promql")
    if [ -n "$value" ] && python3 -c "import sys; v = float(sys.argv[1]); sys.exit(0 if ($check) else 1)" "$value"; then
      echo "ok: $promql = $value ($check)"
      return 0
    fi
    if [ $SECONDS -ge $DEADLINE ]; then
      echo "FAIL: $promql = '${value}', expected $check"
      exit 1
    fi
    sleep 0.5
  done
}

expect 'count(up{job="shardserve"} == 1)' 'v == 3'
expect 'sum(shardserve_generated_tokens_total)' 'v == 32'
expect 'sum(shardserve_time_to_first_token_seconds_count)' 'v == 2'
expect 'histogram_quantile(0.5, sum by (le) (shardserve_time_to_first_token_seconds_bucket))' 'v > 0'
expect 'sum(shardserve_requests_total{code="OK"})' 'v == 2'
expect 'sum(shardserve_worker_steps_total)' 'v > 0'
expect 'count(shardserve_worker_up == 1)' 'v == 2'

python3 - "$WORK/logs" <<'PY'
import glob, json, os, sys
requests = 0
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.log"))):
    for n, line in enumerate(open(path), 1):
        try:
            event = json.loads(line)
        except ValueError:
            sys.exit("FAIL: %s:%d is not JSON: %r" % (path, n, line))
        missing = [k for k in ("ts", "level", "service", "message") if k not in event]
        if missing:
            sys.exit("FAIL: %s:%d lacks %s: %r" % (path, n, missing, line))
        requests += "request_id" in event
if requests < 4:  # started + finished, 2 requests
    sys.exit("FAIL: %d log lines with a request_id, expected >= 4" % requests)
print("ok: every log line is a JSON event; %d carry a request_id" % requests)
PY
echo "PASS"
