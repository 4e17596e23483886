"""Benchmark: gateway overhead (BENCHMARKS.md section 5).

Starts the repo's OpenAI-compatible upstream (serving/upstream.py) and the portal under
gunicorn, both on loopback, prepares one tenant/project/published service/API key through the
real services, then sends the same load (fixed concurrency, bounded time, one keep-alive
session per client thread) straight to the upstream and through the gateway. Prints p50/p99
latency and requests/s of both and the latency the gateway adds; writes JSON to
bench/results/gateway.json. A measurement, not a timed test. Needs PostgreSQL and Redis
(DATABASE_URL, REDIS_URL; default a dedicated atrium_bench_gateway database).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gateway.json"
LITELLM = {"p50_ms": "2-12", "p99_ms": "13-43"}  # LiteLLM proxy's own published overhead
TARGET = {"p50_ms": 5.0, "p99_ms": 25.0}  # issue 7 acceptance at 32 concurrent clients


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            requests.get(url, timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def ensure_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def prepare(env: dict, upstream_url: str) -> str:
    """Migrate and build the benchmark organisation in a child process; returns an API key."""
    code = f"""
import django, os
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0, interactive=False)
from django.contrib.auth import get_user_model
from portal import context
from scheduling import services as sched
from scheduling.models import PriorityClass, ResourceSpec, AcceleratorModel
from serving import services as svc
from serving.models import ModelService, ApiKey
from tenants import services as tenancy
from tenants.models import Tenant, Project
User = get_user_model()
with context.bound(sudo=True):
    admin, new = User.objects.get_or_create(username="bench-admin")
    if new:
        tenancy.grant_platform_role(admin, admin, "platform_admin", bootstrap=True)
        tenancy.grant_platform_role(admin, admin, "ops_engineer", bootstrap=True)
    model = AcceleratorModel.objects.filter(short_name="BL4").first()
    if model is None:
        model = sched.create_accelerator_model(admin, name="BENCH-L4", short_name="BL4", vendor="nvidia", memory_gib=24)
        pool = sched.create_pool(admin, name="bench")
        sched.register_node(admin, pool=pool, name="bench-0", cpu_milli=64_000, memory_mib=256 * 1024, model=model, cards=2)
    spec = ResourceSpec.objects.filter(name="bench l4").first() or sched.create_spec(
        admin, name="bench l4", models=[model], gpu_count=1, cpu_milli=1000, memory_mib=1024)
    prio = PriorityClass.objects.filter(name="bench").first() or sched.save_priority_class(
        admin, name="bench", value=7, preemptible=True, allowed_project_classes=[], allowed_roles=[])
    tenant = Tenant.objects.filter(slug="bench").first() or tenancy.create_tenant(admin, slug="bench", name="Bench")
    project = Project.objects.filter(tenant=tenant, slug="bench-p").first() or tenancy.create_project(
        admin, tenant, slug="bench-p", name="bench", project_class="research")
    user, new = User.objects.get_or_create(username="bench-user")
    if new:
        tenancy.add_project_member(admin, project, user, "project_admin")
    service = ModelService.objects.filter(tenant=tenant, slug="bench-chat").first()
    if service is None:
        service = svc.create_model_service(user, project=project, slug="bench-chat", name="bench", base_model="demo-llm",
                                           spec=spec, priority_class=prio, upstream_url={upstream_url!r})
        svc.publish_service(user, service)
    ModelService.objects.filter(pk=service.pk).update(upstream_url={upstream_url!r})
    ApiKey.objects.filter(project=project, revoked__isnull=True).update(revoked=django.utils.timezone.now())
    key, secret = svc.create_api_key(user, project=project, name="bench", services=[service])
    print("KEY=" + secret)
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return next(line[4:] for line in out.stdout.splitlines() if line.startswith("KEY="))


def load(url: str, headers: dict, body: dict, *, concurrency: int, seconds: float, warmup: float) -> dict:
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    start = time.monotonic()
    measure_from = start + warmup
    stop_at = measure_from + seconds

    def client():
        session = requests.Session()
        session.trust_env = False
        mine, bad = [], 0
        while True:
            t0 = time.monotonic()
            if t0 >= stop_at:
                break
            try:
                r = session.post(url, json=body, headers=headers, timeout=30)
                ok = r.status_code == 200
            except requests.RequestException:
                ok = False
            t1 = time.monotonic()
            if t0 >= measure_from:
                if ok:
                    mine.append(t1 - t0)
                else:
                    bad += 1
        with lock:
            latencies.extend(mine)
            errors[0] += bad

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"requests": len(latencies), "errors": errors[0], "rps": round(len(latencies) / seconds, 1),
            "p50_ms": round(q[49] * 1000, 3), "p99_ms": round(q[98] * 1000, 3),
            "mean_ms": round(statistics.fmean(latencies) * 1000, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--workers", type=int, default=2, help="gunicorn worker processes")
    ap.add_argument("--threads", type=int, default=8, help="threads per gunicorn worker")
    ap.add_argument("--upstream-latency-ms", type=int, default=0)
    args = ap.parse_args()

    db = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/atrium_bench_gateway")
    ensure_database(db)
    env = {**os.environ, "DATABASE_URL": db, "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/13"),
           "DJANGO_SETTINGS_MODULE": "portal.settings", "DEBUG": "0", "ATRIUM_TESTING": "1",
           "SECRET_KEY": "bench-only-secret-key-0123456789abcdef-not-for-production", "SECURE_SSL_REDIRECT": "0",
           "SECURE_HSTS_SECONDS": "0", "SESSION_COOKIE_SECURE": "0", "CSRF_COOKIE_SECURE": "0", "LOG_LEVEL": "WARNING"}
    up_port, gw_port = free_port(), free_port()
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "serving.upstream", "--port", str(up_port),
                                       "--latency-ms", str(args.upstream_latency_ms)], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL))
        upstream = f"http://127.0.0.1:{up_port}/v1"
        wait_http(upstream + "/models")
        key = prepare(env, upstream)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "portal.wsgi", "-b", f"127.0.0.1:{gw_port}", "-w", str(args.workers),
             "--threads", str(args.threads), "--keep-alive", "30", "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{gw_port}/healthz")
        body = {"model": "bench-chat", "messages": [{"role": "user", "content": "how long is a piece of string"}],
                "max_tokens": 16}
        direct = load(upstream + "/chat/completions", {}, {**body, "model": "demo-llm"},
                      concurrency=args.concurrency, seconds=args.seconds, warmup=args.warmup)
        gateway = load(f"http://127.0.0.1:{gw_port}/v1/chat/completions", {"Authorization": f"Bearer {key}"}, body,
                       concurrency=args.concurrency, seconds=args.seconds, warmup=args.warmup)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)
    added = {"p50_ms": round(gateway["p50_ms"] - direct["p50_ms"], 3),
             "p99_ms": round(gateway["p99_ms"] - direct["p99_ms"], 3)}
    result = {
        "benchmark": "gateway overhead (BENCHMARKS.md section 5)",
        "concurrency": args.concurrency, "seconds": args.seconds, "gunicorn": f"{args.workers}x{args.threads}",
        "upstream_latency_ms": args.upstream_latency_ms,
        "direct": direct, "gateway": gateway, "added": added,
        "rps_ratio": round(gateway["rps"] / direct["rps"], 3) if direct["rps"] else None,
        "target_added": TARGET, "meets_target": added["p50_ms"] <= TARGET["p50_ms"] and added["p99_ms"] <= TARGET["p99_ms"],
        "litellm_published_overhead": LITELLM,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"direct : p50 {direct['p50_ms']:.2f} ms  p99 {direct['p99_ms']:.2f} ms  {direct['rps']:.0f} req/s")
    print(f"gateway: p50 {gateway['p50_ms']:.2f} ms  p99 {gateway['p99_ms']:.2f} ms  {gateway['rps']:.0f} req/s "
          f"({gateway['errors']} errors)")
    print(f"added  : p50 {added['p50_ms']:.2f} ms  p99 {added['p99_ms']:.2f} ms  (target <= 5 / 25 ms; "
          f"LiteLLM publishes {LITELLM['p50_ms']} / {LITELLM['p99_ms']} ms)")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
