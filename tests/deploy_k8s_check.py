#!/usr/bin/env python3
"""Validates the rendered deploy/k8s overlays (run by tests/deploy_test.sh in its venv).

usage: deploy_k8s_check.py KUBERNETES_VERSION OVERLAY=RENDERED.yaml ...

Every object of a core kind is validated against the Kubernetes schema of KUBERNETES_VERSION by
kubernetes-validate (strict: unknown fields are errors); so is each pod template of a
LeaderWorkerSet, as a Pod. The CRDs the core schema does not have get a structural check here:
the Prometheus Operator's PodMonitor (selector matching the pods, ports they declare),
cert-manager's Issuer and Certificate (issuers that exist, the Secrets the pods mount, server
and client auth, the names the workers dial), the LeaderWorkerSet (its fields, restart policy
None, size = NODES + 1). Then what a schema cannot check: workers in a StatefulSet (or an LWS)
with their pod name as node name, spares, topology vs. containers, probes that do not kill a
healing worker and work with TLS, resources, the security context of every container, TLS and
API keys from Secrets, NetworkPolicies (who reaches which port), the model volume, the dashboard
ConfigMap. Finally, the LeaderWorkerSet's pod templates must be the base's (no drift).
"""
import contextlib
import copy
import io
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


def check_podmonitor(pm, objs):
    name = pm.get("metadata", {}).get("name")
    spec = pm.get("spec", {})
    sel = spec.get("selector")
    if not name or not sel or not spec.get("podMetricsEndpoints"):
        fail(f"PodMonitor {name}: needs metadata.name, spec.selector, spec.podMetricsEndpoints")
        return
    allowed = {"port", "portNumber", "targetPort", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
               "metricRelabelings", "honorLabels", "honorTimestamps", "tlsConfig"}
    ports = set()
    https_ports = set()  # port names on which a matched container serves HTTPS
    matched = [t for _, _, t in pod_templates(objs) if selector_matches(sel, t["metadata"]["labels"])]
    if not matched:
        fail(f"PodMonitor {name}: selector {sel} matches no pod template")
    for t in matched:
        for c in t["spec"]["containers"]:
            ports.update(p.get("name") for p in c.get("ports", []))
            https_ports.update(p.get("name") for p in c.get("ports", []) if serves_https(c, p["containerPort"]))
    # The names each certificate carries, by its Secret (cert-manager overlays).
    cert_names = {c.get("spec", {}).get("secretName"): c.get("spec", {}).get("dnsNames", [])
                  for c in objs if c.get("kind") == "Certificate"}
    found = 0
    for ep in spec["podMetricsEndpoints"]:
        extra = set(ep) - allowed
        if extra:
            fail(f"PodMonitor {name}: unknown endpoint fields {sorted(extra)}")
        if not isinstance(ep.get("port"), str):
            fail(f"PodMonitor {name}: endpoint without a port name")
        found += ep.get("port") in ports
        if ep.get("port") in https_ports:
            tls = ep.get("tlsConfig", {})
            ca = tls.get("ca", {}).get("secret") or tls.get("ca", {}).get("configMap") or {}
            if ep.get("scheme") != "https":
                fail(f"PodMonitor {name}: scrapes port {ep['port']} without scheme https, but /metrics there is HTTPS "
                     "(--tls-cert): every scrape would fail")
            elif not ca.get("name") or not ca.get("key"):
                fail(f"PodMonitor {name}: port {ep['port']}: no tlsConfig.ca (the cluster CA) to verify /metrics with")
            elif not tls.get("serverName"):
                fail(f"PodMonitor {name}: port {ep['port']}: no tlsConfig.serverName (Prometheus dials pod IPs, "
                     "which no certificate names)")
            elif ca["name"] in cert_names and not any(host_matches(p, tls["serverName"]) for p in cert_names[ca["name"]]):
                fail(f"PodMonitor {name}: port {ep['port']}: serverName {tls['serverName']} is not a name of the "
                     f"certificate in Secret {ca['name']} ({cert_names[ca['name']]})")
    if matched and not found:
        fail(f"PodMonitor {name}: no endpoint port is declared by the pods ({sorted(ports)})")


# ---- Pods, wherever their templates are: Deployments, StatefulSets, LeaderWorkerSets ----

SHARDSERVE_IMAGES = ("shardserve-coordinator", "shardserve-worker")


def pod_templates(objs):
    """(owner, where, template) for every pod template: where names it in messages."""
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o, f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]
        elif o["kind"] == "LeaderWorkerSet":
            t = o.get("spec", {}).get("leaderWorkerTemplate", {})
            for key in ("leaderTemplate", "workerTemplate"):
                if key in t:
                    yield o, f"LeaderWorkerSet/{o['metadata']['name']} {key}", t[key]


def role_of(template):
    return template["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


def is_shardserve(container):
    return any(container.get("image", "").split("/")[-1].split(":")[0] == i for i in SHARDSERVE_IMAGES)


def flag(container, name):
    """The value of --name=VALUE in the container's args (None when absent, "" for a bare --name)."""
    for a in container.get("args", []):
        a = a.split("#")[0].strip()
        if a == f"--{name}":
            return ""
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def serves_https(container, port):
    """True when the container's process serves HTTPS on `port` (a number): /metrics
    (--metrics-listen) and the coordinator's HTTP API (--http-port, 8000 by default) use the
    --tls-cert certificate unless --metrics-plaintext / --http-plaintext."""
    if flag(container, "tls-cert") is None:
        return False
    metrics = flag(container, "metrics-listen")
    if metrics and metrics.rsplit(":", 1)[-1] == str(port):
        return flag(container, "metrics-plaintext") is None
    http = flag(container, "http-port")
    if role_of_container(container) == "coordinator" and str(port) == (http or "8000"):
        return flag(container, "http-plaintext") is None
    return False


def role_of_container(container):
    return "coordinator" if container.get("image", "").split("/")[-1].startswith("shardserve-coordinator") else "worker"


def selector_matches(selector, labels):
    """A LabelSelector (matchLabels, matchExpressions) against a label set; {} matches all."""
    if selector is None:
        return False
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        k, op, values = e["key"], e["operator"], e.get("values", [])
        if op == "In" and labels.get(k) not in values:
            return False
        if op == "NotIn" and labels.get(k) in values:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def check_security(overlay, where, spec):
    """Non-root, seccomp RuntimeDefault, no token, and per container: no privilege escalation,
    a read-only root filesystem, every capability dropped, not privileged, not uid 0."""
    who = f"{overlay}: {where}"
    psc = spec.get("securityContext", {})
    if psc.get("runAsNonRoot") is not True:
        fail(f"{who}: pod securityContext.runAsNonRoot is not true")
    if psc.get("runAsUser", 1) == 0:
        fail(f"{who}: pod runs as uid 0")
    if spec.get("automountServiceAccountToken") is not False:
        fail(f"{who}: automountServiceAccountToken is not false (the processes never call the API)")
    pod_seccomp = psc.get("seccompProfile", {}).get("type")
    for c in spec["containers"] + spec.get("initContainers", []):
        cw = f"{who} container {c['name']}"
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            fail(f"{cw}: allowPrivilegeEscalation is not false")
        if sc.get("readOnlyRootFilesystem") is not True:
            fail(f"{cw}: readOnlyRootFilesystem is not true")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            fail(f"{cw}: capabilities do not drop ALL")
        if sc.get("capabilities", {}).get("add"):
            fail(f"{cw}: adds capabilities {sc['capabilities']['add']}")
        if sc.get("privileged"):
            fail(f"{cw}: privileged")
        if sc.get("runAsUser", 1) == 0 or sc.get("runAsNonRoot") is False:
            fail(f"{cw}: runs as root")
        if sc.get("seccompProfile", {}).get("type", pod_seccomp) != "RuntimeDefault":
            fail(f"{cw}: seccompProfile is not RuntimeDefault (pod or container)")


def check_tls(overlay, where, spec, role):
    """--tls-cert/--tls-key/--tls-ca from a mounted Secret on every shardserve process, never
    --insecure; the coordinator's API keys from a Secret too. Returns the Secrets it mounts."""
    who = f"{overlay}: {where}"
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    secrets = set()
    for c in spec["containers"]:
        if not is_shardserve(c):
            continue
        cw = f"{who} container {c['name']}"
        if flag(c, "insecure") is not None:
            fail(f"{cw}: --insecure (plaintext beyond loopback)")
        mounts = c.get("volumeMounts", [])
        wanted = ["tls-cert", "tls-key", "tls-ca"] + (["api-keys-file"] if role == "coordinator" else [])
        for name in wanted:
            path = flag(c, name)
            if not path:
                fail(f"{cw}: no --{name}")
                continue
            m = next((m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")), None)
            secret = vols.get(m["name"], {}).get("secret") if m else None
            if not secret:
                fail(f"{cw}: --{name}={path} is not in a mounted Secret volume")
                continue
            if m.get("subPath"):
                fail(f"{cw}: --{name} comes through a subPath mount, which the kubelet never updates (rotation)")
            if not m.get("readOnly"):
                fail(f"{cw}: the Secret for --{name} is not mounted readOnly")
            secrets.add(secret["secretName"])
    return secrets


def check_probes(overlay, where, spec, role, heal_timeout):
    """Probes that do not kill a healing worker and that work with TLS on."""
    who = f"{overlay}: {where}"
    for c in spec["containers"]:
        if not is_shardserve(c):
            continue
        cw = f"{who} container {c['name']}"
        declared = {p["containerPort"]: p.get("name") for p in c.get("ports", [])}
        health = flag(c, "health-listen")
        health_port = int(health.rsplit(":", 1)[1]) if health else None
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if not probe:
                continue
            handler = probe.get("grpc") or probe.get("tcpSocket") or probe.get("httpGet") or {}
            port = handler.get("port")
            if isinstance(port, str):
                port = next((n for n, name in declared.items() if name == port), None)
            if port not in declared:
                fail(f"{cw}: {kind} on port {handler.get('port')}, which the container does not declare")
            # The kubelet's gRPC probes speak no TLS: only the plaintext --health-listen port.
            if probe.get("grpc") and port != health_port:
                fail(f"{cw}: {kind} is a gRPC probe on port {port}, which serves TLS (not --health-listen)")
            # An HTTP probe speaks what the port serves (the kubelet does not verify certificates).
            if probe.get("httpGet") and port is not None:
                https = serves_https(c, port)
                scheme = probe["httpGet"].get("scheme", "HTTP")
                if https and scheme != "HTTPS":
                    fail(f"{cw}: {kind} is plain HTTP on port {port}, which serves HTTPS (--tls-cert): it "
                         "would fail every time and the kubelet would restart the process")
                elif not https and scheme == "HTTPS":
                    fail(f"{cw}: {kind} is HTTPS on port {port}, which serves plain HTTP")
        live = c.get("livenessProbe")
        if not live:
            fail(f"{cw}: no livenessProbe")
        else:
            # gRPC health is NOT_SERVING for as long as a heal lasts (and always on a spare):
            # liveness must ask only whether the process answers.
            if live.get("grpc"):
                fail(f"{cw}: livenessProbe is gRPC health, which is NOT_SERVING during a heal: the kubelet "
                     "would kill healing workers")
            if live.get("periodSeconds", 10) * live.get("failureThreshold", 3) < 60:
                fail(f"{cw}: livenessProbe gives up in under 60 s")
        ready = c.get("readinessProbe")
        if role == "worker":
            if not ready or not ready.get("grpc") or ready["grpc"].get("port") != health_port:
                fail(f"{cw}: readiness is not gRPC health on the --health-listen port (SERVING = in the group)")
            start = c.get("startupProbe")
            if start and start.get("grpc"):
                fail(f"{cw}: a gRPC startupProbe kills a worker whose group takes long to form")
        elif role == "spare":
            if ready and ready.get("grpc"):
                fail(f"{cw}: a spare is never SERVING: a gRPC readiness probe keeps it unready for ever")
        elif role == "coordinator":
            if not ready:
                fail(f"{cw}: no readinessProbe")
            elif heal_timeout is not None and \
                    ready.get("periodSeconds", 10) * ready.get("failureThreshold", 3) <= heal_timeout:
                fail(f"{cw}: readiness fails after {ready.get('periodSeconds', 10) * ready.get('failureThreshold', 3)} s, "
                     f"within a heal (HEAL_TIMEOUT_SECONDS={heal_timeout}): new requests would be refused by the "
                     "Service instead of waiting for the heal")
            elif ready.get("httpGet") and flag(c, "tls-cert") and ready["httpGet"].get("scheme") != "HTTPS":
                fail(f"{cw}: readiness is plain HTTP on an HTTPS port")


def ports_allowed(policies, target_labels, peer, port):
    """Whether some policy selecting target_labels lets `peer` reach `port`. peer: ("pod",
    labels) in the same namespace, ("namespace", labels) any pod there, or ("any",)."""
    for p in policies:
        spec = p["spec"]
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]) or \
                not selector_matches(spec.get("podSelector", {}), target_labels):
            continue
        for rule in spec.get("ingress", []):
            rports = rule.get("ports")
            if rports and not any(r.get("port") == port or
                                  (isinstance(r.get("port"), int) and r["port"] <= port <= r.get("endPort", r["port"]))
                                  for r in rports):
                continue
            peers = rule.get("from")
            if not peers:
                return True  # from anywhere
            for f in peers:
                if peer[0] == "pod" and "podSelector" in f and "namespaceSelector" not in f and \
                        selector_matches(f["podSelector"], peer[1]):
                    return True
                if peer[0] == "namespace" and "namespaceSelector" in f and "podSelector" not in f and \
                        selector_matches(f["namespaceSelector"], peer[1]):
                    return True
    return False


def check_network_policies(overlay, kinds, templates):
    policies = kinds.get("NetworkPolicy", [])
    if not any(p["spec"].get("podSelector") == {} and "Ingress" in p["spec"].get("policyTypes", [])
               and not p["spec"].get("ingress") for p in policies):
        fail(f"{overlay}: no default-deny NetworkPolicy (podSelector {{}}, Ingress, no rules)")
    prom = ("namespace", {"kubernetes.io/metadata.name": "monitoring"})
    stranger_pod = ("pod", {"app": "something-else"})
    by_role = {}
    for where, t in templates:
        by_role.setdefault(role_of(t), []).append((where, t))
    if "coordinator" not in by_role or "worker" not in by_role:
        fail(f"{overlay}: no coordinator or no worker pod template")
        return
    coord_labels = by_role["coordinator"][0][1]["metadata"]["labels"]
    for role, items in by_role.items():
        for where, t in items:
            labels = t["metadata"]["labels"]
            who = f"{overlay}: {where}"
            if not any(selector_matches(p["spec"].get("podSelector", {}), labels) for p in policies):
                fail(f"{who}: no NetworkPolicy selects its pods")
            for c in t["spec"]["containers"]:
                for p in c.get("ports", []):
                    port, name = p["containerPort"], p.get("name", "")
                    anyone = ports_allowed(policies, labels, ("any",), port)
                    if name.startswith("metrics"):
                        if anyone or ports_allowed(policies, labels, stranger_pod, port):
                            fail(f"{who}: /metrics port {port} is open beyond the Prometheus namespace")
                        if not ports_allowed(policies, labels, prom, port):
                            fail(f"{who}: /metrics port {port} is not reachable from the Prometheus namespace")
                    elif role == "coordinator":
                        if not anyone:
                            fail(f"{who}: the coordinator's port {name} ({port}) is not reachable by clients and workers")
                    else:  # worker, spare: control and data plane
                        if anyone or ports_allowed(policies, labels, stranger_pod, port):
                            fail(f"{who}: worker port {name} ({port}) is reachable from anywhere, not only the group")
                        if name.startswith("grpc") and not ports_allowed(policies, labels, ("pod", coord_labels), port):
                            fail(f"{who}: worker port {name} ({port}) is not reachable from the coordinator")
            if role in ("worker", "spare"):
                # Collectives listen on ephemeral ports: every port from the group's other workers.
                for peer_where, peer in by_role.get("worker", []) + by_role.get("spare", []):
                    for port in (1024, 40000, 65535):
                        if not ports_allowed(policies, labels, ("pod", peer["metadata"]["labels"]), port):
                            fail(f"{who}: collective port {port} is not reachable from {peer_where}")
                            break
                if ports_allowed(policies, labels, ("pod", coord_labels), 40000):
                    fail(f"{who}: the coordinator may reach the workers' collective ports")


LWS_FIELDS = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE_FIELDS = {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
                       "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"}
CERT_FIELDS = {"secretName", "commonName", "dnsNames", "ipAddresses", "uris", "emailAddresses", "duration",
               "renewBefore", "privateKey", "usages", "issuerRef", "isCA", "subject", "secretTemplate",
               "revisionHistoryLimit", "keystores", "literalSubject", "nameConstraints", "otherNames",
               "encodeUsagesInRequest", "additionalOutputFormats"}


def host_matches(pattern, host):
    """A certificate DNS name (a leading *. covers exactly one label) against a host name."""
    if pattern.startswith("*."):
        return "." in host and host.split(".", 1)[1] == pattern[2:] and host.split(".", 1)[0] != ""
    return pattern == host


def validate_pod(where, template, version):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": dict(template.get("metadata", {}), name="x"),
           "spec": template["spec"]}
    try:
        kubernetes_validate.validate(pod, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        fail(f"{where}: pod template: {e.message} at {'.'.join(str(p) for p in e.path)}")


def check_crd_spec(who, obj, api_version, fields):
    """A CRD object's apiVersion and the names of its spec's fields; returns the spec."""
    if obj.get("apiVersion") != api_version:
        fail(f"{who}: apiVersion {obj.get('apiVersion')}, expected {api_version}")
    spec = obj.get("spec", {})
    extra = set(spec) - fields
    if extra:
        fail(f"{who}: unknown spec fields {sorted(extra)}")
    return spec


def check_lws(overlay, lws, cfg, version):
    who = f"{overlay}: LeaderWorkerSet/{lws['metadata']['name']}"
    spec = check_crd_spec(who, lws, "leaderworkerset.x-k8s.io/v1", LWS_FIELDS)
    t = spec.get("leaderWorkerTemplate", {})
    extra = set(t) - LWS_TEMPLATE_FIELDS
    if extra:
        fail(f"{who}: unknown leaderWorkerTemplate fields {sorted(extra)}")
    # None: a lost pod is re-created alone (same name: it rejoins its slot). The default,
    # RecreateGroupOnPodRestart, restarts the whole group, coordinator included.
    if t.get("restartPolicy") != "None":
        fail(f"{who}: restartPolicy {t.get('restartPolicy')!r}: only None replaces one lost pod alone")
    if t.get("size") != int(cfg["NODES"]) + 1:
        fail(f"{who}: size {t.get('size')} != NODES + 1 ({int(cfg['NODES']) + 1}: the coordinator and the workers)")
    for key in ("leaderTemplate", "workerTemplate"):
        if key not in t:
            fail(f"{who}: no {key}")
        else:
            validate_pod(f"{who} {key}", t[key], version)
    if "leaderTemplate" in t and role_of(t["leaderTemplate"]) != "coordinator":
        fail(f"{who}: the leader is not the coordinator")
    if "workerTemplate" in t:
        for c in t["workerTemplate"]["spec"]["containers"]:
            if is_shardserve(c) and not (flag(c, "coordinator") or "").startswith("$(LWS_LEADER_ADDRESS):"):
                fail(f"{who} worker container {c['name']}: --coordinator is not $(LWS_LEADER_ADDRESS): its own group's leader")


def check_lws_matches_base():
    """overlays/lws/leaderworkerset.yaml is what its generate.py makes of the base's pod templates
    today: the LeaderWorkerSet runs the same pods as the StatefulSet layout."""
    sys.path.insert(0, os.path.join(ROOT, "deploy/k8s/overlays/lws"))
    import generate  # noqa: E402 (deploy/k8s/overlays/lws/generate.py)
    with open(os.path.join(ROOT, "deploy/k8s/overlays/lws/leaderworkerset.yaml"), encoding="utf-8") as f:
        committed = [d for d in yaml.safe_load_all(f) if d]
    if committed != [d for d in yaml.safe_load_all(generate.render()) if d]:
        fail("overlays/lws/leaderworkerset.yaml differs from the base's pod templates: regenerate it with "
             "python3 deploy/k8s/overlays/lws/generate.py")


def check_certificates(overlay, kinds, mounted, coordinator_hosts):
    certs = kinds.get("Certificate", [])
    issuers = {i["metadata"]["name"] for i in kinds.get("Issuer", [])}
    if not certs:
        return  # Secrets made by hand (gpu overlay): docs/deploy.md
    by_secret = {}
    for c in certs:
        who = f"{overlay}: Certificate/{c['metadata']['name']}"
        spec = check_crd_spec(who, c, "cert-manager.io/v1", CERT_FIELDS)
        ref = spec.get("issuerRef", {})
        if ref.get("kind", "Issuer") != "Issuer" or ref.get("name") not in issuers:
            fail(f"{who}: issuerRef {ref} is not an Issuer of this overlay")
        if not spec.get("secretName"):
            fail(f"{who}: no secretName")
        by_secret[spec.get("secretName")] = spec
        if not spec.get("isCA"):
            usages = set(spec.get("usages", []))
            if not {"server auth", "client auth"} <= usages:
                fail(f"{who}: usages {sorted(usages)} lack server auth or client auth")
    for i in kinds.get("Issuer", []):
        ca = i.get("spec", {}).get("ca")
        if ca and ca.get("secretName") not in by_secret:
            fail(f"{overlay}: Issuer/{i['metadata']['name']}: its CA Secret {ca.get('secretName')} comes from no Certificate")
    for s in sorted(mounted):
        if s not in by_secret:
            if "api-keys" not in s:
                fail(f"{overlay}: the pods mount Secret {s}, which no Certificate writes")
    coord = next((spec for name, spec in by_secret.items() if "coordinator" in name), None)
    if coord is None:
        fail(f"{overlay}: no Certificate for the coordinator")
        return
    for host in coordinator_hosts:
        if not any(host_matches(p, host) for p in coord.get("dnsNames", [])):
            fail(f"{overlay}: the coordinator's certificate does not name {host}, which the workers dial "
                 f"(dnsNames {coord.get('dnsNames')})")


def check_prometheus_k8s():
    """deploy/prometheus/prometheus-k8s.yml scrapes the pods' HTTPS /metrics: scheme https, the
    cluster CA and a server name the pods' certificates carry (deploy/k8s/cert-manager)."""
    path = os.path.join(ROOT, "deploy/prometheus/prometheus-k8s.yml")
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    with open(os.path.join(ROOT, "deploy/k8s/cert-manager/certificates.yaml"), encoding="utf-8") as f:
        names = [n for c in yaml.safe_load_all(f) if c and c.get("kind") == "Certificate"
                 for n in c["spec"].get("dnsNames", [])]
    jobs = cfg.get("scrape_configs", [])
    if not jobs:
        fail("prometheus-k8s.yml: no scrape_configs")
    for job in jobs:
        who = f"prometheus-k8s.yml job {job.get('job_name')}"
        tls = job.get("tls_config", {})
        if job.get("scheme") != "https":
            fail(f"{who}: scheme is not https, but the pods serve /metrics over HTTPS (--tls-cert)")
        if not tls.get("ca_file"):
            fail(f"{who}: no tls_config.ca_file (the cluster CA)")
        if tls.get("server_name") not in names:
            fail(f"{who}: tls_config.server_name {tls.get('server_name')!r} is not a name of the certificates in "
                 "deploy/k8s/cert-manager")


def load_rendered(path):
    with open(path, encoding="utf-8") as f:
        return [o for o in yaml.safe_load_all(f) if o]


def check_overlay(overlay, objs, version):
    print(f"{overlay}: {len(objs)} objects")
    kinds = {}
    for o in objs:
        if "kind" not in o:
            fail(f"{overlay}: an object without a kind: {o}")
            continue
        kinds.setdefault(o["kind"], []).append(o)
        what = f"{overlay}: {o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "PodMonitor":
            if o["apiVersion"] != "monitoring.coreos.com/v1":
                fail(f"{what}: apiVersion {o['apiVersion']}")
            continue  # CRD: structural check below
        if o["kind"] in ("Certificate", "Issuer", "LeaderWorkerSet"):
            continue  # CRDs: structural checks below
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            fail(f"{what}: {e.message} at {'.'.join(str(p) for p in e.path)}")
        except Exception as e:  # noqa: BLE001 (schema missing etc.)
            fail(f"{what}: {type(e).__name__}: {e}")
        if o["metadata"].get("namespace", "shardserve") != "shardserve" and o["kind"] != "Namespace":
            fail(f"{what}: namespace {o['metadata'].get('namespace')}")
    lws = kinds.get("LeaderWorkerSet", [])
    wants = ["Service", "ConfigMap", "PodDisruptionBudget", "PodMonitor", "NetworkPolicy"]
    wants += [] if lws else ["Deployment", "StatefulSet"]
    for want in wants:
        if want not in kinds:
            fail(f"{overlay}: no {want}")
    for pm in kinds.get("PodMonitor", []):
        check_podmonitor(pm, objs)

    cms = {c["metadata"]["name"]: c for c in kinds.get("ConfigMap", [])}
    cfg_name, cfg = next(((n, c["data"]) for n, c in cms.items() if n.startswith("shardserve-config")), (None, None))
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
    heal_timeout = int(cfg["HEAL_TIMEOUT_SECONDS"]) if "HEAL_TIMEOUT_SECONDS" in cfg else None
    if heal_timeout is None:
        fail(f"{overlay}: no HEAL_TIMEOUT_SECONDS in shardserve-config")
    templates = list(pod_templates(objs))
    services = {s["metadata"]["name"]: s for s in kinds.get("Service", [])}
    sts = {s["metadata"]["name"]: s for s in kinds.get("StatefulSet", [])}
    coordinator_hosts = []
    if lws:
        for l in lws:
            check_lws(overlay, l, cfg, version)
            ns = l["metadata"].get("namespace", "shardserve")
            coordinator_hosts.append(f"{l['metadata']['name']}-0.{l['metadata']['name']}.{ns}")  # LWS_LEADER_ADDRESS
    else:
        coordinator_hosts.append(cfg["COORDINATOR_ADDRESS"].rsplit(":", 1)[0])
    mounted = set()
    gpu_overlay = cfg["WORKER_DEVICE"].startswith("cuda")
    for owner, where, t in templates:
        spec = t["spec"]
        role = role_of(t)
        who = f"{overlay}: {where}"
        meta = t["metadata"]
        if meta.get("annotations", {}).get("prometheus.io/scrape") != "true" or \
                meta.get("labels", {}).get("app.kubernetes.io/name") != "shardserve":
            fail(f"{who}: deploy/prometheus/prometheus-k8s.yml would not discover it (label, annotation)")
        if role not in ("coordinator", "worker", "spare"):
            fail(f"{who}: label app.kubernetes.io/component is {role!r}, not coordinator, worker or spare")
        if owner["kind"] == "LeaderWorkerSet" and not any("envFrom" in c and any(
                e.get("configMapRef", {}).get("name") == cfg_name for e in c["envFrom"]) for c in spec["containers"]):
            fail(f"{who}: its containers do not read the generated ConfigMap {cfg_name} (kustomize configurations)")
        check_security(overlay, where, spec)
        mounted |= check_tls(overlay, where, spec, role)
        check_probes(overlay, where, spec, role, heal_timeout)
        workers = [c for c in spec["containers"] if is_shardserve(c) and flag(c, "node") is not None]
        # Stable identity: a worker's node name is its pod's name, which only a StatefulSet (or
        # an LWS, whose workers are StatefulSet pods) keeps across restarts.
        if workers and owner["kind"] == "Deployment":
            fail(f"{who}: workers in a Deployment: their pods get new names, and a restarted worker no slot")
        if role == "worker":
            if len(workers) != gpus:
                fail(f"{who}: {len(workers)} worker containers per pod != GPUS_PER_NODE {gpus}")
            if owner["kind"] == "StatefulSet":
                if owner["spec"]["replicas"] != nodes:
                    fail(f"{who}: replicas {owner['spec']['replicas']} != NODES {nodes}")
                headless = services.get(owner["spec"].get("serviceName"))
                if not headless or headless["spec"].get("clusterIP") != "None":
                    fail(f"{who}: the StatefulSet's serviceName is not a headless Service")
        if not spec.get("securityContext", {}).get("runAsNonRoot"):
            fail(f"{who}: not runAsNonRoot")
        for c in spec["containers"]:
            if not any(re.fullmatch(r"metrics(-[0-9]+)?", p.get("name", "")) for p in c.get("ports", [])):
                fail(f"{who} container {c['name']}: no port named metrics or metrics-<k> (scrape configs)")
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
            if c in spec.get("initContainers", []):
                continue
            for p in c.get("ports", []):
                if p["containerPort"] in seen_ports:
                    fail(f"{cw}: port {p['containerPort']} used twice in the pod")
                seen_ports.add(p["containerPort"])
            if flag(c, "metrics-listen") is None or not flag(c, "metrics-listen").startswith("0.0.0.0:"):
                fail(f"{cw}: no --metrics-listen on all addresses")
            if c in workers:
                env = {e["name"]: e for e in c.get("env", [])}
                field = lambda n: env.get(n, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                if flag(c, "collective-host") != "$(POD_IP)" or field("POD_IP") != "status.podIP":
                    fail(f"{cw}: --collective-host must be the pod IP")
                if role == "spare":
                    if flag(c, "spare") is None:
                        fail(f"{cw}: a spare without --spare")
                    worker_sts = next((n for n, s in sts.items() if role_of(s["spec"]["template"]) == "worker"), None)
                    if flag(c, "node") != f"{worker_sts}-$(POD_INDEX)" or \
                            field("POD_INDEX") != "metadata.labels['apps.kubernetes.io/pod-index']":
                        fail(f"{cw}: a spare's --node must be worker pod k's name ({worker_sts}-$(POD_INDEX), "
                             "POD_INDEX from the label apps.kubernetes.io/pod-index): the coordinator gives a spare "
                             "only slots of its own node")
                else:
                    if flag(c, "spare") is not None:
                        fail(f"{cw}: a worker with --spare")
                    if flag(c, "node") != "$(POD_NAME)" or field("POD_NAME") != "metadata.name":
                        fail(f"{cw}: --node must be the pod name (downward API metadata.name): the stable "
                             "identity that gets a restarted worker its slot back")
                gpu = r.get("limits", {}).get("nvidia.com/gpu")
                if gpu_overlay and str(gpu) != "1":
                    fail(f"{cw}: gpu overlay: nvidia.com/gpu limit {gpu}, expected 1")
                if not gpu_overlay and gpu is not None:
                    fail(f"{cw}: cpu-demo requests a GPU")
        if gpu_overlay and role in ("worker", "spare"):
            aff = spec.get("affinity", {}).get("podAntiAffinity", {})
            if not aff.get("requiredDuringSchedulingIgnoredDuringExecution"):
                fail(f"{who}: gpu overlay: pods are not forced onto distinct nodes")
    if not lws and not any(role_of(s["spec"]["template"]) == "spare" for s in sts.values()):
        fail(f"{overlay}: no spare StatefulSet")
    check_network_policies(overlay, kinds, [(w, t) for _, w, t in templates])
    check_certificates(overlay, kinds, mounted, coordinator_hosts)


# ---- Self-test: each defect the checks exist for, made in a copy of a rendering, must fail ----

def find(objs, kind, name):
    return next(o for o in objs if o.get("kind") == kind and o["metadata"]["name"] == name)


def sts_pod(objs, name="shardserve-worker"):
    return find(objs, "StatefulSet", name)["spec"]["template"]["spec"]


def deploy_pod(objs):
    return find(objs, "Deployment", "shardserve-coordinator")["spec"]["template"]["spec"]


def set_args(container, fn):
    container["args"] = fn(container["args"])


def lws_spec(objs):
    return next(o for o in objs if o.get("kind") == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]


# (what, overlay kind: "sts" (cpu-demo) or "lws", defect, words the failure must contain)
DEFECTS = [
    ("a worker without readOnlyRootFilesystem", "sts",
     lambda o: sts_pod(o)["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"), "readOnlyRootFilesystem"),
    ("a coordinator that may escalate privileges", "sts",
     lambda o: deploy_pod(o)["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
     "allowPrivilegeEscalation"),
    ("capabilities not dropped", "sts",
     lambda o: sts_pod(o, "shardserve-spare")["containers"][1]["securityContext"].pop("capabilities"), "capabilities"),
    ("no seccomp profile", "sts", lambda o: sts_pod(o)["securityContext"].pop("seccompProfile"), "seccompProfile"),
    ("a pod running as root", "sts", lambda o: deploy_pod(o)["securityContext"].update(runAsNonRoot=False, runAsUser=0),
     "root"),
    ("workers in a Deployment", "sts", lambda o: find(o, "StatefulSet", "shardserve-worker").update(kind="Deployment"),
     "workers in a Deployment"),
    ("a worker whose node name is not its pod name", "sts",
     lambda o: set_args(sts_pod(o)["containers"][1], lambda a: [x.replace("$(POD_NAME)", "n0") for x in a]),
     "--node must be the pod name"),
    ("a spare that backs no worker pod", "sts",
     lambda o: set_args(sts_pod(o, "shardserve-spare")["containers"][0],
                        lambda a: [x.replace("shardserve-worker-$(POD_INDEX)", "$(POD_NAME)") for x in a]),
     "a spare's --node"),
    ("a worker without --tls-ca", "sts",
     lambda o: set_args(sts_pod(o)["containers"][1], lambda a: [x for x in a if not x.startswith("--tls-ca")]),
     "no --tls-ca"),
    ("a coordinator without --tls-cert", "lws",
     lambda o: set_args(lws_spec(o)["leaderTemplate"]["spec"]["containers"][0],
                        lambda a: [x for x in a if not x.startswith("--tls-cert")]), "no --tls-cert"),
    ("a coordinator without API keys", "sts",
     lambda o: set_args(deploy_pod(o)["containers"][0], lambda a: [x for x in a if not x.startswith("--api-keys-file")]),
     "no --api-keys-file"),
    ("--insecure", "sts", lambda o: deploy_pod(o)["containers"][0]["args"].append("--insecure"), "--insecure"),
    ("certificates from a subPath mount", "sts",
     lambda o: sts_pod(o)["containers"][0]["volumeMounts"][1].update(subPath="tls.crt"), "subPath"),
    ("no default-deny NetworkPolicy", "sts", lambda o: o.remove(find(o, "NetworkPolicy", "shardserve-default-deny")),
     "default-deny"),
    ("no NetworkPolicy for the workers", "sts", lambda o: o.remove(find(o, "NetworkPolicy", "shardserve-worker")),
     "collective port"),
    ("worker ports open to all", "lws",
     lambda o: find(o, "NetworkPolicy", "shardserve-worker")["spec"]["ingress"].append({}), "reachable from anywhere"),
    ("metrics open to all", "sts",
     lambda o: find(o, "NetworkPolicy", "shardserve-coordinator")["spec"]["ingress"][0]["ports"].append({"port": 9400}),
     "/metrics port 9400"),
    ("gRPC health as a worker's liveness", "sts",
     lambda o: sts_pod(o)["containers"][0].update(livenessProbe={"grpc": {"port": 50071}, "periodSeconds": 10,
                                                                 "failureThreshold": 6}), "during a heal"),
    ("a gRPC probe on a TLS port", "sts",
     lambda o: sts_pod(o)["containers"][1]["readinessProbe"].update(grpc={"port": 50062}), "serves TLS"),
    ("a coordinator that turns unready within a heal", "sts",
     lambda o: deploy_pod(o)["containers"][0]["readinessProbe"].update(failureThreshold=2), "within a heal"),
    ("an LWS that restarts the whole group", "lws",
     lambda o: lws_spec(o).update(restartPolicy="RecreateGroupOnPodRestart"), "restartPolicy"),
    ("an LWS group of the wrong size", "lws", lambda o: lws_spec(o).update(size=2), "size 2"),
    ("a /metrics liveness probe in plain HTTP", "sts",
     lambda o: deploy_pod(o)["containers"][0]["livenessProbe"]["httpGet"].pop("scheme"),
     "livenessProbe is plain HTTP on port 9400, which serves HTTPS"),
    ("a worker's /metrics liveness probe in plain HTTP", "lws",
     lambda o: lws_spec(o)["workerTemplate"]["spec"]["containers"][1]["livenessProbe"]["httpGet"].pop("scheme"),
     "which serves HTTPS"),
    ("a PodMonitor scraping HTTPS /metrics in plain HTTP", "sts",
     lambda o: find(o, "PodMonitor", "shardserve-worker")["spec"]["podMetricsEndpoints"][0].pop("scheme"),
     "scrapes port metrics-0 without scheme https"),
    ("a PodMonitor without the cluster CA", "lws",
     lambda o: find(o, "PodMonitor", "shardserve-coordinator")["spec"]["podMetricsEndpoints"][0].pop("tlsConfig"),
     "no tlsConfig.ca"),
    ("a PodMonitor checking a name the certificate lacks", "sts",
     lambda o: find(o, "PodMonitor", "shardserve-worker")["spec"]["podMetricsEndpoints"][1]["tlsConfig"].update(
         serverName="shardserve-coordinator"), "is not a name of the certificate"),
    ("--metrics-plaintext with an HTTPS liveness probe", "sts",
     lambda o: deploy_pod(o)["containers"][0]["args"].append("--metrics-plaintext"), "which serves plain HTTP"),
    ("a certificate that does not name the coordinator", "sts",
     lambda o: find(o, "Certificate", "shardserve-coordinator-tls")["spec"].update(dnsNames=["x"]), "does not name"),
]


def self_test(renders, version):
    """Each DEFECTS entry must make check_overlay fail with its words; the renders themselves
    are checked (clean) by main before."""
    global failures
    kept, bad = failures, []
    for what, kind, defect, words in DEFECTS:
        name, objs = next(((n, o) for n, o in renders if any(x.get("kind") == "LeaderWorkerSet" for x in o) == (kind == "lws")),
                          (None, None))
        if objs is None:
            bad.append(f"self-test: no {kind} rendering to break")
            continue
        objs = copy.deepcopy(objs)
        defect(objs)
        failures = []
        with contextlib.redirect_stdout(io.StringIO()):
            check_overlay(f"{name} with {what}", objs, version)
        if not any(words in f for f in failures):
            bad.append(f"self-test: {what}: the checks did not fail with {words!r} (failures: {failures})")
    failures = kept
    for b in bad:
        fail(b)
    print(f"self-test: {len(DEFECTS) - len(bad)} of {len(DEFECTS)} defects caught")


def main():
    version = sys.argv[1]
    renders = []
    for arg in sys.argv[2:]:
        overlay, path = arg.split("=", 1)
        renders.append((overlay, load_rendered(path)))
        check_overlay(overlay, renders[-1][1], version)
    if not any(o.get("kind") == "LeaderWorkerSet" for _, objs in renders for o in objs):
        fail("no rendering with a LeaderWorkerSet: overlays/lws did not render")
    check_lws_matches_base()
    check_prometheus_k8s()
    self_test(renders, version)
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print("deploy_k8s_check.py: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
