"""The Kubernetes backend: inventory and health from the cluster, admitted jobs run as pods.

`KubernetesCluster` has the SimulatedCluster's interface (`tick(now)`, `inject_fault`) and
three level-based steps the RQ jobs in scheduling.k8s_jobs call on their own:
`sync_inventory` (GPU Feature Discovery labels, allocatable resources, conditions, cordon),
`sync_health` (DCGM exporter metrics through the shared health policy) and `reconcile`
(compare what the portal decided with the pods that exist: create what is missing, delete
what should not run, move job states from pod phases). It talks to the API server only
through the official `kubernetes` client.

What it must never do: decide placement or admission (the cycle does), touch a cluster object
that does not carry Atrium's managed-by label, or write a job state the cluster did not
report. An API error or timeout half-way leaves every row it already changed consistent (one
transaction per job, states re-checked under a row lock) and the next run converges.
The inventory "upsert" helpers below are a thin service layer for writes scheduling.services
has no function for yet (they audit as `service:kubernetes`); see docs/kubernetes.md.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

import urllib3
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.utils import parse_quantity

from portal import audit, context
from scheduling import services
from scheduling.backends import dcgm
from scheduling.models import (
    ACTIVE_STATES,
    Accelerator,
    AcceleratorModel,
    Binding,
    BindingEnd,
    HealthEvent,
    Job,
    JobEvent,
    JobState,
    Node,
    NodeState,
    ResourcePool,
    ShareMode,
    WaitReason,
)

log = logging.getLogger(__name__)

SERVICE = "service:kubernetes"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_SELECTOR = f"{MANAGED_BY}=atrium"
LABEL_JOB = "atrium.io/job"
LABEL_REPLICA = "atrium.io/replica"
LABEL_TENANT = "atrium.io/tenant"
LABEL_PROJECT = "atrium.io/project"
LABEL_PRIORITY = "atrium.io/priority-class"
ANN_CARDS = "atrium.io/cards"
ANN_ADMISSION = "atrium.io/admission"
HOSTNAME_LABEL = "kubernetes.io/hostname"

# Pod failure reasons that are the platform's fault, not the job's: the job is requeued.
INFRA_FAILURES = {"Evicted", "NodeLost", "Shutdown", "Terminated", "NodeShutdown", "UnexpectedAdmissionError",
                  "OutOfnvidia.com/gpu", "OutOfamd.com/gpu", "Preempting"}
PRESSURE_CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure")
DOWN_TAINTS = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable", "node.kubernetes.io/out-of-service"}
SYNC_REASON = "kubernetes: "  # node states the sync set start with this; others are ops' own


def setting(name: str, default):
    return getattr(settings, name, default)


class ClusterUnavailable(Exception):
    """The API server cannot be used now; the message is one sentence for an operator."""


# --- connection -------------------------------------------------------------------------


def kubeconfig_path() -> str:
    return setting("ATRIUM_K8S_KUBECONFIG", "") or os.environ.get("KUBECONFIG", "")


def make_api_client() -> client.ApiClient:
    """A client from KUBECONFIG (or ATRIUM_K8S_KUBECONFIG), else the pod's service account."""
    cfg = client.Configuration()
    path = kubeconfig_path()
    try:
        if path:
            config.load_kube_config(config_file=path, context=setting("ATRIUM_K8S_CONTEXT", None) or None,
                                    client_configuration=cfg, persist_config=False)
            where = f"the kubeconfig {path}"
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)
            where = "the in-cluster service account"
        else:
            raise ClusterUnavailable("No Kubernetes connection is configured: set KUBECONFIG to a kubeconfig file "
                                     "or run Atrium in a pod with a service account.")
    except (ConfigException, OSError, ValueError, TypeError) as exc:
        raise ClusterUnavailable(f"The Kubernetes connection could not be configured from "
                                 f"{path or 'the in-cluster service account'}: {exc}.") from exc
    # No hidden urllib3 retries: a failed call fails now, and the next periodic run retries.
    cfg.retries = False
    api = client.ApiClient(cfg)
    api.atrium_source = where
    return api


def describe_api_error(exc: Exception, what: str) -> str:
    if isinstance(exc, ApiException):
        if exc.status in (401, 403):
            return f"The Kubernetes API refused to {what} (HTTP {exc.status} {exc.reason}): check the credentials and RBAC."
        return f"The Kubernetes API failed to {what} (HTTP {exc.status} {exc.reason})."
    return f"The Kubernetes API could not be reached to {what}: {exc}."


# --- reading nodes ----------------------------------------------------------------------


@dataclass
class DiscoveredNode:
    name: str
    hostname: str
    pool: str
    cpu_milli: int
    memory_mib: int
    labels: dict
    vendor: str
    product: str
    memory_gib: int
    cards: int
    mig_profiles: dict = field(default_factory=dict)  # profile -> allocatable count
    shared_replicas: int = 0  # time-slicing / MPS replicas per card (0: not shared)
    state: str = NodeState.READY
    state_reason: str = ""

    @property
    def mig(self) -> bool:
        return bool(self.mig_profiles)


def _int(value, default: int = 0) -> int:
    try:
        return int(parse_quantity(value))
    except (ValueError, TypeError, ArithmeticError):
        return default


def node_state(v1node) -> tuple[str, str]:
    """The portal state of a node from its Ready condition, pressure conditions, taints, cordon."""
    conditions = {c.type: c for c in (v1node.status.conditions or [])} if v1node.status else {}
    ready = conditions.get("Ready")
    if ready is None or ready.status != "True":
        why = (ready.reason or ready.message or ready.status) if ready else "no Ready condition"
        return NodeState.DOWN, f"{SYNC_REASON}not ready ({why})"
    taints = {t.key for t in (v1node.spec.taints or [])} if v1node.spec else set()
    if taints & DOWN_TAINTS:
        return NodeState.DOWN, f"{SYNC_REASON}tainted {', '.join(sorted(taints & DOWN_TAINTS))}"
    if v1node.spec is not None and v1node.spec.unschedulable:
        return NodeState.CORDONED, f"{SYNC_REASON}cordoned"
    pressure = [c for c in PRESSURE_CONDITIONS if c in conditions and conditions[c].status == "True"]
    if pressure:
        return NodeState.CORDONED, f"{SYNC_REASON}{', '.join(pressure)}"
    return NodeState.READY, ""


def discover_node(v1node, *, pool_label: str, default_pool: str) -> DiscoveredNode | None:
    """What a node offers, from GFD labels and allocatable resources; None for a node without GPUs."""
    labels = dict(v1node.metadata.labels or {})
    alloc = dict((v1node.status.allocatable or {}) if v1node.status else {})
    mig = {k[len("nvidia.com/mig-"):]: _int(v) for k, v in alloc.items() if k.startswith("nvidia.com/mig-")}
    mig = {k: v for k, v in mig.items() if v > 0}
    amd = _int(alloc.get("amd.com/gpu", 0))
    nv_whole = _int(alloc.get("nvidia.com/gpu", 0))
    nv_shared = _int(alloc.get("nvidia.com/gpu.shared", 0))
    strategy = labels.get("nvidia.com/gpu.sharing-strategy", "none")
    replicas = _int(labels.get("nvidia.com/gpu.replicas", 1), 1) or 1
    if "nvidia.com/gpu.product" in labels or nv_whole or nv_shared or mig:
        vendor = "nvidia"
        product = labels.get("nvidia.com/gpu.product", "NVIDIA-GPU")
        memory_gib = round(_int(labels.get("nvidia.com/gpu.memory", 0)) / 1024)
        shared = replicas if (strategy in ("time-slicing", "mps") or nv_shared) and replicas > 1 else 0
        count = _int(labels.get("nvidia.com/gpu.count", 0))
        if not count:
            count = (nv_shared or nv_whole) // (shared or 1)
    elif amd:
        vendor = "amd"
        product = labels.get("amd.com/gpu.product-name") or labels.get("amd.com/gpu.family") or "AMD-GPU"
        vram = labels.get("amd.com/gpu.vram", "0")  # e.g. "192G": the labeller means gigabytes
        memory_gib = round(_int(vram) / (2**30 if vram.endswith("i") else 10**9))
        shared, count = 0, amd
    else:
        return None
    if count < 1:
        return None
    state, reason = node_state(v1node)
    name = v1node.metadata.name
    return DiscoveredNode(
        name=name, hostname=labels.get(HOSTNAME_LABEL, name), pool=labels.get(pool_label) or default_pool,
        cpu_milli=int(parse_quantity(alloc.get("cpu", "0")) * 1000),
        memory_mib=int(parse_quantity(alloc.get("memory", "0")) / 2**20), labels=labels, vendor=vendor,
        product=product, memory_gib=memory_gib, cards=count, mig_profiles=mig, shared_replicas=shared,
        state=state, state_reason=reason,
    )


# --- the thin inventory service layer ---------------------------------------------------
# scheduling.services has create/register functions that need a human actor; a sync acts as
# the service identity and upserts. These helpers are the functions that should move there.


def short_name(product: str) -> str:
    parts = [p for p in re.split(r"[-_ ]", product) if p and p.upper() not in ("NVIDIA", "AMD", "TESLA", "INSTINCT")]
    return (parts[0] if parts else product)[:20]


def upsert_pool(name: str, *, shared: bool, mig: bool) -> ResourcePool:
    pool = ResourcePool.objects.filter(name=name).first()
    if pool is None:
        pool = ResourcePool(name=name, allows_sharing=shared, mig_enabled=mig,
                            description="discovered from Kubernetes node labels")
        pool.full_clean()
        pool.save()
        audit.record("inventory.pool.create", target=pool, after={"allows_sharing": shared, "mig_enabled": mig})
    elif (shared and not pool.allows_sharing) or (mig and not pool.mig_enabled):
        before = {"allows_sharing": pool.allows_sharing, "mig_enabled": pool.mig_enabled}
        pool.allows_sharing, pool.mig_enabled = pool.allows_sharing or shared, pool.mig_enabled or mig
        pool.save(update_fields=["allows_sharing", "mig_enabled"])
        audit.record("inventory.pool.update", target=pool, before=before,
                     after={"allows_sharing": pool.allows_sharing, "mig_enabled": pool.mig_enabled})
    return pool


def resolve_model(d: DiscoveredNode) -> AcceleratorModel:
    """The AcceleratorModel for a GFD product name (ATRIUM_K8S_PRODUCT_MODELS maps names)."""
    name = setting("ATRIUM_K8S_PRODUCT_MODELS", {}).get(d.product, d.product)
    model = AcceleratorModel.objects.filter(name=name).first()
    profiles = sorted(d.mig_profiles)
    if model is None:
        model = AcceleratorModel(name=name[:60], short_name=short_name(d.product), vendor=d.vendor,
                                 memory_gib=max(d.memory_gib, 1), mig_profiles=profiles,
                                 nvlink="SXM" in d.product.upper() or "HGX" in d.product.upper())
        model.full_clean()
        model.save()
        audit.record("inventory.model.create", target=model,
                     after={"name": model.name, "vendor": d.vendor, "memory_gib": model.memory_gib})
    elif set(profiles) - set(model.mig_profiles):
        before = list(model.mig_profiles)
        model.mig_profiles = sorted(set(model.mig_profiles) | set(profiles))
        model.save(update_fields=["mig_profiles"])
        audit.record("inventory.model.update", target=model, before={"mig_profiles": before},
                     after={"mig_profiles": model.mig_profiles})
    return model


def placeholder_uuid(node_name: str, index: int) -> str:
    return f"k8s-{node_name}-gpu{index}"


def upsert_node(d: DiscoveredNode, uuids: dict[int, str], now: dt.datetime) -> dict:
    """Create or update one node and its cards to match the cluster; returns what changed."""
    changes: dict[str, list] = defaultdict(list)
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        pool = upsert_pool(d.pool, shared=d.shared_replicas > 0, mig=d.mig)
        model = resolve_model(d)
        node = Node.objects.select_for_update(no_key=True).filter(name=d.name).first()
        fields = {"pool": pool, "cpu_milli": d.cpu_milli, "memory_mib": d.memory_mib, "labels": d.labels}
        if node is None:
            node = Node(name=d.name, state=d.state, state_reason=d.state_reason, state_since=now, **fields)
            node.full_clean()
            node.save()
            audit.record("inventory.node.register", target=node,
                         after={"pool": pool.name, "cards": d.cards, "model": model.name, "source": "kubernetes"})
            changes["nodes_new"].append(node.name)
        else:
            before = {"pool": node.pool.name, "cpu_milli": node.cpu_milli, "memory_mib": node.memory_mib,
                      "retired": bool(node.retired)}
            after = {"pool": pool.name, "cpu_milli": d.cpu_milli, "memory_mib": d.memory_mib, "retired": False}
            if before != after or node.labels != d.labels:
                for k, v in fields.items():
                    setattr(node, k, v)
                node.retired = None
                node.save()
                if before != after:
                    audit.record("inventory.node.update", target=node, before=before, after=after)
                    changes["nodes_updated"].append(node.name)
        changes.update(_sync_cards(node, d, model, uuids, now))
    _apply_node_state(node, d.state, d.state_reason, now, changes)
    return changes


def _sync_cards(node: Node, d: DiscoveredNode, model: AcceleratorModel, uuids: dict[int, str], now) -> dict:
    changes: dict[str, list] = defaultdict(list)
    cards = {c.index: c for c in Accelerator.objects.select_for_update(no_key=True).filter(node=node)}
    for index in range(d.cards):
        uuid = uuids.get(index)
        card = cards.get(index)
        if card is None:
            if uuid and Accelerator.objects.filter(uuid=uuid).exists():
                log.warning("card %s reported on %s/%s already exists elsewhere; using a placeholder", uuid, d.name, index)
                uuid = None
            card = Accelerator.objects.create(node=node, index=index, uuid=uuid or placeholder_uuid(d.name, index),
                                              model=model, mig_enabled=d.mig, health_since=now)
            audit.record("inventory.card.create", target=card, after={"uuid": card.uuid, "model": model.name})
            changes["cards_new"].append(card.uuid)
            continue
        before = {"uuid": card.uuid, "model": card.model.name, "mig_enabled": card.mig_enabled,
                  "retired": bool(card.retired)}
        if uuid and uuid != card.uuid and not Accelerator.objects.filter(uuid=uuid).exclude(pk=card.pk).exists():
            card.uuid = uuid
        card.model, card.mig_enabled, card.retired = model, d.mig, None
        after = {"uuid": card.uuid, "model": model.name, "mig_enabled": d.mig, "retired": False}
        if before != after:
            card.save(update_fields=["uuid", "model", "mig_enabled", "retired"])
            action = "inventory.card.restore" if before["retired"] else "inventory.card.update"
            audit.record(action, target=card, before=before, after=after)
            changes["cards_updated"].append(card.uuid)
    for index, card in sorted(cards.items()):
        if index >= d.cards and card.retired is None:
            retire_card(card, now, reason=f"no longer reported by Kubernetes on {d.name}")
            changes["cards_retired"].append(card.uuid)
    return changes


def retire_card(card: Accelerator, now, *, reason: str, end_reason: str = BindingEnd.CARD_FAILED) -> None:
    """Take a card out of the inventory; its binding and health history stay."""
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        services._requeue_jobs_on_card(card, now, reason=f"card {card} removed: {reason}", end_reason=end_reason)
        card.retired = now
        card.save(update_fields=["retired"])
        audit.record("inventory.card.retire", target=card, reason=reason, after={"retired": now.isoformat()})


def retire_node(node: Node, now, *, reason: str) -> list[str]:
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
        retired = []
        for card in node.accelerators.filter(retired__isnull=True).select_related("node"):
            retire_card(card, now, reason=reason, end_reason=BindingEnd.NODE_DOWN)
            retired.append(card.uuid)
        node.retired = now
        node.save(update_fields=["retired"])
        audit.record("inventory.node.retire", target=node, reason=reason, after={"cards": retired})
    return retired


def _apply_node_state(node: Node, state: str, reason: str, now, changes: dict) -> None:
    """Follow the cluster's view of a node, without undoing a state ops set by hand.

    DOWN and CORDONED from the cluster always apply; READY applies only over a state the sync
    itself set (its reason starts with "kubernetes: "), so a node ops cordoned in the portal
    stays cordoned while Kubernetes still schedules on it.
    """
    if node.state == state and (state == NodeState.READY or node.state_reason == reason):
        return
    if state == NodeState.READY and node.state != NodeState.READY and not node.state_reason.startswith(SYNC_REASON):
        return
    if node.state == state:  # same state, new reason: record it without a transition
        Node.objects.filter(pk=node.pk).update(state_reason=reason[:200])
        return
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
        before = node.state
        node.state, node.state_reason, node.state_since = state, reason[:200], now
        node.save(update_fields=["state", "state_reason", "state_since"])
        if state == NodeState.DOWN:
            for card in node.accelerators.filter(retired__isnull=True).select_related("node"):
                services._requeue_jobs_on_card(card, now, reason=f"node {node} down: {reason}",
                                               end_reason=BindingEnd.NODE_DOWN)
        audit.record("node.state", target=node, before={"state": before}, after={"state": state}, reason=reason)
        services.enqueue_cycle_after_commit()
    changes["nodes_state"].append(f"{node.name}: {before} -> {state}")


# --- pods -------------------------------------------------------------------------------


def dns_label(text: str, limit: int = 63) -> str:
    clean = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if len(clean) <= limit:
        return clean
    digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:8]  # a name suffix, not a secret
    return f"{clean[: limit - 9].rstrip('-')}-{digest}"


def namespace_name(tenant_slug: str, project_slug: str) -> str:
    return dns_label(f"atrium-{tenant_slug}-{project_slug}")


def pod_name(job_id: int, replica: int) -> str:
    return f"atrium-job-{job_id}-r{replica}"


@dataclass
class PodPlan:
    """Everything one replica's pod is built from (plain values, so manifests have golden files)."""

    job_id: int
    job_name: str
    replica: int
    replicas: int
    tenant: str
    project: str
    priority_class: str
    image: str
    command: list
    node: str
    hostname: str
    cards: list
    mode: str
    vendor: str
    gpu_count: int
    mig_profile: str
    cpu_milli: int
    memory_mib: int
    time_limit_minutes: int
    admission: str

    @property
    def namespace(self) -> str:
        return namespace_name(self.tenant, self.project)

    @property
    def name(self) -> str:
        return pod_name(self.job_id, self.replica)


def gpu_resources(plan: PodPlan) -> dict:
    if plan.mode == ShareMode.MIG:
        return {f"nvidia.com/mig-{plan.mig_profile}": "1"}
    if plan.mode == ShareMode.FRACTION:
        return {setting("ATRIUM_K8S_SHARED_RESOURCE", "nvidia.com/gpu.shared"): "1"}
    return {("amd.com/gpu" if plan.vendor == "amd" else "nvidia.com/gpu"): str(plan.gpu_count)}


def pod_manifest(plan: PodPlan) -> dict:
    gpus = gpu_resources(plan)
    labels = {MANAGED_BY: "atrium", LABEL_JOB: str(plan.job_id), LABEL_REPLICA: str(plan.replica),
              LABEL_TENANT: plan.tenant, LABEL_PROJECT: plan.project, LABEL_PRIORITY: plan.priority_class}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": plan.name,
            "namespace": plan.namespace,
            "labels": labels,
            "annotations": {ANN_ADMISSION: plan.admission, ANN_CARDS: ",".join(plan.cards),
                            "atrium.io/job-name": plan.job_name[:200]},
        },
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {HOSTNAME_LABEL: plan.hostname},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                            {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "activeDeadlineSeconds": plan.time_limit_minutes * 60,
            "terminationGracePeriodSeconds": setting("ATRIUM_K8S_GRACE_SECONDS", 30),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [{
                "name": "main",
                "image": plan.image,
                "command": list(plan.command),
                "env": [{"name": "ATRIUM_JOB_ID", "value": str(plan.job_id)},
                        {"name": "ATRIUM_REPLICA", "value": str(plan.replica)},
                        {"name": "ATRIUM_REPLICAS", "value": str(plan.replicas)}],
                "resources": {
                    "requests": {"cpu": f"{plan.cpu_milli}m", "memory": f"{plan.memory_mib}Mi", **gpus},
                    "limits": {"memory": f"{plan.memory_mib}Mi", **gpus},
                },
            }],
        },
    }


def admission_tag(job: Job) -> str:
    """Names one admission of a job: a pod from an earlier admission is stale."""
    return job.admitted.isoformat() if job.admitted else ""


def plans_for(job: Job, bindings: list[Binding]) -> dict[int, PodPlan]:
    by_replica: dict[int, list[Binding]] = defaultdict(list)
    for b in bindings:
        by_replica[b.replica].append(b)
    plans = {}
    for replica, bs in sorted(by_replica.items()):
        node = bs[0].accelerator.node
        plans[replica] = PodPlan(
            job_id=job.pk, job_name=job.name, replica=replica, replicas=job.replicas, tenant=job.tenant.slug,
            project=job.project.slug, priority_class=job.priority_class.name, image=job.image,
            command=list(job.command), node=node.name, hostname=(node.labels or {}).get(HOSTNAME_LABEL, node.name),
            cards=[b.accelerator.uuid for b in sorted(bs, key=lambda b: b.accelerator.index)], mode=job.spec.mode,
            vendor=bs[0].accelerator.model.vendor, gpu_count=len(bs), mig_profile=bs[0].mig_profile or job.spec.mig_profile,
            cpu_milli=job.spec.cpu_milli, memory_mib=job.spec.memory_mib,
            time_limit_minutes=job.time_limit_minutes, admission=admission_tag(job),
        )
    return plans


QUOTA_NAME = "atrium-project-quota"


def quota_hard(project) -> dict:
    """The project's quota as a ResourceQuota `hard` map: a second line of defence in the cluster.

    Kubernetes counts extended resources by name only, so whole-card GPU lines of every model
    of one vendor add up; shares and MIG slices are held by the portal's quota alone. The
    project's own lines count; a project without lines gets its tenant's.
    """
    from scheduling.models import Quota, QuotaResource

    lines = list(Quota.objects.filter(project=project).select_related("accelerator_model"))
    if not lines:
        lines = list(Quota.objects.filter(tenant_id=project.tenant_id, project__isnull=True)
                     .select_related("accelerator_model"))
    hard: dict[str, float] = defaultdict(float)
    for q in lines:
        if q.resource == QuotaResource.GPUS:
            vendor = "amd.com/gpu" if q.accelerator_model.vendor == "amd" else "nvidia.com/gpu"
            hard[f"requests.{vendor}"] += float(q.limit)
        elif q.resource == QuotaResource.CPU_CORES:
            hard["requests.cpu"] += float(q.limit)
        elif q.resource == QuotaResource.MEMORY_GIB:
            hard["requests.memory"] += float(q.limit)
    out = {}
    for key, value in sorted(hard.items()):
        if key == "requests.memory":
            out[key] = f"{int(value * 1024)}Mi"
        elif key == "requests.cpu":
            out[key] = f"{int(value * 1000)}m"
        else:
            out[key] = str(int(value))  # a whole-card limit; shares never count here
    return out


# --- job state changes (thin layer; the simulated backend writes the same rows) --------


def _locked(job_id: int, state: str, admission: str) -> Job | None:
    """The job under a row lock if it is still in the state (and admission) we acted on."""
    job = (Job.objects.select_for_update(of=("self",), no_key=True).select_related("project__tenant")
           .filter(pk=job_id).first())
    if job is None or job.state != state or admission_tag(job) != admission:
        return None
    return job


def mark_running(job_id: int, admission: str, started: dt.datetime, message: str) -> bool:
    with transaction.atomic():
        job = _locked(job_id, JobState.ADMITTED, admission)
        if job is None:
            return False
        job.state, job.started = JobState.RUNNING, started
        job.save(update_fields=["state", "started"])
        JobEvent.objects.create(job=job, time=started, kind="running", message=message[:400])
    return True


def finish_job(job_id: int, state_was: str, admission: str, *, state: str, at: dt.datetime, message: str,
               timed_out: bool = False) -> bool:
    with transaction.atomic():
        audit.lock_chain()  # before the job's row lock: the order every audited writer uses
        job = _locked(job_id, state_was, admission)
        if job is None:
            return False
        end_reason = BindingEnd.COMPLETED if state == JobState.SUCCEEDED else BindingEnd.FAILED
        Binding.objects.filter(job=job, end__isnull=True).update(end=at, end_reason=end_reason)
        job.state, job.finished = state, at
        if job.started is None:
            job.started = at
        job.save(update_fields=["state", "finished", "started"])
        JobEvent.objects.create(job=job, time=at, kind=state, message=message[:400])
        if timed_out:
            audit.record("job.timeout", target=job, project=job.project,
                         reason=f"time limit of {job.time_limit_minutes} minutes reached")
        elif state == JobState.FAILED:
            audit.record("job.fail", target=job, project=job.project, reason=message[:300])
        services.enqueue_cycle_after_commit()
    return True


def requeue_job(job_id: int, state_was: str, admission: str, *, reason: str, end_reason: str,
                event_kind: str = "pod-lost") -> bool:
    now = timezone.now()
    with transaction.atomic():
        audit.lock_chain()  # before the job's row lock: the order every audited writer uses
        job = _locked(job_id, state_was, admission)
        if job is None:
            return False
        Binding.objects.filter(job=job, end__isnull=True).update(end=now, end_reason=end_reason)
        job.state, job.started, job.admitted = JobState.PENDING, None, None
        job.wait_reason, job.wait_message, job.queue_position = WaitReason.QUEUED, f"Requeued: {reason}."[:400], None
        job.save()
        JobEvent.objects.create(job=job, time=now, kind=event_kind, message=reason[:400])
        JobEvent.objects.create(job=job, time=now, kind="requeued", message=f"Requeued because {reason}."[:400])
        audit.record("alarm.job_requeued", target=job, project=job.project, reason=reason[:300],
                     before={"state": state_was}, after={"state": job.state, "end_reason": end_reason})
        services.enqueue_cycle_after_commit()
    return True


def _exit_summary(pod) -> tuple[str, int | None]:
    status = pod.status
    reason = (status.reason or "") if status else ""
    code = None
    for cs in (status.container_statuses or []) if status else []:
        term = cs.state.terminated if cs.state else None
        if term is not None and term.exit_code is not None:
            code = term.exit_code
            reason = reason or term.reason or ""
            if code:
                break
    return reason, code


# --- the backend ------------------------------------------------------------------------


class KubernetesCluster:
    name = "kubernetes"

    def __init__(self, api_client: client.ApiClient | None = None):
        self._api = api_client
        self.timeout = float(setting("ATRIUM_K8S_TIMEOUT_SECONDS", 10))

    @property
    def api(self) -> client.ApiClient:
        if self._api is None:
            self._api = make_api_client()
        return self._api

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def _call(self, what: str, fn, *args, ok: tuple = (), **kwargs):
        """One API call with the configured timeout; ApiException with a status in `ok` is returned."""
        try:
            return fn(*args, _request_timeout=self.timeout, **kwargs)
        except ApiException as exc:
            if exc.status in ok:
                return exc
            raise ClusterUnavailable(describe_api_error(exc, what)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ClusterUnavailable(describe_api_error(exc, what)) from exc

    # -- discovery ----------------------------------------------------------------------

    def version(self) -> str:
        info = self._call("read the server version", client.VersionApi(self.api).get_code)
        return info.git_version

    def list_nodes(self) -> list[DiscoveredNode]:
        nodes = self._call("list nodes", self.core.list_node)
        pool_label = setting("ATRIUM_K8S_POOL_LABEL", "atrium.io/pool")
        default_pool = setting("ATRIUM_K8S_DEFAULT_POOL", "default")
        found = [discover_node(n, pool_label=pool_label, default_pool=default_pool) for n in nodes.items]
        return [d for d in found if d is not None]

    def scrape_dcgm(self) -> tuple[dict[str, dcgm.CardReading], list[str]]:
        urls = setting("ATRIUM_DCGM_EXPORTER_URLS", [])
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        return dcgm.scrape(urls, self.timeout)

    # -- inventory ------------------------------------------------------------------------

    def sync_inventory(self, readings: dict | None = None, now: dt.datetime | None = None) -> dict:
        now = now or timezone.now()
        discovered = self.list_nodes()  # raises before any write when the API is away
        if readings is None:
            readings, _ = self.scrape_dcgm()
        uuids: dict[str, dict[int, str]] = defaultdict(dict)
        for r in readings.values():
            if r.hostname and r.index is not None:
                uuids[r.hostname][r.index] = r.uuid
        out: dict[str, list] = defaultdict(list)
        with context.bound(actor_label=SERVICE):
            for d in discovered:
                for k, v in upsert_node(d, uuids.get(d.name) or uuids.get(d.hostname) or {}, now).items():
                    out[k].extend(v)
            seen = {d.name for d in discovered}
            gone = list(Node.objects.filter(retired__isnull=True).exclude(name__in=seen))
            if gone and not discovered:
                # An empty GPU node list while the portal knows nodes is more likely a broken
                # label pipeline than a fleet that vanished: refuse to retire everything.
                out["warnings"].append("Kubernetes reports no GPU node at all; nothing was retired.")
            else:
                for node in gone:
                    out["cards_retired"].extend(retire_node(node, now, reason="node no longer in Kubernetes"))
                    out["nodes_retired"].append(node.name)
        return dict(out)

    # -- health ---------------------------------------------------------------------------

    def sync_health(self, readings: dict | None = None, errors: list | None = None) -> dict:
        """DCGM readings through the shared health policy, each new signal once, matched by UUID."""
        if readings is None:
            readings, errors = self.scrape_dcgm()
        cards = {c.uuid: c for c in Accelerator.objects.filter(uuid__in=list(readings), retired__isnull=True)
                 .select_related("node")}
        out = {"events": [], "unmatched": sorted(set(readings) - set(cards)), "errors": list(errors or [])}
        with context.bound(actor_label=SERVICE):
            for uuid, reading in sorted(readings.items()):
                card = cards.get(uuid)
                if card is None:
                    continue
                for sig in dcgm.signals(reading):
                    last = (HealthEvent.objects.filter(accelerator=card, message__startswith=f"dcgm[{sig.family}:")
                            .order_by("-time", "-id").values_list("message", flat=True).first())
                    last_key = last[len("dcgm["):last.index("]")] if last else None
                    if last_key == sig.key or (sig.cleared and last_key is None):
                        continue
                    event = services.record_health_event(None, card, kind=sig.kind, code=sig.code,
                                                         message=sig.tagged_message)
                    out["events"].append({"uuid": uuid, "kind": sig.kind, "code": sig.code,
                                          "health": event.resulting_health})
        return out

    # -- execution and reconciliation ---------------------------------------------------

    def ensure_namespace(self, name: str, job: Job, done: set) -> None:
        """The project's namespace and its ResourceQuota, created or brought up to date."""
        if name in done:
            return
        found = self._call(f"read namespace {name}", self.core.read_namespace, name, ok=(404,))
        if isinstance(found, ApiException):
            body = {"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": name, "labels": {MANAGED_BY: "atrium", LABEL_TENANT: job.tenant.slug,
                                                          LABEL_PROJECT: job.project.slug}}}
            self._call(f"create namespace {name}", self.core.create_namespace, body, ok=(409,))
        hard = quota_hard(job.project)
        if hard:
            self.ensure_quota(name, hard)
        done.add(name)

    def ensure_quota(self, namespace: str, hard: dict) -> None:
        body = {"apiVersion": "v1", "kind": "ResourceQuota",
                "metadata": {"name": QUOTA_NAME, "namespace": namespace, "labels": {MANAGED_BY: "atrium"}},
                "spec": {"hard": hard}}
        found = self._call(f"read the quota of {namespace}", self.core.read_namespaced_resource_quota,
                           QUOTA_NAME, namespace, ok=(404,))
        if isinstance(found, ApiException):
            self._call(f"create the quota of {namespace}", self.core.create_namespaced_resource_quota, namespace, body,
                       ok=(409,))
        elif (found.metadata.labels or {}).get(MANAGED_BY) == "atrium" and dict(found.spec.hard or {}) != hard:
            body["metadata"]["resourceVersion"] = found.metadata.resource_version
            self._call(f"update the quota of {namespace}", self.core.replace_namespaced_resource_quota,
                       QUOTA_NAME, namespace, body)

    def list_managed_pods(self) -> list:
        return self._call("list Atrium's pods", self.core.list_pod_for_all_namespaces,
                          label_selector=MANAGED_SELECTOR).items

    def delete_pod(self, pod) -> bool:
        result = self._call(f"delete pod {pod.metadata.namespace}/{pod.metadata.name}", self.core.delete_namespaced_pod,
                            pod.metadata.name, pod.metadata.namespace,
                            grace_period_seconds=setting("ATRIUM_K8S_GRACE_SECONDS", 30), ok=(404,))
        return not isinstance(result, ApiException)

    def reconcile(self) -> dict:
        """Make the cluster's pods match the portal's decisions and job states match the pods."""
        out: dict[str, list] = defaultdict(list)
        pods = self.list_managed_pods()  # raises before any change when the API is away
        jobs = {j.pk: j for j in Job.objects.filter(pk__in={int(p.metadata.labels[LABEL_JOB]) for p in pods
                                                            if (p.metadata.labels or {}).get(LABEL_JOB, "").isdigit()})}
        active = {j.pk: j for j in Job.objects.filter(state__in=ACTIVE_STATES)
                  .select_related("tenant", "project", "spec", "priority_class")}
        jobs.update(active)
        bindings: dict[int, list[Binding]] = defaultdict(list)
        for b in (Binding.objects.filter(job_id__in=list(active), end__isnull=True)
                  .select_related("accelerator__node", "accelerator__model")):
            bindings[b.job_id].append(b)

        current: dict[int, dict[int, object]] = defaultdict(dict)
        to_delete = []
        for pod in pods:
            labels = pod.metadata.labels or {}
            job_id = int(labels[LABEL_JOB]) if labels.get(LABEL_JOB, "").isdigit() else None
            job = jobs.get(job_id)
            annotations = pod.metadata.annotations or {}
            phase = pod.status.phase if pod.status else ""
            if pod.metadata.deletion_timestamp is not None:
                continue  # already terminating
            if job is not None and job.state in ACTIVE_STATES and annotations.get(ANN_ADMISSION) == admission_tag(job):
                current[job.pk][int(labels.get(LABEL_REPLICA, "0"))] = pod
            elif job is not None and job.is_final and phase in ("Succeeded", "Failed"):
                continue  # a finished pod of a finished job is history; its name is never reused
            else:
                to_delete.append(pod)

        errors = []
        for pod in to_delete:
            try:
                if self.delete_pod(pod):
                    out["deleted"].append(f"{pod.metadata.namespace}/{pod.metadata.name}")
            except ClusterUnavailable as exc:
                errors.append(str(exc))

        namespaces: set = set()
        max_lost = int(setting("ATRIUM_K8S_MAX_REQUEUES", 2))
        for job_id, job in sorted(active.items()):
            plans = plans_for(job, bindings.get(job_id, []))
            if not plans:
                continue
            have = current.get(job_id, {})
            tag = admission_tag(job)
            missing = [r for r in plans if r not in have]
            stale_names = {p.metadata.name for p in to_delete}
            if missing and job.state == JobState.RUNNING:
                lost = JobEvent.objects.filter(job_id=job_id, kind="pod-lost").count()
                names = ", ".join(pod_name(job_id, r) for r in missing)
                if lost < max_lost:
                    if requeue_job(job_id, job.state, tag, reason=f"pod {names} disappeared from the cluster",
                                   end_reason=BindingEnd.FAILED):
                        out["requeued"].append(job_id)
                elif finish_job(job_id, job.state, tag, state=JobState.FAILED, at=timezone.now(),
                                message=f"Failed: pod {names} disappeared again ({lost} times before)."):
                    out["finished"].append(job_id)
                continue
            for replica in missing:
                plan = plans[replica]
                if plan.name in stale_names:
                    continue  # an earlier admission's pod is still going away; create it next run
                try:
                    self.ensure_namespace(plan.namespace, job, namespaces)
                    result = self._call(f"create pod {plan.namespace}/{plan.name}", self.core.create_namespaced_pod,
                                        plan.namespace, pod_manifest(plan), ok=(409,))
                    out["already_existed" if isinstance(result, ApiException) else "created"].append(plan.name)
                except ClusterUnavailable as exc:
                    errors.append(str(exc))
            if missing:
                continue
            self._follow_pods(job, tag, plans, have, out)
        out["errors"] = errors
        return dict(out)

    def _follow_pods(self, job: Job, tag: str, plans: dict, have: dict, out: dict) -> None:
        """Move a job's state from its pods' phases (all replicas present)."""
        phases = {r: (have[r].status.phase if have[r].status else "Pending") for r in plans}
        failed = [r for r, ph in phases.items() if ph == "Failed"]
        if failed:
            pod = have[failed[0]]
            reason, code = _exit_summary(pod)
            at = timezone.now()
            if reason in INFRA_FAILURES:
                if requeue_job(job.pk, job.state, tag, reason=f"pod {pod.metadata.name} {reason} by Kubernetes",
                               end_reason=BindingEnd.NODE_DOWN, event_kind="pod-evicted"):
                    out["requeued"].append(job.pk)
                return
            timed_out = reason == "DeadlineExceeded"
            what = "Stopped at its time limit." if timed_out else (
                f"Failed: pod {pod.metadata.name} exited with code {code}" + (f" ({reason})." if reason else "."))
            if finish_job(job.pk, job.state, tag, state=JobState.FAILED, at=at, message=what, timed_out=timed_out):
                out["finished"].append(job.pk)
            return
        if all(ph == "Succeeded" for ph in phases.values()):
            if finish_job(job.pk, job.state, tag, state=JobState.SUCCEEDED, at=timezone.now(),
                          message="Finished successfully (all pods exited 0)."):
                out["finished"].append(job.pk)
            return
        if job.state == JobState.ADMITTED and all(ph in ("Running", "Succeeded") for ph in phases.values()):
            starts = [have[r].status.start_time for r in plans if have[r].status and have[r].status.start_time]
            started = min(starts) if starts else timezone.now()
            nodes = sorted({p.node for p in plans.values()})
            if mark_running(job.pk, tag, started, f"Pods running on {', '.join(nodes)}."):
                out["started"].append(job.pk)

    # -- the SimulatedCluster interface ---------------------------------------------------

    def tick(self, now: dt.datetime | None = None) -> dict:
        """One round: inventory, health, reconcile; each step's failure is reported, not raised."""
        result: dict = {"started": [], "finished": [], "errors": []}
        readings, dcgm_errors = self.scrape_dcgm()
        result["errors"].extend(dcgm_errors)
        steps = (("inventory", lambda: self.sync_inventory(readings, now)),
                 ("health", lambda: self.sync_health(readings, [])),
                 ("reconcile", self.reconcile))
        for name, step in steps:
            try:
                result[name] = step()
            except ClusterUnavailable as exc:
                log.warning("kubernetes %s step failed: %s", name, exc)
                result["errors"].append(str(exc))
        rec = result.get("reconcile") or {}
        result["started"], result["finished"] = rec.get("started", []), rec.get("finished", [])
        result["errors"].extend(rec.get("errors", []))
        return result

    def inject_fault(self, card, *, kind: str, code: int | None = None, message: str = "",
                     now: dt.datetime | None = None):
        """Feed a health signal to the policy (the same path DCGM readings take)."""
        with context.bound(actor_label=SERVICE):
            return services.record_health_event(None, card, kind=kind, code=code,
                                                message=message or f"injected {kind} {code or ''}".strip(), time=now)
