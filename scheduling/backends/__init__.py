"""Cluster backends carry the scheduler's decisions out and report back.

`get_backend()` returns the configured one: the SimulatedCluster (embedded default) or the
KubernetesCluster. Both have the same small interface (`tick`), so the cycle, the pages and
the tests never depend on which runs.
"""

from __future__ import annotations

from django.conf import settings


def get_backend():
    if settings.ATRIUM_CLUSTER_BACKEND == "kubernetes":
        from scheduling.backends.kubernetes import KubernetesCluster

        return KubernetesCluster()
    from scheduling.backends.simulated import SimulatedCluster

    return SimulatedCluster()
