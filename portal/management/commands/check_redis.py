"""Exit non-zero with one clear line when Redis is not reachable (used by `make run`)."""

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from portal.management.commands.run_all import redis_problem


class Command(BaseCommand):
    help = "Check that Redis answers."

    def handle(self, *args, **opts):
        problem = redis_problem()
        if problem:
            raise CommandError(
                f"Redis is not reachable at {settings.REDIS_URL} ({problem}). Start it with "
                "'redis-server --daemonize yes --bind 127.0.0.1 --port 6379' or set REDIS_URL."
            )
        self.stdout.write(f"Redis answers at {settings.REDIS_URL}.")
