"""Start the demo OpenAI-compatible upstream (serving/upstream.py) in the foreground."""

from django.core.management.base import BaseCommand

from serving import upstream


class Command(BaseCommand):
    help = "Run the demo OpenAI-compatible model server on loopback (for make run and local testing)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8001)
        parser.add_argument("--latency-ms", type=int, default=0)

    def handle(self, *args, host, port, latency_ms, **options):
        upstream.main(["--host", host, "--port", str(port), "--latency-ms", str(latency_ms)])
