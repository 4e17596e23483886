"""The `atrium` command: log in with a personal access token, then look at and submit jobs.

Human-readable tables by default, `--json` for scripts. Every failure prints one sentence on
stderr and exits with a code that says what kind of failure it was (EXIT_* below), so a
script can tell "not logged in" from "no such job" from "the server is down".
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time

from atrium_cli import __version__, config
from atrium_cli.client import ApiError, Client

EXIT_OK = 0
EXIT_ERROR = 1  # anything not listed below
EXIT_USAGE = 2  # bad command line (argparse) or not logged in
EXIT_AUTH = 3  # the token is missing, unknown, expired or revoked
EXIT_FORBIDDEN = 4  # signed in, but not allowed (scope or role)
EXIT_NOT_FOUND = 5  # no such object within your reach
EXIT_INVALID = 6  # the server refused the request's content (validation, conflict)
EXIT_RATE_LIMITED = 7
EXIT_UNAVAILABLE = 8  # server unreachable or failing (5xx)
EXIT_TIMEOUT = 9  # --wait gave up

FINAL_STATES = ("succeeded", "failed", "cancelled")


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


def exit_code_for(err: ApiError) -> int:
    if err.type == "bad-url":
        return EXIT_USAGE
    if err.status == 0 or err.status >= 500:
        return EXIT_UNAVAILABLE
    return {401: EXIT_AUTH, 403: EXIT_FORBIDDEN, 404: EXIT_NOT_FOUND, 409: EXIT_INVALID, 422: EXIT_INVALID,
            429: EXIT_RATE_LIMITED}.get(err.status, EXIT_ERROR)


def sentence(err: ApiError) -> str:
    detail = err.detail.rstrip(".")
    if err.status == 401:
        return f"Not logged in: {detail}. Run 'atrium login' with a fresh token."
    if err.status == 429 and err.retry_after:
        return f"Too many changes: {detail}."
    if err.slug == "validation-error" and err.errors:
        return "The server refused the request: " + "; ".join(
            f"{e.get('field') or 'request'}: {e.get('message')}" for e in err.errors) + "."
    return f"{detail}."


# --- output --------------------------------------------------------------------------------


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    if not rows:
        return "(none)"
    cells = [[_cell(r.get(key)) for key, _ in columns] for r in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (_, title) in enumerate(columns)]
    lines = ["  ".join(title.ljust(w) for (_, title), w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, str) and len(value) >= 19 and value[10:11] == "T":
        return value[:16].replace("T", " ")  # ISO time -> "YYYY-MM-DD HH:MM"
    return str(value)


def emit(args, data, render) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(render(data))


JOB_COLUMNS = [("id", "ID"), ("project_label", "PROJECT"), ("name", "NAME"), ("state", "STATE"), ("spec", "SPEC"),
               ("priority_class", "PRIORITY"), ("submitted", "SUBMITTED"), ("waiting", "WAITING FOR")]


def _job_row(j: dict) -> dict:
    return {**j, "project_label": f"{j['project']['tenant']}/{j['project']['slug']}",
            "waiting": j.get("wait_message") if j.get("state") == "pending" else ""}


def render_job(j: dict) -> str:
    lines = [
        f"Job {j['id']}  {j['name']}",
        f"  project   {j['project']['tenant']}/{j['project']['slug']}   submitted by {j['submitter']}",
        f"  state     {j['state']}" + (f"   queue position {j['queue_position']}" if j.get("queue_position") else ""),
    ]
    if j["state"] == "pending":
        lines.append(f"  waiting   {j['wait_reason'] or 'queued'}: {j['wait_message']}")
    lines += [
        f"  spec      {j['spec']} x{j['replicas']}   priority {j['priority_class']}",
        f"  image     {j['image']}",
        f"  command   {' '.join(j['command'])}",
        f"  times     submitted {_cell(j['submitted'])}  started {_cell(j['started'])}  finished {_cell(j['finished'])}",
    ]
    if j.get("bindings"):
        lines.append("  cards")
        for b in j["bindings"]:
            part = b["mig_profile"] or f"{b['share']:g} of the card"
            share = "" if b["share"] == 1 else f" ({part})"
            lines.append(f"    {b['node']} {b['accelerator']} {b['accelerator_model']}{share} "
                         f"from {_cell(b['start'])} to {_cell(b['end'])} {b['end_reason']}".rstrip())
    if j.get("events"):
        lines.append("  events")
        lines += [f"    {_cell(e['time'])}  {e['message']}" for e in j["events"][-10:]]
    return "\n".join(lines)


# --- commands -------------------------------------------------------------------------------


def client_from(args) -> Client:
    cfg = config.load()
    url = args.url or cfg.get("url")
    token = cfg.get("token")
    if not url or not token:
        raise CliError("Not logged in: run 'atrium login --url https://your-atrium' first.", EXIT_USAGE)
    return Client(url, token, timeout=args.timeout)


def cmd_login(args) -> int:
    url = (args.url or config.load().get("url") or "").rstrip("/")
    if not url:
        raise CliError("Say which portal to log in to: atrium login --url https://your-atrium", EXIT_USAGE)
    if args.token_stdin or not sys.stdin.isatty():
        token = sys.stdin.readline().strip()
    else:
        print(f"Create a token at {url}/api/tokens/ and paste it here.", file=sys.stderr)
        token = getpass.getpass("Token: ").strip()
    if not token:
        raise CliError("No token given.", EXIT_USAGE)
    me = Client(url, token, timeout=args.timeout).get("/me")
    path = config.save({"url": url, "token": token, "username": me["username"]})
    data = {"url": url, "username": me["username"], "scope": me["token_scope"], "expires": me["token_expires"],
            "config": str(path)}
    emit(args, data, lambda d: f"Logged in to {d['url']} as {d['username']} (token scope {d['scope']}, "
                               f"expires {_cell(d['expires'])}); saved in {d['config']}.")
    return EXIT_OK


def cmd_logout(args) -> int:
    removed = config.forget()
    print("Logged out: the token was removed from this machine (revoke it in the portal if it leaked)."
          if removed else "Not logged in.")
    return EXIT_OK


def cmd_whoami(args) -> int:
    me = client_from(args).get("/me")
    emit(args, me, lambda d: f"{d['username']} ({d['auth']}, scope {d['token_scope']}, expires {_cell(d['token_expires'])})")
    return EXIT_OK


def cmd_specs(args) -> int:
    specs = client_from(args).get("/specs")
    emit(args, specs, lambda rows: table(rows, [("name", "SPEC"), ("mode", "MODE"), ("card_fraction", "CARDS"),
                                                ("accelerator_models", "MODELS"), ("cpu_cores", "CPU"),
                                                ("memory_gib", "MEM GiB"), ("isolation", "ISOLATION")]))
    return EXIT_OK


def cmd_projects(args) -> int:
    rows = client_from(args).get("/projects")
    emit(args, rows, lambda rs: table([{**r, "full": f"{r['tenant']}/{r['slug']}"} for r in rs],
                                      [("id", "ID"), ("full", "PROJECT"), ("name", "NAME"), ("project_class", "CLASS"),
                                       ("permissions", "YOU MAY")]))
    return EXIT_OK


def cmd_submit(args) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("Give the command to run after --, e.g. atrium submit ... -- python train.py", EXIT_USAGE)
    body = {"project": args.project, "spec": args.spec, "priority_class": args.priority, "image": args.image,
            "command": command, "replicas": args.replicas, "expected_minutes": args.expected_minutes,
            "time_limit_minutes": args.time_limit, "name": args.name or ""}
    job = client_from(args).post("/jobs", body)
    emit(args, job, lambda j: f"Submitted job {j['id']} ({j['name']}) to {j['project']['tenant']}/{j['project']['slug']}: "
                              f"{j['state']}, {j['wait_message'] or j['wait_reason']}")
    return EXIT_OK


def _jobs_page(client, args) -> dict:
    return client.get("/jobs", state=args.state, mine="true" if args.mine else None, q=args.name,
                      project=args.project_id, limit=args.limit, offset=args.offset)


def cmd_jobs(args) -> int:
    client = client_from(args)
    rounds = 0
    while True:
        page = _jobs_page(client, args)
        if args.json:
            print(json.dumps(page, sort_keys=True), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[H\033[2J", end="")
            print(table([_job_row(j) for j in page["items"]], JOB_COLUMNS))
            shown = len(page["items"])
            if page["count"] > shown:
                print(f"({shown} of {page['count']} jobs; --limit/--offset for more)")
            sys.stdout.flush()
        rounds += 1
        if not args.watch or (args.count and rounds >= args.count):
            return EXIT_OK
        time.sleep(args.interval)


def cmd_job(args) -> int:
    client = client_from(args)
    wanted = set(args.wait.split(",")) if args.wait else set()
    deadline = time.monotonic() + args.wait_timeout
    while True:
        job = client.get(f"/jobs/{args.id}")
        if not wanted or job["state"] in wanted:
            emit(args, job, render_job)
            return EXIT_OK
        if job["state"] in FINAL_STATES or time.monotonic() > deadline:
            emit(args, job, render_job)
            raise CliError(f"Job {args.id} is {job['state']}, not {' or '.join(sorted(wanted))}"
                           + (" (gave up waiting)." if job["state"] not in FINAL_STATES else "."), EXIT_TIMEOUT)
        time.sleep(args.interval)


def cmd_cancel(args) -> int:
    job = client_from(args).post(f"/jobs/{args.id}/cancel", {"reason": args.reason})
    emit(args, job, lambda j: f"Job {j['id']} is now {j['state']}.")
    return EXIT_OK


def cmd_quota(args) -> int:
    rows = client_from(args).get("/quotas", tenant=args.tenant)
    for r in rows:
        r["owner"] = f"{r['tenant']}/{r['project']}" if r["project"] else f"{r['tenant']} (tenant)"
        r["what"] = r["resource"] + (f" {r['accelerator_model']}" if r["accelerator_model"] else "")
        r["left"] = round(r["limit"] - r["in_use"], 3)
    emit(args, rows, lambda rs: table(rs, [("owner", "OWNER"), ("what", "RESOURCE"), ("in_use", "IN USE"),
                                           ("guaranteed", "GUARANTEED"), ("limit", "LIMIT"), ("left", "LEFT")]))
    return EXIT_OK


def cmd_usage(args) -> int:
    data = client_from(args).get("/usage", month=args.month, tenant=args.tenant)
    emit(args, data, lambda d: table(d["rows"], [("tenant", "TENANT"), ("project", "PROJECT"),
                                                 ("accelerator_model", "MODEL"), ("card_hours", "CARD-HOURS"),
                                                 ("cost", f"COST {d['currency']}")])
         + f"\nTotal {d['month']}: {d['total_card_hours']:g} card-hours, {d['total_cost']:.2f} {d['currency']}")
    return EXIT_OK


def _period(raw: str) -> tuple[str, str]:
    """"2026-11" -> the month; "2026-11-01..2026-12-01" -> that half-open range."""
    import datetime as dt

    try:
        if ".." in raw:
            lo, hi = (dt.date.fromisoformat(x) for x in raw.split("..", 1))
        else:
            lo = dt.date(int(raw[:4]), int(raw[5:7]), 1)
            hi = dt.date(lo.year + lo.month // 12, lo.month % 12 + 1, 1)
    except ValueError:
        raise CliError(f"--period {raw!r} is not a month (2026-11) or a range (2026-11-01..2026-12-01).", EXIT_USAGE)
    return lo.isoformat(), hi.isoformat()


def cmd_report(args) -> int:
    client = client_from(args)
    start, end = _period(args.period)
    body = {"period_start": start, "period_end": end, "grouping": args.group_by, "mode": args.mode}
    if args.tenant:
        body["tenant"] = args.tenant
    report = client.post("/reports", body)
    deadline = time.monotonic() + args.wait_timeout
    while report["status"] not in ("done", "failed"):
        if time.monotonic() > deadline:
            raise CliError(f"Report {report['id']} is still {report['status']} ({report['progress']}%); "
                           f"see it later with the portal (gave up waiting).", EXIT_TIMEOUT)
        time.sleep(args.interval)
        report = client.get(f"/reports/{report['id']}")
    if report["status"] == "failed":
        raise CliError(f"Report {report['id']} failed: {report['error'] or 'no reason given'}.")
    raw = client.download(f"/reports/{report['id']}/download", format=args.format)
    ext = "xlsx" if args.format == "xlsx" else "csv"
    path = args.output or f"atrium-report-{report['id']}{'-focus' if args.format == 'focus' else ''}.{ext}"
    if path == "-":
        sys.stdout.buffer.write(raw)
        return EXIT_OK
    with open(path, "wb") as fh:
        fh.write(raw)
    emit(args, {**report, "file": path}, lambda r: f"Report {r['id']} ({r['scope']}, {r['lines']} lines) saved to {r['file']}.")
    return EXIT_OK


# --- parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    common.add_argument("--url", help="portal URL (default: the one saved by 'atrium login')")
    common.add_argument("--timeout", type=float, default=30, help="seconds to wait for the server")

    parser = argparse.ArgumentParser(prog="atrium", description="Submit and follow GPU jobs on an Atrium portal.",
                                     parents=[common])
    parser.add_argument("--version", action="version", version=f"atrium {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    p = sub.add_parser("login", parents=[common], help="store an access token for this machine")
    p.add_argument("--token-stdin", action="store_true", help="read the token from standard input")
    p.set_defaults(func=cmd_login)
    sub.add_parser("logout", parents=[common], help="forget the stored token").set_defaults(func=cmd_logout)
    sub.add_parser("whoami", parents=[common], help="who the stored token acts as").set_defaults(func=cmd_whoami)
    sub.add_parser("specs", parents=[common], help="resource specs you can ask for").set_defaults(func=cmd_specs)
    sub.add_parser("projects", parents=[common], help="your projects").set_defaults(func=cmd_projects)

    p = sub.add_parser("submit", parents=[common], help="submit a job: atrium submit --project P --spec S "
                                                          "--priority C -- command args")
    p.add_argument("--project", required=True, help='project slug, "tenant/project" or id')
    p.add_argument("--spec", required=True, help="resource spec name (see 'atrium specs')")
    p.add_argument("--priority", required=True, help="priority class name")
    p.add_argument("--image", default="python:3.11-slim", help="container image (default %(default)s)")
    p.add_argument("--name", help="job name (default: the program's name)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--expected-minutes", type=int, default=60)
    p.add_argument("--time-limit", type=int, default=24 * 60, help="minutes before the job is stopped")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", parents=[common], help="list jobs (--watch to follow)")
    p.add_argument("--state", choices=["pending", "admitted", "running", "succeeded", "failed", "cancelled", "preempted"])
    p.add_argument("--mine", action="store_true", help="only jobs you submitted")
    p.add_argument("--name", help="part of the job name")
    p.add_argument("--project-id", type=int)
    p.add_argument("--limit", type=int, default=25)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds")
    p.add_argument("--interval", type=float, default=5)
    p.add_argument("--count", type=int, default=0, help="with --watch: stop after this many refreshes")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("job", parents=[common], help="one job with its wait reason, cards and events")
    p.add_argument("id", type=int)
    p.add_argument("--wait", metavar="STATES", help="poll until the job is in one of these states (comma-separated)")
    p.add_argument("--wait-timeout", type=float, default=600)
    p.add_argument("--interval", type=float, default=3)
    p.set_defaults(func=cmd_job)

    p = sub.add_parser("cancel", parents=[common], help="cancel a job")
    p.add_argument("id", type=int)
    p.add_argument("--reason", default="")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("quota", parents=[common], help="quota and current use of your tenants and projects")
    p.add_argument("--tenant")
    p.set_defaults(func=cmd_quota)

    p = sub.add_parser("usage", parents=[common], help="card-hours and cost of a month")
    p.add_argument("--month", required=True, help="YYYY-MM")
    p.add_argument("--tenant")
    p.set_defaults(func=cmd_usage)

    p = sub.add_parser("report", parents=[common], help="build and download a showback/chargeback report")
    p.add_argument("--period", required=True, help="a month (2026-11) or a range 2026-11-01..2026-12-01 (end excluded)")
    p.add_argument("--format", choices=["csv", "xlsx", "focus"], default="csv")
    p.add_argument("--group-by", choices=["tenant", "project", "accelerator_model", "model_service", "day"],
                   default="project")
    p.add_argument("--mode", choices=["showback", "chargeback"], default="showback")
    p.add_argument("--tenant", help="tenant slug (default: everything you may see)")
    p.add_argument("--output", "-o", help="file to write ('-' for standard output)")
    p.add_argument("--wait-timeout", type=float, default=300)
    p.add_argument("--interval", type=float, default=2)
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ApiError as err:
        print(f"atrium: {sentence(err)}", file=sys.stderr)
        return exit_code_for(err)
    except CliError as err:
        print(f"atrium: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
