"""Loopback stand-ins for a Kubernetes API server and a DCGM exporter, for the backend's tests.

No API server can run on these machines, so `FakeKube` serves, over real HTTP on 127.0.0.1,
the subset of the core/v1 REST API the Kubernetes backend uses (version, nodes, namespaces,
pods: list with label selectors, create, read, delete), with objects shaped like the API
reference's (kind/apiVersion, metadata.resourceVersion/uid/creationTimestamp, Status objects
for 401/404/409/500) and bearer-token authentication. The backend reaches it through the real
`kubernetes` client and a generated kubeconfig file, so the client's serialisation and HTTP
are exercised. Tests script faults (a status for the next N matching calls, or a delay longer
than the client's timeout) and move pods through their phases. `FakeDcgm` serves a
Prometheus text exposition. Test helpers only: never imported by application code.
"""

from __future__ import annotations

import copy
import datetime as dt
import itertools
import json
import re
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

TOKEN = "atrium-test-token"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details or {}, "code": code}


H100_LABELS = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559",
               "nvidia.com/gpu.family": "hopper", "nvidia.com/cuda.driver.major": "550"}


def gpu_node(name: str, *, product: str = "NVIDIA-H100-80GB-HBM3", count: int = 8, memory_mib: int = 81559,
             pool: str | None = "train", mig: dict | None = None, shared_replicas: int = 0,
             amd: bool = False, cpu: str = "128", memory: str = "1056762744Ki", ready: bool = True,
             unschedulable: bool = False, taints: list | None = None, extra_labels: dict | None = None) -> dict:
    """A Node as the API returns it, labelled the way GPU Feature Discovery labels one."""
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
              "beta.kubernetes.io/os": "linux", "node.kubernetes.io/instance-type": "gpu-node"}
    alloc = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1844344404Ki",
             "hugepages-1Gi": "0", "hugepages-2Mi": "0"}
    if amd:
        labels.update({"amd.com/gpu.family": "AI", "amd.com/gpu.product-name": product, "amd.com/gpu.vram": "192G",
                       "amd.com/gpu.device-id": "74a1"})
        alloc["amd.com/gpu"] = str(count)
    else:
        labels.update({"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(memory_mib),
                       "nvidia.com/gpu.count": str(count), "nvidia.com/gpu.present": "true",
                       "nvidia.com/mig.capable": "true" if mig is not None else "false",
                       "nvidia.com/mig.strategy": "mixed" if mig else "none",
                       "nvidia.com/gpu.sharing-strategy": "time-slicing" if shared_replicas else "none",
                       "nvidia.com/gpu.replicas": str(shared_replicas or 1),
                       "nvidia.com/gfd.timestamp": "1718000000"})
        if mig:
            for profile, n in mig.items():
                alloc[f"nvidia.com/mig-{profile}"] = str(n)
                labels[f"nvidia.com/mig-{profile}.count"] = str(n)
            alloc["nvidia.com/gpu"] = "0"
        elif shared_replicas:
            alloc["nvidia.com/gpu.shared"] = str(count * shared_replicas)
        else:
            alloc["nvidia.com/gpu"] = str(count)
    if pool:
        labels["atrium.io/pool"] = pool
    labels.update(extra_labels or {})
    hb = _now()
    conditions = [
        {"type": t, "status": "False", "lastHeartbeatTime": hb, "lastTransitionTime": "2024-06-01T10:00:00Z",
         "reason": f"KubeletHasSufficient{t.replace('Pressure', '')}", "message": f"kubelet has no {t}"}
        for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
    ]
    conditions.append({"type": "Ready", "status": "True" if ready else "Unknown", "lastHeartbeatTime": hb,
                       "lastTransitionTime": "2024-06-01T10:00:00Z",
                       "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                       "message": "kubelet is posting ready status" if ready else "Kubelet stopped posting node status."})
    spec = {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"], "providerID": f"metal://{name}"}
    if unschedulable:
        spec["unschedulable"] = True
    all_taints = list(taints or [])
    if unschedulable:
        all_taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule",
                           "timeAdded": "2024-06-02T08:00:00Z"})
    if all_taints:
        spec["taints"] = all_taints
    return {
        "metadata": {"name": name, "uid": str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, name)), "resourceVersion": "1",
                     "creationTimestamp": "2024-06-01T10:00:00Z", "labels": labels,
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                                     "volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
        "spec": spec,
        "status": {
            "capacity": dict(alloc), "allocatable": alloc, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "10.0.0.10"}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": "a" * 32, "systemUUID": str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, name)),
                         "bootID": "b" * 32, "kernelVersion": "5.15.0-105-generic", "osImage": "Ubuntu 22.04.4 LTS",
                         "containerRuntimeVersion": "containerd://1.7.13", "kubeletVersion": "v1.30.2",
                         "kubeProxyVersion": "v1.30.2", "operatingSystem": "linux", "architecture": "amd64"},
        },
    }


@dataclass
class Fault:
    method: str
    pattern: re.Pattern
    status: int = 500
    delay: float = 0.0
    times: int = 1


# (method, path regex) -> RBAC (apiGroup, resource, verb); list vs get decided by the path.
ROUTES = [
    ("GET", r"^/version/?$", ("", "/version", "get")),
    ("GET", r"^/api/v1/nodes$", ("", "nodes", "list")),
    ("GET", r"^/api/v1/nodes/(?P<name>[^/]+)$", ("", "nodes", "get")),
    ("GET", r"^/api/v1/namespaces$", ("", "namespaces", "list")),
    ("POST", r"^/api/v1/namespaces$", ("", "namespaces", "create")),
    ("GET", r"^/api/v1/namespaces/(?P<name>[^/]+)$", ("", "namespaces", "get")),
    ("GET", r"^/api/v1/pods$", ("", "pods", "list")),
    ("GET", r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods$", ("", "pods", "list")),
    ("POST", r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods$", ("", "pods", "create")),
    ("GET", r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)$", ("", "pods", "get")),
    ("DELETE", r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)$", ("", "pods", "delete")),
    ("POST", r"^/api/v1/namespaces/(?P<ns>[^/]+)/resourcequotas$", ("", "resourcequotas", "create")),
    ("GET", r"^/api/v1/namespaces/(?P<ns>[^/]+)/resourcequotas/(?P<name>[^/]+)$", ("", "resourcequotas", "get")),
    ("PUT", r"^/api/v1/namespaces/(?P<ns>[^/]+)/resourcequotas/(?P<name>[^/]+)$", ("", "resourcequotas", "update")),
]


def selector_matches(selector: str, labels: dict) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class FakeKube:
    """The API server stand-in. State lives in plain dicts guarded by one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.nodes: dict[str, dict] = {}
        self.namespaces: dict[str, dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.quotas: dict[tuple[str, str], dict] = {}
        self.faults: list[Fault] = []
        self.calls: list[tuple[str, str, tuple]] = []  # (method, path, rbac triple)
        self.graceful_delete = False
        self._rv = itertools.count(1000)
        for ns in ("default", "kube-system"):
            self._add_namespace(ns, {})
        server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        server.daemon_threads = True
        self.server = server
        self.port = server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> FakeKube:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def write_kubeconfig(self, path, token: str = TOKEN) -> str:
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "atrium", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "atrium"}}],
        }
        with open(path, "w") as fh:
            json.dump(cfg, fh)  # JSON is YAML: the client's loader reads it as written
        return str(path)

    # -- scripting --------------------------------------------------------------------

    def rv(self) -> str:
        return str(next(self._rv))

    def add_node(self, node: dict) -> None:
        with self.lock:
            node = copy.deepcopy(node)
            node["metadata"]["resourceVersion"] = self.rv()
            self.nodes[node["metadata"]["name"]] = node

    def remove_node(self, name: str) -> None:
        with self.lock:
            self.nodes.pop(name, None)

    def fail(self, method: str, path_regex: str, status_code: int = 500, times: int = 1) -> None:
        self.faults.append(Fault(method, re.compile(path_regex), status=status_code, times=times))

    def stall(self, method: str, path_regex: str, seconds: float, times: int = 1) -> None:
        self.faults.append(Fault(method, re.compile(path_regex), status=0, delay=seconds, times=times))

    def set_phase(self, ns: str, name: str, phase: str, *, exit_code: int | None = None,
                  reason: str | None = None) -> None:
        with self.lock:
            pod = self.pods[(ns, name)]
            st = pod["status"]
            st["phase"] = phase
            container = pod["spec"]["containers"][0]
            cs = {"name": container["name"], "image": container["image"],
                  "imageID": f"docker.io/{container['image']}@sha256:{'0' * 64}", "ready": phase == "Running",
                  "restartCount": 0, "started": phase == "Running", "containerID": f"containerd://{'c' * 64}"}
            if phase == "Running":
                st["startTime"] = st.get("startTime") or _now()
                cs["state"] = {"running": {"startedAt": st["startTime"]}}
            elif phase in ("Succeeded", "Failed"):
                st["startTime"] = st.get("startTime") or _now()
                code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
                cs["state"] = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                              "startedAt": st["startTime"], "finishedAt": _now(),
                                              "containerID": cs["containerID"]}}
            if reason:
                st["reason"] = reason
                st["message"] = f"Pod {reason.lower()}"
            st["containerStatuses"] = [cs]
            pod["metadata"]["resourceVersion"] = self.rv()

    def finish_deletions(self) -> None:
        with self.lock:
            for key in [k for k, p in self.pods.items() if p["metadata"].get("deletionTimestamp")]:
                del self.pods[key]

    def pod(self, ns: str, name: str) -> dict | None:
        return self.pods.get((ns, name))

    def pod_names(self) -> set[str]:
        return {f"{ns}/{name}" for ns, name in self.pods}

    def add_pod(self, ns: str, manifest: dict) -> None:
        """A pod someone else created (e.g. without Atrium's labels)."""
        with self.lock:
            self._add_namespace(ns, {})
            self._create_pod(ns, copy.deepcopy(manifest))

    def rbac_used(self) -> set[tuple]:
        return {c[2] for c in self.calls if c[2] is not None}

    # -- the API ----------------------------------------------------------------------

    def _add_namespace(self, name: str, labels: dict) -> dict:
        ns = {"apiVersion": "v1", "kind": "Namespace",
              "metadata": {"name": name, "uid": str(uuidlib.uuid4()), "resourceVersion": self.rv(),
                           "creationTimestamp": _now(),
                           "labels": {"kubernetes.io/metadata.name": name, **labels}},
              "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
        self.namespaces[name] = ns
        return ns

    def _create_pod(self, ns: str, body: dict) -> dict:
        meta = body.setdefault("metadata", {})
        meta.update({"namespace": ns, "uid": str(uuidlib.uuid4()), "resourceVersion": self.rv(),
                     "creationTimestamp": _now()})
        body["apiVersion"], body["kind"] = "v1", "Pod"
        spec = body.setdefault("spec", {})
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("dnsPolicy", "ClusterFirst")
        body["status"] = {"phase": "Pending", "qosClass": "Burstable"}
        self.pods[(ns, meta["name"])] = body
        return body

    def handle(self, method: str, raw_path: str, headers, body: bytes) -> tuple[int, dict]:
        parsed = urlparse(raw_path)
        path, query = parsed.path, parse_qs(parsed.query)
        route, match = None, None
        for m, pattern, rbac in ROUTES:
            if m == method:
                match = re.match(pattern, path)
                if match:
                    route = rbac
                    break
        verb = route
        if route and route[2] == "list" and query.get("watch", ["false"])[0] in ("true", "1"):
            verb = (route[0], route[1], "watch")
        with self.lock:
            self.calls.append((method, path, verb))
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and fault.pattern.search(path):
                    fault.times -= 1
                    if fault.delay:
                        delay = fault.delay
                        break
                    return fault.status, status(fault.status, "InternalError",
                                                "Internal error occurred: injected by the test")
            else:
                delay = 0.0
        if delay:
            time.sleep(delay)
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, status(401, "Unauthorized", "Unauthorized")
        if route is None:
            return 404, status(404, "NotFound", "the server could not find the requested resource")
        with self.lock:
            return self._dispatch(method, route, match.groupdict(), query, body)

    def _dispatch(self, method, route, args, query, body) -> tuple[int, dict]:
        _, resource, verb = route
        selector = query.get("labelSelector", [""])[0]
        list_meta = {"resourceVersion": self.rv()}
        if resource == "/version":
            return 200, {"major": "1", "minor": "30", "gitVersion": "v1.30.2",
                         "gitCommit": "39683505b630ff2121012f3c5b16215a1449d5ed",
                         "gitTreeState": "clean", "buildDate": "2024-06-11T20:21:00Z", "goVersion": "go1.22.4",
                         "compiler": "gc", "platform": "linux/amd64"}
        if resource == "nodes":
            if verb == "list":
                items = [n for n in self.nodes.values() if selector_matches(selector, n["metadata"]["labels"])]
                return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": list_meta, "items": items}
            node = self.nodes.get(args["name"])
            if node is None:
                return 404, status(404, "NotFound", f'nodes "{args["name"]}" not found',
                                   {"name": args["name"], "kind": "nodes"})
            return 200, {"kind": "Node", "apiVersion": "v1", **node}
        if resource == "namespaces":
            if verb == "list":
                return 200, {"kind": "NamespaceList", "apiVersion": "v1", "metadata": list_meta,
                             "items": list(self.namespaces.values())}
            if verb == "create":
                data = json.loads(body or b"{}")
                name = data.get("metadata", {}).get("name", "")
                if name in self.namespaces:
                    return 409, status(409, "AlreadyExists", f'namespaces "{name}" already exists',
                                       {"name": name, "kind": "namespaces"})
                return 201, self._add_namespace(name, data["metadata"].get("labels", {}))
            ns = self.namespaces.get(args["name"])
            if ns is None:
                return 404, status(404, "NotFound", f'namespaces "{args["name"]}" not found',
                                   {"name": args["name"], "kind": "namespaces"})
            return 200, ns
        ns = args.get("ns")
        if resource == "resourcequotas":
            return self._quota(verb, ns, args.get("name"), body)
        # pods
        if verb == "list":
            items = [p for (pns, _), p in sorted(self.pods.items())
                     if (ns is None or pns == ns) and selector_matches(selector, p["metadata"].get("labels", {}))]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": list_meta, "items": items}
        if verb == "create":
            data = json.loads(body or b"{}")
            name = data.get("metadata", {}).get("name", "")
            if ns not in self.namespaces:
                return 404, status(404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})
            if (ns, name) in self.pods:
                return 409, status(409, "AlreadyExists", f'pods "{name}" already exists', {"name": name, "kind": "pods"})
            return 201, self._create_pod(ns, data)
        pod = self.pods.get((ns, args["name"]))
        if pod is None:
            return 404, status(404, "NotFound", f'pods "{args["name"]}" not found', {"name": args["name"], "kind": "pods"})
        if verb == "get":
            return 200, pod
        grace = query.get("gracePeriodSeconds", [None])[0]
        if body:
            grace = json.loads(body).get("gracePeriodSeconds", grace)
        pod["metadata"]["deletionGracePeriodSeconds"] = int(grace) if grace is not None else 30
        pod["metadata"]["deletionTimestamp"] = _now()
        pod["metadata"]["resourceVersion"] = self.rv()
        if not self.graceful_delete:
            del self.pods[(ns, args["name"])]
        return 200, pod

    def _quota(self, verb, ns, name, body) -> tuple[int, dict]:
        if ns not in self.namespaces:
            return 404, status(404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})
        if verb == "get":
            quota = self.quotas.get((ns, name))
            if quota is None:
                return 404, status(404, "NotFound", f'resourcequotas "{name}" not found',
                                   {"name": name, "kind": "resourcequotas"})
            return 200, quota
        data = json.loads(body or b"{}")
        name = name or data["metadata"]["name"]
        existing = self.quotas.get((ns, name))
        if verb == "create" and existing is not None:
            return 409, status(409, "AlreadyExists", f'resourcequotas "{name}" already exists',
                               {"name": name, "kind": "resourcequotas"})
        if verb == "update":
            if existing is None:
                return 404, status(404, "NotFound", f'resourcequotas "{name}" not found',
                                   {"name": name, "kind": "resourcequotas"})
            if data["metadata"].get("resourceVersion") != existing["metadata"]["resourceVersion"]:
                return 409, status(409, "Conflict", f'Operation cannot be fulfilled on resourcequotas "{name}": '
                                   "the object has been modified; please apply your changes to the latest version",
                                   {"name": name, "kind": "resourcequotas"})
        data["metadata"].update({"namespace": ns, "resourceVersion": self.rv(), "creationTimestamp": _now(),
                                 "uid": (existing or {}).get("metadata", {}).get("uid", str(uuidlib.uuid4()))})
        data["apiVersion"], data["kind"] = "v1", "ResourceQuota"
        data["status"] = {"hard": data["spec"]["hard"], "used": {k: "0" for k in data["spec"]["hard"]}}
        self.quotas[(ns, name)] = data
        return (201 if verb == "create" else 200), data

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                code, payload = fake.handle(self.command, self.path, self.headers, body)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test): nothing to answer

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

            def log_message(self, *args):
                pass

        return Handler


class FakeDcgm:
    """A DCGM exporter stand-in: GET /metrics answers `text` in the Prometheus text format."""

    def __init__(self, text: str = ""):
        self.text = text
        self.status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                data = fake.text.encode()
                self.send_response(fake.status if self.path.startswith("/metrics") else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeDcgm:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


DCGM_HEADER = """# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
# HELP DCGM_FI_DEV_ECC_DBE_VOL_TOTAL Total number of double-bit volatile ECC errors.
# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter
# HELP DCGM_EXP_GPU_HEALTH_STATUS GPU health status from DCGM health watches (0 pass, 10 warn, 20 fail).
# TYPE DCGM_EXP_GPU_HEALTH_STATUS gauge
"""


def dcgm_text(cards: list[dict]) -> str:
    """An exposition for cards given as {hostname, gpu, uuid, model, xid, dbe, health, pod, namespace}."""
    lines = [DCGM_HEADER.rstrip("\n")]
    for c in cards:
        labels = (f'gpu="{c["gpu"]}",UUID="{c["uuid"]}",pci_bus_id="00000000:{0x18 + c["gpu"]:02X}:00.0",'
                  f'device="nvidia{c["gpu"]}",modelName="{c.get("model", "NVIDIA H100 80GB HBM3")}",'
                  f'Hostname="{c["hostname"]}",DCGM_FI_DRIVER_VERSION="550.54.15"')
        if c.get("pod"):
            labels += f',container="main",namespace="{c["namespace"]}",pod="{c["pod"]}"'
        lines.append(f"DCGM_FI_DEV_SM_CLOCK{{{labels}}} 1980")
        lines.append(f"DCGM_FI_DEV_XID_ERRORS{{{labels},err_code=\"{c.get('xid', 0)}\"}} {c.get('xid', 0)}")
        lines.append(f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{labels}}} {c.get('dbe', 0)}")
        lines.append(f"DCGM_EXP_GPU_HEALTH_STATUS{{{labels}}} {c.get('health', 0)}")
    return "\n".join(lines) + "\n"
