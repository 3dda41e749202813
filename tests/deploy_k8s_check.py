#!/usr/bin/env python3
"""Validates the rendered deploy/k8s overlays (run by tests/deploy_test.sh in its venv).

usage: deploy_k8s_check.py KUBERNETES_VERSION OVERLAY=RENDERED.yaml ...

Every object is validated against the Kubernetes schema of KUBERNETES_VERSION by
kubernetes-validate (strict: unknown fields are errors), except the Prometheus Operator's
PodMonitor, a CRD that the core schema does not have: it gets a structural check here (fields,
selector matching the pods, ports that the pods declare). Then the checks that the schema cannot
make: topology vs. containers, probes on declared ports, resources, non-root, the model volume,
the dashboard ConfigMap.
"""
import json
import os
import re
import sys

import kubernetes_validate
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


def pods_of(objs):
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o, o["spec"]["template"]


def check_podmonitor(pm, objs):
    name = pm.get("metadata", {}).get("name")
    spec = pm.get("spec", {})
    sel = spec.get("selector", {}).get("matchLabels")
    if not name or not sel or not spec.get("podMetricsEndpoints"):
        fail(f"PodMonitor {name}: needs metadata.name, spec.selector.matchLabels, spec.podMetricsEndpoints")
        return
    allowed = {"port", "portNumber", "targetPort", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
               "metricRelabelings", "honorLabels", "honorTimestamps"}
    ports = set()
    matched = [t for _, t in pods_of(objs) if all(t["metadata"]["labels"].get(k) == v for k, v in sel.items())]
    if not matched:
        fail(f"PodMonitor {name}: selector {sel} matches no pod template")
    for t in matched:
        for c in t["spec"]["containers"]:
            ports.update(p.get("name") for p in c.get("ports", []))
    found = 0
    for ep in spec["podMetricsEndpoints"]:
        extra = set(ep) - allowed
        if extra:
            fail(f"PodMonitor {name}: unknown endpoint fields {sorted(extra)}")
        if not isinstance(ep.get("port"), str):
            fail(f"PodMonitor {name}: endpoint without a port name")
        found += ep.get("port") in ports
    if matched and not found:
        fail(f"PodMonitor {name}: no endpoint port is declared by the pods ({sorted(ports)})")


def check_overlay(overlay, path, version):
    with open(path, encoding="utf-8") as f:
        objs = [o for o in yaml.safe_load_all(f) if o]
    print(f"{overlay}: {len(objs)} objects")
    kinds = {}
    for o in objs:
        kinds.setdefault(o["kind"], []).append(o)
        what = f"{overlay}: {o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "PodMonitor":
            if o["apiVersion"] != "monitoring.coreos.com/v1":
                fail(f"{what}: apiVersion {o['apiVersion']}")
            continue  # CRD: structural check below
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            fail(f"{what}: {e.message} at {'.'.join(str(p) for p in e.path)}")
        except Exception as e:  # noqa: BLE001 (schema missing etc.)
            fail(f"{what}: {type(e).__name__}: {e}")
        if o["metadata"].get("namespace", "shardserve") != "shardserve" and o["kind"] != "Namespace":
            fail(f"{what}: namespace {o['metadata'].get('namespace')}")
    for want in ("Deployment", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "PodMonitor"):
        if want not in kinds:
            fail(f"{overlay}: no {want}")
    for pm in kinds.get("PodMonitor", []):
        check_podmonitor(pm, objs)

    cms = {c["metadata"]["name"]: c for c in kinds.get("ConfigMap", [])}
    cfg = next((c["data"] for n, c in cms.items() if n.startswith("shardserve-config")), None)
    if cfg is None:
        fail(f"{overlay}: no shardserve-config ConfigMap")
        return
    dash = cms.get("shardserve-grafana-dashboard")
    if not dash or dash["metadata"].get("labels", {}).get("grafana_dashboard") != "1":
        fail(f"{overlay}: no dashboard ConfigMap labelled grafana_dashboard=1")
    else:
        with open(os.path.join(ROOT, "deploy/grafana/shardserve-dashboard.json"), encoding="utf-8") as f:
            if json.loads(dash["data"]["shardserve-dashboard.json"]) != json.load(f):
                fail(f"{overlay}: the dashboard ConfigMap differs from deploy/grafana/shardserve-dashboard.json")

    nodes, gpus = int(cfg["NODES"]), int(cfg["GPUS_PER_NODE"])
    sts = kinds["StatefulSet"][0]
    if sts["spec"]["replicas"] != nodes:
        fail(f"{overlay}: StatefulSet replicas {sts['spec']['replicas']} != NODES {nodes}")
    workers = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"].startswith("worker-")]
    if len(workers) != gpus:
        fail(f"{overlay}: {len(workers)} worker containers per pod != GPUS_PER_NODE {gpus}")
    headless = [s for s in kinds["Service"] if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    if not headless or headless[0]["spec"].get("clusterIP") != "None":
        fail(f"{overlay}: the StatefulSet's serviceName is not a headless Service")
    gpu_overlay = cfg["WORKER_DEVICE"].startswith("cuda")
    for owner, t in pods_of(objs):
        spec = t["spec"]
        who = f"{overlay}: {owner['kind']}/{owner['metadata']['name']}"
        meta = t["metadata"]
        if meta.get("annotations", {}).get("prometheus.io/scrape") != "true" or \
                meta.get("labels", {}).get("app.kubernetes.io/name") != "shardserve":
            fail(f"{who}: deploy/prometheus/prometheus-k8s.yml would not discover it (label, annotation)")
        for c in spec["containers"]:
            if not any(re.fullmatch(r"metrics(-[0-9]+)?", p.get("name", "")) for p in c.get("ports", [])):
                fail(f"{who} container {c['name']}: no port named metrics or metrics-<k> (scrape configs)")
        if not spec.get("securityContext", {}).get("runAsNonRoot"):
            fail(f"{who}: not runAsNonRoot")
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        model = vols.get("model", {})
        sources = [k for k in model if k != "name"]
        if len(sources) != 1:
            fail(f"{who}: the model volume has sources {sources}, expected exactly one")
        elif gpu_overlay and sources != ["persistentVolumeClaim"]:
            fail(f"{who}: gpu overlay: the model volume is {sources[0]}, expected a PVC")
        elif not gpu_overlay and not any("/models" in " ".join(c.get("command", [])) for c in spec.get("initContainers", [])):
            fail(f"{who}: cpu-demo: no initContainer fills the model volume")
        seen_ports = set()
        for c in spec["containers"] + spec.get("initContainers", []):
            cw = f"{who} container {c['name']}"
            r = c.get("resources", {})
            if not r.get("requests") or not r.get("limits"):
                fail(f"{cw}: needs resource requests and limits")
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                fail(f"{cw}: allowPrivilegeEscalation is not false")
            if c in spec.get("initContainers", []):
                continue
            declared = {p["containerPort"] for p in c.get("ports", [])}
            for p in declared:
                if p in seen_ports:
                    fail(f"{cw}: port {p} used twice in the pod")
                seen_ports.add(p)
            if "readinessProbe" not in c or "livenessProbe" not in c:
                fail(f"{cw}: needs readiness and liveness probes")
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe:
                    port = (probe.get("grpc") or probe.get("tcpSocket") or {}).get("port")
                    if port not in declared:
                        fail(f"{cw}: {kind} on port {port}, which the container does not declare")
            args = " ".join(c.get("args", []))
            if "--metrics-listen=0.0.0.0:" not in args:
                fail(f"{cw}: no --metrics-listen on all addresses")
            if c["name"].startswith("worker-"):
                if not c["readinessProbe"].get("grpc"):
                    fail(f"{cw}: readiness is not a gRPC probe")
                if not c["livenessProbe"].get("grpc"):
                    fail(f"{cw}: liveness is not a gRPC probe")
                env = {e["name"]: e for e in c.get("env", [])}
                if env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.name":
                    fail(f"{cw}: POD_NAME is not the pod name (downward API)")
                if "--node=$(POD_NAME)" not in args or "--collective-host=$(POD_IP)" not in args:
                    fail(f"{cw}: --node must be the pod name and --collective-host the pod IP")
                gpu = r.get("limits", {}).get("nvidia.com/gpu")
                if gpu_overlay and str(gpu) != "1":
                    fail(f"{cw}: gpu overlay: nvidia.com/gpu limit {gpu}, expected 1")
                if not gpu_overlay and gpu is not None:
                    fail(f"{cw}: cpu-demo requests a GPU")
    if gpu_overlay:
        aff = sts["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
        if not aff.get("requiredDuringSchedulingIgnoredDuringExecution"):
            fail(f"{overlay}: gpu overlay: worker pods are not forced onto distinct nodes")


def main():
    version = sys.argv[1]
    for arg in sys.argv[2:]:
        overlay, path = arg.split("=", 1)
        check_overlay(overlay, path, version)
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print("deploy_k8s_check.py: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
