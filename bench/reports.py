"""Benchmark: a monthly chargeback report of every tenant over the seed_scale data
(BENCHMARKS.md section 4), timed next to one hand-written SQL GROUP BY over the same ledger
rows in the same run (the floor).

The report is built exactly as the RQ job builds it (metering.services.build_report: rows
read through the finance user's visibility, priced per hour, idle cost shared by use, CSV,
XLSX and FOCUS files written), in this process, so the time is the job's time without queue
latency. The floor is `SELECT tenant_id, SUM(milli_card_seconds) ... GROUP BY tenant_id` for
the same month. Beside it, for the breakdown only: the build's parts timed one by one (data,
CSV, XLSX, FOCUS), the same rows grouped at the report's detail (project, accelerator
model, pool), which is the GROUP BY a chargeback cannot do without, and the floor run with
PostgreSQL's JIT off as the report runs its ledger queries (the floor itself runs with the
server's settings, as written). Writes
bench/results/reports.json. A measurement, not a timed test; it only adds one Report row (and
its files) per run, plus the month's rollups it recomputes first.

    DATABASE_URL=postgres://.../db_with_seed_scale .venv/bin/python bench/reports.py [--runs 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from metering import exports, services  # noqa: E402
from metering.models import ReportGrouping, ReportMode, UsageRecord  # noqa: E402

FLOOR_SQL = """SELECT tenant_id, SUM(milli_card_seconds) FROM metering_usagerecord
               WHERE hour >= %s AND hour < %s GROUP BY tenant_id"""
# Not the floor, a reference printed beside it: the same rows grouped at the detail a chargeback
# needs anyway (a price per accelerator model, FOCUS lines per project, model and pool).
DETAIL_SQL = """SELECT project_id, accelerator_model_id, pool_id, SUM(milli_card_seconds) FROM metering_usagerecord
                WHERE hour >= %s AND hour < %s GROUP BY project_id, accelerator_model_id, pool_id"""


def timed_sql(sql: str, params, jit: bool = True) -> tuple[float, list]:
    t = time.perf_counter()
    with transaction.atomic(), connection.cursor() as cur:
        if not jit:
            cur.execute("SET LOCAL jit = off")
        cur.execute(sql, params)
        rows = cur.fetchall()
    return time.perf_counter() - t, rows


def phases(report) -> dict[str, float]:
    """The build's parts one by one (data, then each file written to memory), for the breakdown."""
    out = {}
    t = time.perf_counter()
    lines = exports.report_lines(report)  # ledger query, pricing, idle share, grouping
    out["data"] = time.perf_counter() - t
    for name, write in (("csv", lambda f: exports.write_csv(lines, f)), ("xlsx", lambda f: exports.write_xlsx(report, lines, f)),
                        ("focus", lambda f: exports.write_focus(report, lines, f))):
        buf = io.BytesIO() if name == "xlsx" else io.StringIO()
        t = time.perf_counter()
        write(buf)
        out[name] = time.perf_counter() - t
    return out


def busiest_month() -> dt.date:
    with connection.cursor() as cur:
        cur.execute("SELECT date_trunc('month', hour) m, count(*) FROM metering_usagerecord GROUP BY m ORDER BY 2 DESC LIMIT 1")
        row = cur.fetchone()
    if not row:
        sys.exit("no usage rows: run `manage.py seed_scale` first")
    return row[0].date()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--user", default="scale-finance")
    parser.add_argument("--whole", action="store_true",
                        help="also time one report over every ledger row (all months) against the floor over all rows")
    args = parser.parse_args()
    finance = get_user_model().objects.get(username=args.user)
    month = busiest_month()
    end = services.next_month(month)
    lo, hi = services.day_start(month), services.day_start(end)
    rows_in_month = UsageRecord.objects.filter(hour__gte=lo, hour__lt=hi).count()
    total_rows = UsageRecord.objects.count()

    t = time.perf_counter()
    services.rollup(month, end - dt.timedelta(days=1), accrue_first=False)  # idle cost per pool for chargeback
    rollup_s = time.perf_counter() - t

    floors, floors_nojit, details, builds, parts, lines = [], [], [], [], [], 0
    for _ in range(args.runs):
        floor_s, floor_rows = timed_sql(FLOOR_SQL, [lo, hi])
        floors.append(floor_s)
        report = services.request_report(finance, period_start=month, period_end=end, grouping=ReportGrouping.TENANT,
                                         mode=ReportMode.CHARGEBACK, enqueue=False)
        t = time.perf_counter()
        report = services.build_report(report.pk)
        builds.append(time.perf_counter() - t)
        lines = report.lines
        parts.append(phases(report))
        details.append(timed_sql(DETAIL_SQL, [lo, hi])[0])
        floors_nojit.append(timed_sql(FLOOR_SQL, [lo, hi], jit=False)[0])
    floor, build = statistics.median(floors), statistics.median(builds)
    breakdown = {k: round(statistics.median(p[k] for p in parts), 3) for k in parts[0]}
    data = breakdown["data"]
    result = {
        "benchmark": "monthly chargeback report, every tenant (BENCHMARKS.md section 4)",
        "month": month.isoformat(), "ledger_rows_total": total_rows, "ledger_rows_in_month": rows_in_month,
        "tenants_in_floor": len(floor_rows), "report_lines": lines, "runs": args.runs,
        "floor_group_by_s": round(floor, 3), "report_build_s": round(build, 3), "ratio": round(build / floor, 2),
        "report_data_only_s": data, "data_only_ratio": round(data / floor, 2),
        "breakdown_s": breakdown,
        "detail_group_by_s": round(statistics.median(details), 3),
        "floor_without_jit_s": round(statistics.median(floors_nojit), 3),
        "ratio_to_floor_without_jit": round(build / statistics.median(floors_nojit), 2),
        "rollup_month_s": round(rollup_s, 2), "all_floor_s": [round(x, 3) for x in floors],
        "all_build_s": [round(x, 3) for x in builds],
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "target": "build <= 10 s and <= 3x the floor",
        "meets_target": build <= 10 and build / floor <= 3,
        "postgres": connection.cursor().connection.info.server_version, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if args.whole:
        with connection.cursor() as cur:
            cur.execute("SELECT min(hour), max(hour) FROM metering_usagerecord")
            first, last = cur.fetchone()
        start, stop = first.date().replace(day=1), services.next_month(last.date())
        whole_span = [services.day_start(start), services.day_start(stop)]
        whole_floor = timed_sql(FLOOR_SQL, whole_span)[0]
        report = services.request_report(finance, period_start=start, period_end=stop, grouping=ReportGrouping.TENANT,
                                         mode=ReportMode.CHARGEBACK, enqueue=False)
        t = time.perf_counter()
        services.build_report(report.pk)
        whole_build = time.perf_counter() - t
        whole_nojit = timed_sql(FLOOR_SQL, whole_span, jit=False)[0]
        result["whole_data"] = {"period": f"{start}..{stop}", "rows": total_rows, "floor_group_by_s": round(whole_floor, 3),
                                "report_build_s": round(whole_build, 3), "ratio": round(whole_build / whole_floor, 2),
                                "floor_without_jit_s": round(whole_nojit, 3)}
        print(f"all {total_rows:,} rows ({start}..{stop}): floor {whole_floor:.3f}s  report {whole_build:.3f}s  "
              f"ratio {whole_build / whole_floor:.2f}  (floor with JIT off {whole_nojit:.3f}s)")
    out = ROOT / "bench" / "results" / "reports.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"month {month}: {rows_in_month:,} of {total_rows:,} ledger rows, {lines} lines")
    print(f"floor GROUP BY {floor:.3f}s  report {build:.3f}s  ratio {build / floor:.2f}  (target <= 10 s, <= 3x)")
    print(f"data part alone (no files) {data:.3f}s  ratio {data / floor:.2f}; files: "
          + "  ".join(f"{k} {v:.3f}s" for k, v in breakdown.items() if k != "data"))
    print(f"reference, not the floor: the same rows grouped by (project, model, pool) {result['detail_group_by_s']:.3f}s; "
          f"the floor with JIT off, as the report runs its ledger query, {result['floor_without_jit_s']:.3f}s "
          f"(report / that {result['ratio_to_floor_without_jit']:.2f})  load average {result['load_average'][0]}")
    print(f"written {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
