"""RQ entry points of the Kubernetes backend: inventory sync, health sync, reconcile.

Small functions the periodic loop enqueues (through `enqueue_kubernetes_work`) with fixed job
ids, so a restarted loop never piles up duplicates, and with RQ retries that back off when the
API server is away. Each one is level-based and idempotent: run twice, the second run changes
nothing. They raise when the cluster could not be used, so RQ records the failure and
retries; they never write a row themselves (the backend's service layer does).
"""

from __future__ import annotations

import logging

import django_rq
from redis.exceptions import RedisError
from rq import Retry

log = logging.getLogger(__name__)

QUEUE = "scheduling"
JOB_IDS = {
    "sync_inventory": "atrium-k8s-sync-inventory",
    "sync_health": "atrium-k8s-sync-health",
    "reconcile_cluster": "atrium-k8s-reconcile",
}
RETRY = Retry(max=3, interval=[5, 20, 60])


def _cluster():
    from scheduling.backends.kubernetes import KubernetesCluster

    return KubernetesCluster()


def sync_inventory() -> dict:
    """Nodes, pools and cards from the cluster (GFD labels, allocatable, conditions, cordon)."""
    return _cluster().sync_inventory()


def sync_health() -> dict:
    """Card health from the DCGM exporter(s); raises when none of them could be read."""
    result = _cluster().sync_health()
    if result["errors"] and not result["events"] and not result["unmatched"]:
        from scheduling.backends.kubernetes import ClusterUnavailable

        raise ClusterUnavailable("; ".join(result["errors"]))
    return result


def reconcile_cluster() -> dict:
    """Pods to match the portal's decisions, job states to match the pods."""
    result = _cluster().reconcile()
    if result.get("errors"):
        from scheduling.backends.kubernetes import ClusterUnavailable

        # Everything that could be done is done and consistent; raising makes RQ retry the rest.
        raise ClusterUnavailable("; ".join(result["errors"]))
    return result


def enqueue_unique(func, job_id: str) -> bool:
    queue = django_rq.get_queue(QUEUE)
    existing = queue.fetch_job(job_id)
    if existing is not None and existing.get_status(refresh=False) in ("queued", "started", "deferred", "scheduled"):
        return False
    queue.enqueue(func, job_id=job_id, result_ttl=60, failure_ttl=3600, retry=RETRY)
    return True


def enqueue_kubernetes_work(*, inventory: bool = True, health: bool = True, reconcile: bool = True) -> list[str]:
    """What the periodic loop enqueues each round when ATRIUM_CLUSTER_BACKEND is kubernetes."""
    wanted = [("sync_inventory", sync_inventory, inventory), ("sync_health", sync_health, health),
              ("reconcile_cluster", reconcile_cluster, reconcile)]
    queued = []
    try:
        for name, func, on in wanted:
            if on and enqueue_unique(func, JOB_IDS[name]):
                queued.append(name)
    except RedisError as exc:
        log.warning("kubernetes sync not enqueued (Redis unreachable: %s); the next round retries", exc)
    return queued
