"""Benchmark: server time and SQL queries of the heaviest pages at scale (BENCHMARKS.md section 3).

Serves the tenant dashboard, the job list and a job detail through Django's full request
stack (middleware, session, view, templates) in this process, 200 times each, next to a
trivial page served by the same process in the same run, and prints p50 / p95 server time,
the ratios and the SQL query count of one request. Two trivial pages: /ping, the fair one
(signed in: session, user, navigation, base template; the ratios and the verdict use it),
and /healthz (no session, no database), whose ratio is shown too. Data:
the database named by DATABASE_URL as it is; with --seed it first loads `seed_scale` when
that command exists (200 tenants, 2,000 projects, 100,000 jobs, 10 million usage rows), else
`seed_demo`, and the JSON says which. Writes bench/results/pages.json. A measurement, not a
timed test; it only reads (apart from the optional seeding and the login session).

    DATABASE_URL=postgres://... .venv/bin/python bench/pages.py [--seed] [--requests 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "pages.json"
TARGET_P95_MS = 150.0
TARGET_RATIO = 8.0


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    # the bench talks to the views in-process over plain HTTP
    for key, value in (("SECURE_SSL_REDIRECT", "0"), ("SESSION_COOKIE_SECURE", "0"), ("CSRF_COOKIE_SECURE", "0"),
                       ("SECURE_HSTS_SECONDS", "0")):
        os.environ.setdefault(key, value)
    import django

    django.setup()


def dataset(seed: bool) -> dict:
    from django.core.management import call_command, get_commands

    from metering.models import UsageRecord
    from scheduling.models import Job
    from tenants.models import Project, Tenant

    has_scale = "seed_scale" in get_commands()
    if seed:
        if has_scale:
            call_command("seed_scale")
        else:
            call_command("seed_demo")
    counts = {"tenants": Tenant.objects.count(), "projects": Project.objects.count(), "jobs": Job.objects.count(),
              "usage_rows": UsageRecord.objects.count()}
    at_scale = counts["tenants"] >= 200 and counts["jobs"] >= 100_000
    note = ("seed_scale data" if at_scale else
            "NOT at scale: seed_scale " + ("exists but was not loaded (run with --seed)" if has_scale
                                           else "does not exist yet") + "; figures are on the data present")
    return {"counts": counts, "at_scale": at_scale, "note": note}


def pick_subjects() -> dict:
    """The busiest tenant's admin, and one of its jobs that ran (has bindings)."""
    from django.db.models import Count

    from scheduling.models import Binding, Job
    from tenants.models import TenantMembership

    admins = TenantMembership.objects.filter(role="tenant_admin").values_list("tenant_id", "user_id")
    by_tenant = dict(admins)
    busiest = (Job.objects.filter(tenant_id__in=list(by_tenant)).values("tenant_id").annotate(n=Count("id"))
               .order_by("-n").first())
    if busiest is None:
        raise SystemExit("No tenant with a tenant admin and jobs: load data first (--seed).")
    tenant_id = busiest["tenant_id"]
    job_id = (Binding.objects.filter(tenant_id=tenant_id).order_by("-start").values_list("job_id", flat=True).first()
              or Job.objects.filter(tenant_id=tenant_id).values_list("pk", flat=True).first())
    return {"tenant_id": tenant_id, "user_id": by_tenant[tenant_id], "job_id": job_id, "jobs_in_tenant": busiest["n"]}


def measure(client, path: str, params: dict, n: int) -> dict:
    from django.db import connection

    response = client.get(path, params, secure=True)  # warm-up (and a check)
    if response.status_code != 200:
        raise SystemExit(f"{path} {params} answered {response.status_code}")
    queries = []

    def count(execute, sql, params_, many, context):
        queries.append(sql)
        return execute(sql, params_, many, context)

    with connection.execute_wrapper(count):
        client.get(path, params, secure=True)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.get(path, params, secure=True)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {
        "path": path, "params": params, "requests": n, "queries": len(queries),
        "p50_ms": round(statistics.median(times), 2), "p95_ms": round(times[int(0.95 * (n - 1))], 2),
        "mean_ms": round(statistics.fmean(times), 2), "bytes": len(response.content),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", action="store_true", help="load seed_scale (or seed_demo) first")
    args = parser.parse_args()
    setup_django()
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client

    data = dataset(args.seed)
    subjects = pick_subjects()
    user = get_user_model().objects.get(pk=subjects["user_id"])
    client = Client()
    client.force_login(user)
    pages = {
        "trivial (/healthz)": ("/healthz", {}),
        "trivial signed-in page (/ping)": ("/ping", {}),
        "tenant dashboard": ("/", {"scope": f"tenant:{subjects['tenant_id']}"}),
        "tenant dashboard, queue fragment (htmx)": ("/", {"scope": f"tenant:{subjects['tenant_id']}", "panel": "queue"}),
        "job list": ("/scheduling/jobs/", {}),
        "job detail": (f"/scheduling/jobs/{subjects['job_id']}/", {}),
    }
    results = {}
    for name, (path, params) in pages.items():
        if "htmx" in name:
            client.defaults["HTTP_HX_REQUEST"] = "true"
        results[name] = measure(client, path, params, args.requests)
        client.defaults.pop("HTTP_HX_REQUEST", None)
    base = results["trivial signed-in page (/ping)"]
    probe = results["trivial (/healthz)"]
    for r in results.values():
        r["p50_ratio"] = round(r["p50_ms"] / base["p50_ms"], 1)
        r["p95_ratio"] = round(r["p95_ms"] / base["p95_ms"], 1)
        r["p95_ratio_to_healthz"] = round(r["p95_ms"] / max(probe["p95_ms"], 0.01), 1)
    dash = results["tenant dashboard"]
    verdict = {
        "tenant_dashboard_p95_ms": dash["p95_ms"], "target_p95_ms": TARGET_P95_MS,
        "tenant_dashboard_p95_ratio": dash["p95_ratio"], "target_ratio": TARGET_RATIO, "ratio_baseline": "/ping",
        "tenant_dashboard_p95_ratio_to_healthz": dash["p95_ratio_to_healthz"],
        "meets_targets": dash["p95_ms"] <= TARGET_P95_MS and dash["p95_ratio"] <= TARGET_RATIO,
    }
    out = {
        "benchmark": "pages at scale (BENCHMARKS.md section 3)", "data": data, "subjects": subjects,
        "database": connection.vendor, "python": platform.python_version(), "machine": platform.machine(),
        "results": results, "verdict": verdict,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"data: {data['counts']} ({data['note']})")
    print(f"{'page':42} {'p50 ms':>8} {'p95 ms':>8} {'x p50':>6} {'x p95':>6} {'x p95 healthz':>13} {'SQL':>4}")
    for name, r in results.items():
        print(f"{name:42} {r['p50_ms']:8.2f} {r['p95_ms']:8.2f} {r['p50_ratio']:6.1f} {r['p95_ratio']:6.1f} "
              f"{r['p95_ratio_to_healthz']:13.1f} {r['queries']:4d}")
    print(f"tenant dashboard p95 {dash['p95_ms']} ms (target <= {TARGET_P95_MS}), {dash['p95_ratio']}x the signed-in "
          f"trivial page /ping (target <= {TARGET_RATIO}x; {dash['p95_ratio_to_healthz']}x /healthz): "
          f"{'met' if verdict['meets_targets'] else 'NOT met'}")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
