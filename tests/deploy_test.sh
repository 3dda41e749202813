#!/usr/bin/env bash
# Checks deploy/ with the real tools (run by CTest; exit 77 = skipped, when a tool is missing).
# usage: tests/deploy_test.sh prometheus        promtool: configs, rules, rule unit tests
#        tests/deploy_test.sh k8s BUILD_DIR     kubectl kustomize each overlay (cpu-demo, gpu, lws), then validate
#                                               every object (tests/deploy_k8s_check.py)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SKIP=77

prometheus() {
  if ! command -v promtool >/dev/null; then
    echo "SKIPPED: promtool not found (Debian package prometheus, tools/ci/install-deps.sh)"
    exit $SKIP
  fi
  local p="$ROOT/deploy/prometheus" rc=0
  promtool check rules "$p/rules/shardserve.rules.yml" || rc=1
  promtool test rules "$p/rules/shardserve.rules.test.yml" || rc=1
  (cd "$p" && promtool check config prometheus-local.yml) || rc=1
  # Debian's prometheus is built without Kubernetes service discovery, so its promtool rejects
  # kubernetes_sd_configs as an unknown field. Then check everything else in the file: the same
  # config with the kubernetes_sd_configs replaced by an equivalent static_configs.
  local out
  out="$(cd "$p" && promtool check config prometheus-k8s.yml 2>&1)"
  if [ $? -eq 0 ]; then
    echo "$out"
  elif grep -q "field kubernetes_sd_configs not found" <<<"$out"; then
    echo "note: this promtool has no Kubernetes service discovery (Debian build); checking" \
         "prometheus-k8s.yml with kubernetes_sd_configs replaced by static_configs"
    local tmp; tmp="$(mktemp -d)"
    cp -r "$p/rules" "$tmp/"
    awk '/^    kubernetes_sd_configs:/ {print "    static_configs:"; print "      - targets: [\"127.0.0.1:9400\"]"; skip=1; next}
         skip && /^      / {next} {skip=0; print}' "$p/prometheus-k8s.yml" > "$tmp/prometheus-k8s.yml"
    (cd "$tmp" && promtool check config prometheus-k8s.yml) || rc=1
    rm -rf "$tmp"
  else
    echo "$out"; rc=1
  fi
  exit $rc
}

k8s() {
  local build="$1" venv="$1/deploy-venv" rc=0
  # kubectl: the one on PATH, and Debian's kubernetes-client (kubectl 1.20, kustomize v2), which
  # is unpacked into the build dir without installing it (it would clash with other kubectl
  # packages): the kustomizations must render with both.
  local kubectls=()
  command -v kubectl >/dev/null && kubectls+=("$(command -v kubectl)")
  local deb="$build/deploy-kubectl"
  if [ ! -x "$deb/usr/bin/kubectl" ]; then
    mkdir -p "$deb" && (cd "$deb" && timeout 120 apt-get download kubernetes-client >/dev/null 2>&1 \
      && dpkg-deb -x kubernetes-client_*.deb . && rm -f kubernetes-client_*.deb) \
      || echo "note: could not fetch Debian's kubernetes-client (apt-get download)"
  fi
  [ -x "$deb/usr/bin/kubectl" ] && kubectls+=("$deb/usr/bin/kubectl")
  if [ ${#kubectls[@]} -eq 0 ]; then
    echo "SKIPPED: no kubectl (neither on PATH nor Debian's kubernetes-client via apt-get download)"
    exit $SKIP
  fi
  if [ ! -x "$venv/bin/kubernetes-validate" ]; then
    python3 -m venv "$venv" && timeout 300 "$venv/bin/pip" install -q --disable-pip-version-check \
      -r "$ROOT/tests/deploy_requirements.txt"
    if [ ! -x "$venv/bin/kubernetes-validate" ]; then
      rm -rf "$venv"
      echo "SKIPPED: could not install kubernetes-validate from PyPI into $venv"
      exit $SKIP
    fi
  fi
  local args=() i=0
  for k in "${kubectls[@]}"; do
    echo "== $k ($("$k" version --client 2>/dev/null | head -1))"
    for o in cpu-demo gpu lws; do
      local out="$build/deploy-rendered-$i-$o.yaml"
      if "$k" kustomize "$ROOT/deploy/k8s/overlays/$o" >"$out" 2>"$out.err"; then
        args+=("$o($i)=$out")
      else
        echo "FAIL: $k kustomize deploy/k8s/overlays/$o:"; cat "$out.err"; rc=1
      fi
    done
    i=$((i + 1))
  done
  "$venv/bin/python" "$ROOT/tests/deploy_k8s_check.py" 1.30 "${args[@]}" || rc=1
  exit $rc
}

case "${1:-}" in
  prometheus) prometheus ;;
  k8s) k8s "${2:?usage: deploy_test.sh k8s BUILD_DIR}" ;;
  *) echo "usage: $0 prometheus | k8s BUILD_DIR"; exit 2 ;;
esac
