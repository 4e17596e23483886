"""The Kubernetes backend against a loopback API server and DCGM exporter that speak the wire protocol.

The real `kubernetes` client reaches scheduling.tests.fake_kube through a generated
kubeconfig; jobs are admitted by the real scheduling cycle on PostgreSQL. Covered: discovery of
a mixed fleet (MIG, shared, AMD, cordoned, not-ready), retiring removed cards with their
history kept, XID/ECC health through the shared policy (each signal once), golden pod
manifests, pod phases driving job states, preemption and cancel deleting exactly the
victim's pods, API 500s and timeouts half-way then convergence, foreign objects untouched,
cluster_check, the RQ entry points, and the RBAC manifest against the calls made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command
from django.core.management.base import CommandError

from portal.models import AuditEvent
from scheduling import services
from scheduling.backends import dcgm, get_backend
from scheduling.backends.kubernetes import (
    ClusterUnavailable,
    KubernetesCluster,
    PodPlan,
    namespace_name,
    pod_manifest,
)
from scheduling.cycle import run_cycle
from scheduling.models import (
    Accelerator,
    AcceleratorModel,
    Binding,
    BindingEnd,
    Health,
    HealthEvent,
    Job,
    JobState,
    Node,
    NodeState,
    ResourcePool,
)
from scheduling.tests.fake_kube import FakeDcgm, FakeKube, dcgm_text, gpu_node

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("k8s_golden")
PRODUCTS = {"NVIDIA-H100-80GB-HBM3": "H100-SXM5-80GB", "NVIDIA-L4": "L4-24GB"}


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """The org fixture creates many users; these tests never log in, so hashing speed is moot."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def kube(tmp_path):
    fake = FakeKube().start()
    fake.kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    yield fake
    fake.stop()


@pytest.fixture
def exporter():
    fake = FakeDcgm().start()
    yield fake
    fake.stop()


def org_fleet(kube, *, h1: bool = True):
    """The org fixture's nodes as the cluster shows them (h-0, h-1: 4 x H100; l-0: 2 x L4 shared)."""
    kube.add_node(gpu_node("h-0", count=4, pool="train"))
    if h1:
        kube.add_node(gpu_node("h-1", count=4, pool="train"))
    kube.add_node(gpu_node("l-0", product="NVIDIA-L4", count=2, memory_mib=23034, pool="share", shared_replicas=2,
                           cpu="64", memory="263724032Ki"))


def org_dcgm(**per_card) -> str:
    cards = []
    for host, n in (("h-0", 4), ("h-1", 4), ("l-0", 2)):
        for i in range(n):
            uuid = f"GPU-{host}-{i}"
            cards.append({"hostname": host, "gpu": i, "uuid": uuid, **per_card.get(uuid, {})})
    return dcgm_text(cards)


@pytest.fixture
def k8s(org, kube, exporter, settings):
    settings.ATRIUM_CLUSTER_BACKEND = "kubernetes"
    settings.ATRIUM_K8S_KUBECONFIG = kube.kubeconfig
    settings.ATRIUM_K8S_PRODUCT_MODELS = PRODUCTS
    settings.ATRIUM_DCGM_EXPORTER_URLS = [exporter.url]
    settings.ATRIUM_K8S_TIMEOUT_SECONDS = 0.5
    settings.ATRIUM_K8S_GRACE_SECONDS = 15
    org_fleet(kube)
    exporter.text = org_dcgm()
    return org


def submit(org, *, tenant="alpha", spec="h1", prio="training", name="train", replicas=1):
    user = org.people[tenant]["user"]
    return services.submit_job(user, project=org.projects[tenant], spec=org.specs[spec], priority_class=org.prio[prio],
                               name=name, image="ghcr.io/acme/train:1.4", command=["python", "train.py"],
                               replicas=replicas)


def admit(org, **kw) -> Job:
    job = submit(org, **kw)
    run_cycle()
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED, job.wait_message
    return job


def pods_of(kube, job) -> list[dict]:
    return [p for p in kube.pods.values() if p["metadata"].get("labels", {}).get("atrium.io/job") == str(job.pk)]


# --- connection and cluster_check ---------------------------------------------------------


def test_cluster_check_prints_pools_nodes_cards_and_health(k8s, kube, exporter):
    kube.add_node(gpu_node("m-0", product="NVIDIA-A100-SXM4-80GB", count=2, pool="mig",
                           mig={"3g.40gb": 4, "1g.10gb": 2}))
    exporter.text = org_dcgm(**{"GPU-h-1-2": {"xid": 79}})
    out = StringIO()
    call_command("cluster_check", stdout=out)
    text = out.getvalue()
    assert "Reached Kubernetes v1.30.2 through the kubeconfig" in text
    assert "Discovered 4 GPU node(s) with 12 card(s) in 3 pool(s)." in text
    assert "node m-0: 2 x NVIDIA-A100-SXM4-80GB (nvidia)" in text and "MIG 1g.10gb x2, 3g.40gb x4" in text
    assert "node l-0: 2 x NVIDIA-L4 (nvidia), 64 CPU, 251 GiB, ready; shared x2 per card" in text
    assert "h-1/gpu2 GPU-h-1-2: XID 79 on GPU-h-1-2" in text
    assert "h-1/gpu1 GPU-h-1-1: healthy" in text
    assert not Node.objects.filter(name="m-0").exists(), "cluster_check is read-only"


def test_cluster_check_exits_non_zero_with_one_sentence(kube, tmp_path, settings):
    bad = kube.write_kubeconfig(tmp_path / "bad-token", token="wrong")
    settings.ATRIUM_K8S_KUBECONFIG = bad
    with pytest.raises(CommandError, match=r"refused to read the server version \(HTTP 401 Unauthorized\)"):
        call_command("cluster_check")
    # and as an operator runs it: a process, KUBECONFIG from the environment, exit status 1
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "missing.yaml")}
    env.pop("ATRIUM_K8S_KUBECONFIG", None)
    proc = subprocess.run([sys.executable, "manage.py", "cluster_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "could not be configured from" in lines[0] and "missing.yaml" in lines[0]
    env["KUBECONFIG"] = kube.write_kubeconfig(tmp_path / "good")
    proc = subprocess.run([sys.executable, "manage.py", "cluster_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Discovered 0 GPU node(s)" in proc.stdout


def test_no_connection_configured_is_one_clear_sentence(settings, monkeypatch):
    settings.ATRIUM_K8S_KUBECONFIG = ""
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClusterUnavailable, match="^No Kubernetes connection is configured: set KUBECONFIG"):
        KubernetesCluster().version()


# --- inventory ----------------------------------------------------------------------------


def test_discovery_of_a_mixed_fleet(k8s, kube):
    kube.add_node(gpu_node("m-0", product="NVIDIA-A100-SXM4-80GB", count=2, pool="mig",
                           mig={"3g.40gb": 4, "1g.10gb": 2}))
    kube.add_node(gpu_node("a-0", product="AMD-Instinct-MI300X", count=8, amd=True, pool=None))
    kube.add_node(gpu_node("c-0", count=8, pool="train", unschedulable=True))
    kube.add_node(gpu_node("d-0", count=8, pool="train", ready=False))
    cpu_only = gpu_node("cpu-0", count=1)
    cpu_only["metadata"]["labels"] = {"kubernetes.io/hostname": "cpu-0"}
    cpu_only["status"]["allocatable"] = {"cpu": "32", "memory": "131072Mi", "pods": "110"}
    kube.add_node(cpu_only)
    result = KubernetesCluster().sync_inventory()
    assert sorted(result["nodes_new"]) == ["a-0", "c-0", "d-0", "m-0"]
    assert not Node.objects.filter(name="cpu-0").exists()
    m0 = Node.objects.get(name="m-0")
    a100 = AcceleratorModel.objects.get(name="NVIDIA-A100-SXM4-80GB")
    assert (a100.short_name, a100.vendor, a100.memory_gib, a100.nvlink) == ("A100", "nvidia", 80, True)
    assert a100.mig_profiles == ["1g.10gb", "3g.40gb"]
    assert m0.pool.name == "mig" and m0.pool.mig_enabled and not m0.pool.allows_sharing
    assert [c.mig_enabled for c in m0.accelerators.all()] == [True, True]
    a0 = Node.objects.get(name="a-0")
    assert a0.pool.name == "default" and a0.accelerators.count() == 8
    assert a0.accelerators.first().model.vendor == "amd" and a0.accelerators.first().model.memory_gib == 192
    assert a0.cpu_milli == 128_000 and a0.memory_mib == 1056762744 // 1024
    assert Node.objects.get(name="c-0").state == NodeState.CORDONED
    d0 = Node.objects.get(name="d-0")
    assert d0.state == NodeState.DOWN and "NodeStatusUnknown" in d0.state_reason
    # the org fixture's nodes matched by name, their cards by UUID from DCGM: nothing new there
    assert Accelerator.objects.filter(node__name="h-0").count() == 4
    assert set(Accelerator.objects.filter(node__name="l-0").values_list("uuid", flat=True)) == {"GPU-l-0-0", "GPU-l-0-1"}
    assert ResourcePool.objects.get(name="share").allows_sharing
    assert Node.objects.get(name="h-0").labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_inventory_sync_twice_changes_nothing_the_second_time(k8s, kube):
    kube.add_node(gpu_node("n-9", count=2, pool="fresh"))
    first = KubernetesCluster().sync_inventory()
    assert first["nodes_new"] == ["n-9"] and len(first["cards_new"]) == 2
    audits = AuditEvent.objects.count()
    second = KubernetesCluster().sync_inventory()
    assert second == {}
    assert AuditEvent.objects.count() == audits


def test_new_cards_appear_removed_retire_and_come_back(k8s, kube, exporter):
    cluster = KubernetesCluster()
    cluster.sync_inventory()
    kube.add_node(gpu_node("h-0", count=2, pool="train"))  # two cards gone from h-0
    result = cluster.sync_inventory()
    assert sorted(result["cards_retired"]) == ["GPU-h-0-2", "GPU-h-0-3"]
    assert Accelerator.objects.filter(node__name="h-0", retired__isnull=True).count() == 2
    kube.add_node(gpu_node("h-0", count=5, pool="train"))
    cards = [{"hostname": "h-0", "gpu": i, "uuid": f"GPU-h-0-{i}"} for i in range(5)]
    exporter.text = dcgm_text(cards)
    result = cluster.sync_inventory()
    assert sorted(result["cards_updated"]) == ["GPU-h-0-2", "GPU-h-0-3"]  # restored, same rows
    assert result["cards_new"] == ["GPU-h-0-4"]
    assert Accelerator.objects.get(uuid="GPU-h-0-4").index == 4
    assert AuditEvent.objects.filter(action="inventory.card.restore").count() == 2


def test_removed_node_retires_its_cards_and_keeps_binding_history(k8s, kube):
    cluster = KubernetesCluster()
    cluster.sync_inventory()
    job = admit(k8s, spec="h4")
    node = Binding.objects.filter(job=job).first().accelerator.node
    cluster.reconcile()
    kube.remove_node(node.name)
    result = cluster.sync_inventory()
    assert result["nodes_retired"] == [node.name]
    assert sorted(result["cards_retired"]) == sorted(f"GPU-{node.name}-{i}" for i in range(4))
    node.refresh_from_db()
    assert node.retired is not None
    assert Accelerator.objects.filter(node=node, retired__isnull=True).count() == 0
    bindings = list(Binding.objects.filter(job=job))
    assert len(bindings) == 4 and all(b.end is not None and b.end_reason == BindingEnd.NODE_DOWN for b in bindings)
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    other = "h-1" if node.name == "h-0" else "h-0"
    assert Node.objects.get(name=other).retired is None


def test_refuses_to_retire_the_whole_fleet_on_an_empty_node_list(k8s, kube):
    for name in ("h-0", "h-1", "l-0"):
        kube.remove_node(name)
    result = KubernetesCluster().sync_inventory()
    assert "nothing was retired" in result["warnings"][0]
    assert Node.objects.filter(retired__isnull=True).count() == 3


def test_cordon_and_conditions_follow_the_cluster_but_not_over_ops(k8s, kube):
    cluster = KubernetesCluster()
    kube.add_node(gpu_node("h-0", count=4, pool="train", unschedulable=True))
    kube.add_node(gpu_node("h-1", count=4, pool="train",
                           taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]))
    cluster.sync_inventory()
    h0, h1 = Node.objects.get(name="h-0"), Node.objects.get(name="h-1")
    assert (h0.state, h0.state_reason) == (NodeState.CORDONED, "kubernetes: cordoned")
    assert h1.state == NodeState.DOWN and "unreachable" in h1.state_reason
    assert AuditEvent.objects.filter(action="node.state", target_id=str(h1.pk), after__state="down").exists()
    kube.add_node(gpu_node("h-0", count=4, pool="train"))
    cluster.sync_inventory()
    assert Node.objects.get(name="h-0").state == NodeState.READY  # uncordoned in Kubernetes
    services.set_node_state(k8s.ops, Node.objects.get(name="l-0"), NodeState.CORDONED, reason="fan noise")
    cluster.sync_inventory()
    assert Node.objects.get(name="l-0").state == NodeState.CORDONED  # ops' cordon stands


# --- health -------------------------------------------------------------------------------


def test_xid_79_marks_exactly_that_card_once(k8s, exporter):
    cluster = KubernetesCluster()
    exporter.text = org_dcgm(**{"GPU-h-1-2": {"xid": 79}})
    result = cluster.sync_health()
    expected = services.health_policy("xid", 79)
    assert expected != Health.HEALTHY
    assert result["events"] == [{"uuid": "GPU-h-1-2", "kind": "xid", "code": 79, "health": expected}]
    assert dict(Accelerator.objects.exclude(health=Health.HEALTHY).values_list("uuid", "health")) == {
        "GPU-h-1-2": expected}
    assert cluster.sync_health()["events"] == []  # the gauge still reads 79: not a new event
    card = Accelerator.objects.get(uuid="GPU-h-1-2")
    services.set_card_health(k8s.ops, card, Health.HEALTHY, reason="reseated")
    cluster.sync_health()
    card.refresh_from_db()
    assert card.health == Health.HEALTHY, "a stale reading must not undo ops' release"
    exporter.text = org_dcgm()  # cleared ...
    assert [e["code"] for e in cluster.sync_health()["events"]] == [None]
    exporter.text = org_dcgm(**{"GPU-h-1-2": {"xid": 79}})  # ... and back: a new fault
    assert [e["code"] for e in cluster.sync_health()["events"]] == [79]
    card.refresh_from_db()
    assert card.health == expected
    assert HealthEvent.objects.filter(accelerator=card, code=79).count() == 2


def test_ecc_and_failed_health_watch_quarantine_and_requeue(k8s, exporter):
    cluster = KubernetesCluster()
    job = admit(k8s, spec="h1")
    held = Binding.objects.get(job=job).accelerator
    other = Accelerator.objects.exclude(pk=held.pk).filter(node__name="l-0").first()
    exporter.text = org_dcgm(**{held.uuid: {"dbe": 2}, other.uuid: {"health": 20}})
    result = cluster.sync_health()
    assert {e["uuid"]: e["health"] for e in result["events"]} == {held.uuid: Health.QUARANTINED,
                                                                  other.uuid: Health.QUARANTINED}
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert Binding.objects.get(job=job).end_reason == BindingEnd.CARD_FAILED


def test_unknown_uuid_and_unreachable_exporter_change_nothing(k8s, exporter, settings):
    exporter.text = dcgm_text([{"hostname": "x-9", "gpu": 0, "uuid": "GPU-nobody", "xid": 79}])
    result = KubernetesCluster().sync_health()
    assert result["unmatched"] == ["GPU-nobody"] and result["events"] == []
    settings.ATRIUM_DCGM_EXPORTER_URLS = ["http://127.0.0.1:9/metrics"]
    result = KubernetesCluster().sync_health()
    assert result["events"] == [] and "could not be read" in result["errors"][0]
    assert not HealthEvent.objects.exists()


def test_prometheus_text_parser():
    text = ('# HELP x y\n# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n'
            'DCGM_FI_DEV_XID_ERRORS{gpu="1",UUID="GPU-a",Hostname="n\\"1",modelName="A, B"} 48 1718000000000\n'
            'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="1",UUID="GPU-a"} NaN\n'
            'garbage line without value\n'
            'DCGM_EXP_GPU_HEALTH_STATUS{gpu="1",UUID="GPU-a"} 10\n')
    cards = dcgm.readings(dcgm.parse_text(text))
    card = cards["GPU-a"]
    assert (card.hostname, card.index, card.model_name) == ('n"1', 1, "A, B")
    assert card.values == {"DCGM_FI_DEV_XID_ERRORS": 48.0, "DCGM_EXP_GPU_HEALTH_STATUS": 10.0}
    assert [(s.kind, s.code) for s in dcgm.signals(card)] == [("xid", 48), ("thermal", 10)]


# --- pod manifests (golden files, reviewed by hand) --------------------------------------


def plan(**kw) -> PodPlan:
    base = dict(job_id=41, job_name="llama finetune", replica=0, replicas=1, tenant="alpha", project="alpha-p",
                priority_class="training", image="ghcr.io/acme/train:1.4", command=["python", "train.py"],
                node="h-0", hostname="h-0", cards=["GPU-h-0-0", "GPU-h-0-1"], mode="whole", vendor="nvidia",
                gpu_count=2, mig_profile="", cpu_milli=16000, memory_mib=131072, time_limit_minutes=120,
                admission="2026-01-05T10:00:00+00:00")
    base.update(kw)
    return PodPlan(**base)


GOLDEN_PLANS = {
    "pod-whole": {},
    "pod-mig": dict(node="m-0", hostname="m-0", cards=["GPU-m-0-1"], mode="mig", gpu_count=1,
                    mig_profile="3g.40gb", cpu_milli=8000, memory_mib=65536),
    "pod-shared": dict(node="l-0", hostname="l-0", cards=["GPU-l-0-1"], mode="fraction", gpu_count=1,
                       cpu_milli=2000, memory_mib=8192, priority_class="batch"),
    "pod-amd": dict(node="a-0", hostname="a-0", cards=["k8s-a-0-gpu0"], vendor="amd", gpu_count=1),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_PLANS))
def test_pod_manifest_matches_golden_file(name, settings):
    settings.ATRIUM_K8S_GRACE_SECONDS = 30
    manifest = pod_manifest(plan(**GOLDEN_PLANS[name]))
    path = GOLDEN / f"{name}.json"
    if os.environ.get("ATRIUM_UPDATE_GOLDEN"):
        path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    assert manifest == json.loads(path.read_text())


def test_namespace_names_are_valid_dns_labels():
    assert namespace_name("alpha", "alpha-p") == "atrium-alpha-alpha-p"
    long = namespace_name("Big_Tenant", "x" * 80)
    assert len(long) == 63 and long.startswith("atrium-big-tenant-xxx") and long == long.lower()


# --- execution and reconciliation -------------------------------------------------------


def test_admitted_job_becomes_a_pinned_pod_once(k8s, kube):
    cluster = KubernetesCluster()
    cluster.sync_inventory()
    job = admit(k8s, spec="h1")
    card = Binding.objects.get(job=job).accelerator
    result = cluster.reconcile()
    assert result["created"] == [f"atrium-job-{job.pk}-r0"]
    ns = kube.namespaces["atrium-alpha-alpha-p"]
    assert ns["metadata"]["labels"]["atrium.io/tenant"] == "alpha" and ns["metadata"]["labels"]["atrium.io/project"] == "alpha-p"
    pod = kube.pod("atrium-alpha-alpha-p", f"atrium-job-{job.pk}-r0")
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": card.node.name}
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["metadata"]["annotations"]["atrium.io/cards"] == card.uuid
    assert pod["metadata"]["labels"]["atrium.io/priority-class"] == "training"
    # the project quota mirrored as a second line of defence: 4 H100 + 2 L4 whole-card limits
    quota = kube.quotas[("atrium-alpha-alpha-p", "atrium-project-quota")]
    assert quota["spec"]["hard"] == {"requests.nvidia.com/gpu": "6"}
    second = cluster.reconcile()
    assert "created" not in second and "deleted" not in second
    assert len(pods_of(kube, job)) == 1
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED  # a Pending pod is not a running job


def test_shared_job_requests_the_shared_resource(k8s, kube):
    cluster = KubernetesCluster()
    job = admit(k8s, spec="l4half")
    cluster.reconcile()
    (pod,) = pods_of(kube, job)
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"memory": "8192Mi", "nvidia.com/gpu.shared": "1"}


def test_pod_phases_drive_the_job(k8s, kube):
    cluster = KubernetesCluster()
    ok, bad = admit(k8s, spec="h1", name="ok"), admit(k8s, spec="h1", name="bad", tenant="beta")
    cluster.reconcile()
    ns_ok, ns_bad = "atrium-alpha-alpha-p", "atrium-beta-beta-p"
    kube.set_phase(ns_ok, f"atrium-job-{ok.pk}-r0", "Running")
    kube.set_phase(ns_bad, f"atrium-job-{bad.pk}-r0", "Running")
    assert sorted(cluster.reconcile()["started"]) == sorted([ok.pk, bad.pk])
    ok.refresh_from_db()
    assert ok.state == JobState.RUNNING and ok.started is not None
    kube.set_phase(ns_ok, f"atrium-job-{ok.pk}-r0", "Succeeded")
    kube.set_phase(ns_bad, f"atrium-job-{bad.pk}-r0", "Failed", exit_code=3)
    assert sorted(cluster.reconcile()["finished"]) == sorted([ok.pk, bad.pk])
    ok.refresh_from_db()
    bad.refresh_from_db()
    assert ok.state == JobState.SUCCEEDED and bad.state == JobState.FAILED
    assert set(Binding.objects.filter(job=ok).values_list("end_reason", flat=True)) == {BindingEnd.COMPLETED}
    assert set(Binding.objects.filter(job=bad).values_list("end_reason", flat=True)) == {BindingEnd.FAILED}
    assert "exited with code 3" in bad.events.last().message
    assert cluster.reconcile() == {"errors": []}  # finished pods of finished jobs are left alone
    assert len(kube.pods) == 2


def test_evicted_pod_requeues_the_job(k8s, kube):
    cluster = KubernetesCluster()
    job = admit(k8s, spec="h1")
    cluster.reconcile()
    name = f"atrium-job-{job.pk}-r0"
    kube.set_phase("atrium-alpha-alpha-p", name, "Running")
    cluster.reconcile()
    kube.set_phase("atrium-alpha-alpha-p", name, "Failed", exit_code=137, reason="Evicted")
    assert cluster.reconcile()["requeued"] == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert Binding.objects.get(job=job).end_reason == BindingEnd.NODE_DOWN
    assert cluster.reconcile()["deleted"] == [f"atrium-alpha-alpha-p/{name}"]  # the old pod frees its name


def test_vanished_pod_requeues_then_fails_after_the_limit(k8s, kube, settings):
    settings.ATRIUM_K8S_MAX_REQUEUES = 1
    cluster = KubernetesCluster()
    job = admit(k8s, spec="h1")
    for attempt in range(2):
        cluster.reconcile()
        name = f"atrium-job-{job.pk}-r0"
        kube.set_phase("atrium-alpha-alpha-p", name, "Running")
        cluster.reconcile()
        del kube.pods[("atrium-alpha-alpha-p", name)]  # deleted behind Atrium's back
        result = cluster.reconcile()
        job.refresh_from_db()
        if attempt == 0:
            assert result["requeued"] == [job.pk] and job.state == JobState.PENDING
            run_cycle()
            job.refresh_from_db()
            assert job.state == JobState.ADMITTED
        else:
            assert result["finished"] == [job.pk] and job.state == JobState.FAILED
            assert "disappeared again" in job.events.last().message


def test_preemption_deletes_exactly_the_victims_pods(k8s, kube):
    kube.remove_node("h-1")
    cluster = KubernetesCluster()
    cluster.sync_inventory()
    victim = admit(k8s, spec="h4", prio="batch", tenant="alpha", name="victim")
    bystander = admit(k8s, spec="l4half", prio="batch", tenant="alpha", name="bystander")
    kube.add_pod("atrium-alpha-alpha-p", {"metadata": {"name": "notebook", "labels": {"app": "jupyter"}},
                                          "spec": {"containers": [{"name": "nb", "image": "jupyter/base"}]}})
    cluster.reconcile()
    for job in (victim, bystander):
        kube.set_phase("atrium-alpha-alpha-p", f"atrium-job-{job.pk}-r0", "Running")
    cluster.reconcile()
    # within beta's guarantee, so it may reclaim what alpha borrowed
    boss = submit(k8s, spec="h1", prio="production", tenant="beta", name="urgent")
    outcome = run_cycle()
    boss.refresh_from_db()
    assert outcome.preempted == [victim.pk], boss.wait_message
    result = cluster.reconcile()
    assert result["deleted"] == [f"atrium-alpha-alpha-p/atrium-job-{victim.pk}-r0"]
    assert result["created"] == [f"atrium-job-{boss.pk}-r0"]
    assert kube.pod("atrium-alpha-alpha-p", "notebook") is not None
    assert kube.pod("atrium-alpha-alpha-p", f"atrium-job-{bystander.pk}-r0") is not None
    delete = [c for c in kube.calls if c[0] == "DELETE"]
    assert [c[1].rsplit("/", 1)[1] for c in delete] == [f"atrium-job-{victim.pk}-r0"]


def test_cancel_deletes_the_pod_with_a_grace_period(k8s, kube):
    kube.graceful_delete = True
    cluster = KubernetesCluster()
    job = admit(k8s, spec="h1")
    cluster.reconcile()
    services.cancel_job(k8s.people["alpha"]["user"], job)
    assert cluster.reconcile()["deleted"] == [f"atrium-alpha-alpha-p/atrium-job-{job.pk}-r0"]
    pod = kube.pod("atrium-alpha-alpha-p", f"atrium-job-{job.pk}-r0")
    assert pod["metadata"]["deletionGracePeriodSeconds"] == 15
    assert "deleted" not in cluster.reconcile()  # terminating: not deleted twice


def test_readmission_waits_for_the_old_pod_then_relaunches(k8s, kube):
    kube.graceful_delete = True
    cluster = KubernetesCluster()
    job = admit(k8s, spec="h1")
    cluster.reconcile()
    card = Binding.objects.get(job=job).accelerator
    services.set_card_health(k8s.ops, card, Health.QUARANTINED, reason="test")
    run_cycle()
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED  # re-admitted elsewhere, same pod name
    result = cluster.reconcile()
    assert result["deleted"] == [f"atrium-alpha-alpha-p/atrium-job-{job.pk}-r0"] and "created" not in result
    assert "created" not in cluster.reconcile()  # old pod still terminating
    kube.finish_deletions()
    assert cluster.reconcile()["created"] == [f"atrium-job-{job.pk}-r0"]
    pod = kube.pod("atrium-alpha-alpha-p", f"atrium-job-{job.pk}-r0")
    assert pod["metadata"]["annotations"]["atrium.io/cards"] == Binding.objects.get(job=job, end__isnull=True).accelerator.uuid


def test_api_500_half_way_then_the_next_run_converges(k8s, kube):
    cluster = KubernetesCluster()
    first, second = admit(k8s, spec="h1", name="a"), admit(k8s, spec="h1", name="b", tenant="beta")
    kube.fail("POST", r"/namespaces/atrium-alpha-alpha-p/pods$", 500)
    result = cluster.reconcile()
    assert result["created"] == [f"atrium-job-{second.pk}-r0"]
    assert "HTTP 500" in result["errors"][0]
    first.refresh_from_db()
    assert first.state == JobState.ADMITTED and Binding.objects.get(job=first).end is None  # truthful: not started
    kube.fail("GET", r"^/api/v1/pods$", 500)
    with pytest.raises(ClusterUnavailable, match="failed to list Atrium's pods"):
        cluster.reconcile()
    assert cluster.reconcile()["created"] == [f"atrium-job-{first.pk}-r0"]
    assert cluster.reconcile() == {"errors": []}
    assert len(kube.pods) == 2


def test_timeout_half_way_then_no_double_launch(k8s, kube):
    cluster = KubernetesCluster()
    job = admit(k8s, spec="h1")
    kube.stall("POST", r"/pods$", seconds=1.5)  # the server creates it, the client has given up
    result = cluster.reconcile()
    assert "could not be reached to create pod" in result["errors"][0] and "created" not in result
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED
    import time

    time.sleep(1.2)
    kube.stall("GET", r"^/api/v1/pods$", seconds=1.5)
    with pytest.raises(ClusterUnavailable):
        cluster.reconcile()
    time.sleep(1.2)
    result = cluster.reconcile()
    assert "created" not in result and result["errors"] == []
    assert [c[0] for c in kube.calls if c[1].endswith("/pods") and c[0] == "POST"] == ["POST"]
    assert len(pods_of(kube, job)) == 1


def test_a_pod_without_atriums_labels_is_never_touched(k8s, kube):
    job = admit(k8s, spec="h1")
    name = f"atrium-job-{job.pk}-r0"  # same name, someone else's object
    kube.add_pod("atrium-alpha-alpha-p", {"metadata": {"name": name, "labels": {"team": "x"}},
                                          "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    services.cancel_job(k8s.people["alpha"]["user"], job)
    result = KubernetesCluster().reconcile()
    assert "deleted" not in result
    assert kube.pod("atrium-alpha-alpha-p", name)["metadata"]["labels"] == {"team": "x"}
    assert not [c for c in kube.calls if c[0] == "DELETE"]


# --- interface, RQ and RBAC -----------------------------------------------------------------


def test_get_backend_and_tick_have_the_simulated_interface(k8s, kube, exporter):
    backend = get_backend()
    assert isinstance(backend, KubernetesCluster)
    job = admit(k8s, spec="h1")
    exporter.text = org_dcgm(**{"GPU-l-0-1": {"xid": 48}})
    result = backend.tick()
    assert result["errors"] == [] and result["started"] == [] and result["health"]["events"][0]["uuid"] == "GPU-l-0-1"
    kube.set_phase("atrium-alpha-alpha-p", f"atrium-job-{job.pk}-r0", "Running")
    assert backend.tick()["started"] == [job.pk]
    kube.fail("GET", r"^/api/v1/nodes$", 503)
    result = backend.tick()
    assert "HTTP 503" in result["errors"][0] and "reconcile" in result
    event = backend.inject_fault(Accelerator.objects.get(uuid="GPU-h-0-0"), kind="xid", code=79)
    assert event.resulting_health == services.health_policy("xid", 79)


@pytest.mark.django_db(transaction=True)
def test_rq_entry_points_run_in_a_worker(k8s, kube, settings):
    import django_rq
    from rq import SimpleWorker

    from scheduling import k8s_jobs

    queue = django_rq.get_queue("scheduling")
    queue.empty()
    for job_id in k8s_jobs.JOB_IDS.values():
        queue.connection.delete(f"rq:job:{job_id}")
    kube.add_node(gpu_node("n-7", count=2, pool="fresh"))
    assert k8s_jobs.enqueue_kubernetes_work() == ["sync_inventory", "sync_health", "reconcile_cluster"]
    assert k8s_jobs.enqueue_kubernetes_work() == []  # already queued: no duplicates
    SimpleWorker([queue], connection=queue.connection).work(burst=True)
    done = queue.fetch_job(k8s_jobs.JOB_IDS["sync_inventory"])
    assert done.get_status() == "finished" and done.return_value()["nodes_new"] == ["n-7"]
    assert Accelerator.objects.filter(node__name="n-7").count() == 2
    kube.fail("GET", r"^/api/v1/pods$", 500)
    assert k8s_jobs.enqueue_kubernetes_work(inventory=False, health=False) == ["reconcile_cluster"]
    SimpleWorker([queue], connection=queue.connection).work(burst=True)
    failed = queue.fetch_job(k8s_jobs.JOB_IDS["reconcile_cluster"])
    assert failed.get_status() in ("scheduled", "failed")  # retried with back-off by RQ
    assert failed.retries_left == 2


def test_rbac_manifest_grants_exactly_what_the_backend_uses(k8s, kube, exporter):
    cluster = KubernetesCluster()
    kube.graceful_delete = False
    call_command("cluster_check", stdout=StringIO())
    cluster.tick()
    job = admit(k8s, spec="h1")
    cluster.tick()
    services.cancel_job(k8s.people["alpha"]["user"], job)
    cluster.tick()
    services.set_quota(k8s.people["alpha"]["admin"], tenant=k8s.tenants["alpha"], project=k8s.projects["alpha"],
                       resource="gpus", accelerator_model=k8s.models["h100"], guaranteed=1, limit=3)
    admit(k8s, spec="h1", name="after the quota change")
    cluster.tick()
    assert kube.quotas[("atrium-alpha-alpha-p", "atrium-project-quota")]["spec"]["hard"] == {
        "requests.nvidia.com/gpu": "5"}
    used = {(g, r, v) for g, r, v in kube.rbac_used()}
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/rbac.yaml").read_text()) if d]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    granted = set()
    for rule in role["rules"]:
        for verb in rule["verbs"]:
            for url in rule.get("nonResourceURLs", []):
                granted.add(("", url, verb))
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    granted.add((group, resource, verb))
    assert granted == used
    binding = [d for d in docs if d["kind"] == "ClusterRoleBinding"][0]
    account = [d for d in docs if d["kind"] == "ServiceAccount"][0]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]


def _deploy_docs() -> list[dict]:
    base = ROOT / "deploy/k8s"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((base / name).read_text()) if d]
    return docs


def test_deploy_manifests_are_consistent():
    docs = _deploy_docs()
    by_kind: dict[str, dict] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    deployments = by_kind["Deployment"]
    assert set(deployments) == {"atrium-web", "atrium-gateway", "atrium-worker", "atrium-scheduler"}
    # only the workers talk to the API, so only they run as the account the ClusterRole is bound to
    bound = by_kind["ClusterRoleBinding"]["atrium-cluster-backend"]["subjects"][0]["name"]
    users = {n: d["spec"]["template"]["spec"]["serviceAccountName"] for n, d in deployments.items()}
    assert [n for n, sa in users.items() if sa == bound] == ["atrium-worker"]
    assert all(sa in by_kind["ServiceAccount"] for sa in users.values())
    assert by_kind["ServiceAccount"]["atrium-web"]["automountServiceAccountToken"] is False
    web = deployments["atrium-web"]["spec"]["template"]["spec"]["containers"][0]
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert deployments["atrium-scheduler"]["spec"]["replicas"] == 1
    assert deployments["atrium-scheduler"]["spec"]["strategy"]["type"] == "Recreate"
    commands = {d["spec"]["template"]["spec"]["containers"][0]["command"][2]
                for d in [*deployments.values(), *by_kind["Job"].values()] if d["spec"]["template"]["spec"]
                ["containers"][0]["command"][0] == "python"}
    assert commands == {"rqworker", "run_scheduler", "migrate"}
    for name in ("atrium-web", "atrium-gateway"):
        selector = by_kind["Service"][name]["spec"]["selector"]
        assert selector.items() <= deployments[name]["spec"]["template"]["metadata"]["labels"].items()
        assert deployments[name]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["path"] \
            == "/healthz"
    # /v1/ goes to the gateway's data plane, the rest to the portal
    paths = {p["path"]: p["backend"]["service"]["name"]
             for p in by_kind["Ingress"]["atrium-web"]["spec"]["rules"][0]["http"]["paths"]}
    assert paths == {"/v1/": "atrium-gateway", "/": "atrium-web"}
    gateway = deployments["atrium-gateway"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert gateway[:4] == ["gunicorn", "serving.dataplane:application", "-k", "serving.dataplane_worker.Worker"]
    assert by_kind["ServiceAccount"]["atrium-gateway"]["automountServiceAccountToken"] is False
    for pdb in by_kind["PodDisruptionBudget"].values():
        matched = [n for n, d in deployments.items()
                   if pdb["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1
    config = by_kind["ConfigMap"]["atrium-config"]["data"]
    assert config["ATRIUM_CLUSTER_BACKEND"] == "kubernetes"
    source = (ROOT / "scheduling/backends/kubernetes.py").read_text()
    for key in config:
        if key.startswith(("ATRIUM_K8S_", "ATRIUM_DCGM_")):
            assert f'"{key}"' in source, f"{key} is not a setting the backend reads"
    for d in [*deployments.values(), *by_kind["Job"].values()]:
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_kustomize_renders_the_deployment():
    import shutil

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here")
    proc = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/k8s")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rendered = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] not in
            ("Namespace", "ClusterRole", "ClusterRoleBinding")} == {"atrium"}
    images = {c["image"] for d in rendered if d["kind"] in ("Deployment", "Job")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.example.com/atrium:latest"}
