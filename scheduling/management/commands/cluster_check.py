"""`manage.py cluster_check`: can Atrium reach its Kubernetes cluster, and what does it see?

Prints the API server it reached, the GPU nodes with their pools, cards and state as the
inventory sync would read them, and the DCGM exporters' card health. Read-only: it never
writes a row or a cluster object. When the cluster cannot be used it exits non-zero with one
sentence saying why.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from scheduling.backends import dcgm
from scheduling.backends.kubernetes import ClusterUnavailable, KubernetesCluster


class Command(BaseCommand):
    help = "Check the Kubernetes connection and print the GPU nodes, pools, cards and health it discovers."

    def handle(self, *args, **opts):
        try:
            cluster = KubernetesCluster()
            version = cluster.version()
            nodes = cluster.list_nodes()
        except ClusterUnavailable as exc:
            raise CommandError(str(exc)) from exc
        out = self.stdout
        out.write(f"Reached Kubernetes {version} through {getattr(cluster.api, 'atrium_source', 'the API')}.")
        pools: dict[str, list] = {}
        for d in nodes:
            pools.setdefault(d.pool, []).append(d)
        cards = sum(d.cards for d in nodes)
        out.write(f"Discovered {len(nodes)} GPU node(s) with {cards} card(s) in {len(pools)} pool(s).")
        for pool, members in sorted(pools.items()):
            out.write(f"pool {pool}:")
            for d in sorted(members, key=lambda n: n.name):
                extra = []
                if d.mig:
                    extra.append("MIG " + ", ".join(f"{p} x{n}" for p, n in sorted(d.mig_profiles.items())))
                if d.shared_replicas:
                    extra.append(f"shared x{d.shared_replicas} per card")
                state = d.state + (f" ({d.state_reason.removeprefix('kubernetes: ')})" if d.state_reason else "")
                out.write(f"  node {d.name}: {d.cards} x {d.product} ({d.vendor}), {d.cpu_milli // 1000} CPU, "
                          f"{d.memory_mib // 1024} GiB, {state}" + (f"; {'; '.join(extra)}" if extra else ""))
        readings, errors = cluster.scrape_dcgm()
        for err in errors:
            out.write(f"DCGM: {err}")
        if readings:
            out.write(f"DCGM: {len(readings)} card(s) reported.")
            for uuid, r in sorted(readings.items(), key=lambda kv: (kv[1].hostname, kv[1].index or 0)):
                bad = [s.message for s in dcgm.signals(r) if not s.cleared]
                out.write(f"  {r.hostname or '?'}/gpu{r.index} {uuid}: " + ("; ".join(bad) if bad else "healthy"))
        elif not errors:
            out.write("DCGM: no exporter configured (ATRIUM_DCGM_EXPORTER_URLS); card health not checked.")
