"""`manage.py verify_audit`: walk the audit hash chain and say whether it is intact.

Prints "audit chain intact: N events" and exits 0, or names the first broken event and why
and exits 1. It only reads; it never repairs or rewrites an event.
"""

from __future__ import annotations

import sys

from django.core.management.base import BaseCommand

from portal.audit import verify_chain


class Command(BaseCommand):
    help = "Verify the audit log's hash chain; exit 1 and name the first broken event if it is not intact."

    def handle(self, *args, **options):
        report = verify_chain()
        if report.ok:
            self.stdout.write(f"audit chain intact: {report.checked} events")
            return
        self.stderr.write(
            f"audit chain broken at event {report.broken_id}: {report.problem} "
            f"({report.checked} events before it are intact)"
        )
        sys.exit(1)
