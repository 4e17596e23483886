"""Delete sign-in failure counters that no longer count (older than the lockout cool-off).

django-axes already deletes them at every sign-in, failed sign-in and sign-out; this command is
for a quiet installation's cron. It never lifts a current lockout (`axes_reset_username` does).
"""

from django.core.management.base import BaseCommand

from portal.lockout import prune_expired_attempts


class Command(BaseCommand):
    help = "Delete sign-in failure counters older than ATRIUM_LOGIN_LOCKOUT_MINUTES."

    def handle(self, *args, **options):
        deleted = prune_expired_attempts()
        self.stdout.write(f"deleted {deleted} expired sign-in failure counters")
