"""`make run`: the web server, an RQ worker and the scheduler loop together in the foreground.

Checks Redis first and stops with one clear line (and how to start it) when it is not
there. Ctrl-C (or SIGTERM) stops all three processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from portal.management.commands.seed_demo import ACCOUNTS, DEMO_PASSWORD


def redis_problem() -> str:
    import redis

    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        return f"{exc.__class__.__name__}: {exc}"
    return ""


class Command(BaseCommand):
    help = "Run the portal, an RQ worker and the scheduler loop until Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--addr", default="127.0.0.1:8000")

    def handle(self, *args, addr: str, **opts):
        problem = redis_problem()
        if problem:
            raise CommandError(
                f"Redis is not reachable at {settings.REDIS_URL} ({problem}). Start it with "
                "'redis-server --daemonize yes --bind 127.0.0.1 --port 6379' or set REDIS_URL."
            )
        self.stdout.write(f"\nAtrium on http://{addr}/  — demo accounts (password '{DEMO_PASSWORD}'):")
        for username, (title, _roles) in ACCOUNTS.items():
            self.stdout.write(f"  {username:16} {title}")
        self.stdout.write("Ctrl-C stops the web server, the worker and the scheduler loop.\n")
        manage = [sys.executable, str(settings.BASE_DIR / "manage.py")]
        procs = [
            subprocess.Popen([*manage, "runserver", "--noreload", addr]),  # nosec B603 # our own manage.py, no shell
            subprocess.Popen([*manage, "rqworker", "scheduling", "metering", "reports", "default",  # nosec B603 # our own manage.py
                              "--worker-class", "metering.worker.SimpleWorker", "--verbosity", "0"]),
            subprocess.Popen([*manage, "run_scheduler"]),  # nosec B603 # our own manage.py, no shell
            # the demo's model server behind the chat-assistant service (OpenAI-compatible)
            subprocess.Popen([*manage, "run_upstream", "--port", "8001"]),  # nosec B603 # our own manage.py, no shell
        ]
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            while not stopping and all(p.poll() is None for p in procs):
                time.sleep(0.5)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.time() + 10
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
        failed = [p.args[2] for p in procs if p.returncode not in (0, -signal.SIGTERM, None) and not stopping]
        if failed:
            raise CommandError(f"stopped because {', '.join(failed)} exited")
