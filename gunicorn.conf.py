"""gunicorn's settings for the portal and its API gateway; gunicorn reads this file from the
working directory (the image's /app, the repository root in development and benchmarks).

Threaded workers (gthread), not gunicorn's default sync workers: the /v1/ gateway spends most
of a request waiting for a model server, and a streamed completion holds its request for as
long as the model writes. A sync worker would be one whole process per stream, cut off by
`timeout`; a gthread worker serves many requests at once from one process (the GIL is
released while waiting) and its `timeout` watches the worker's loop, not each request.
Processes: WEB_CONCURRENCY (gunicorn's own variable; 2 per CPU is a good start), each with
`threads` request threads: the number of requests, streams included, one replica serves at
once. Size it from the expected concurrent streams, not from the CPUs: a waiting thread costs
memory, not CPU. bench/gateway.py measures the choice (docs/api-keys-and-gateway.md). Flags on
the command line or in GUNICORN_CMD_ARGS (`--threads 32`) override what is set here.
"""

worker_class = "gthread"
# 32: a process accepts kept-alive connections as they come, so one of two processes may hold
# 20 of 32 clients; with 16 threads the extra ones waited a whole model answer (bench/gateway.py,
# 32 clients x 500 ms upstream: +508 ms p50 with 16 threads, +5 ms with 32). Each busy thread
# holds its own PostgreSQL connection: processes x threads must stay under max_connections
# (or put PgBouncer in front), see docs/deployment.md.
threads = 32
# Idle keep-alive connections from the proxy in front stay open between requests.
keepalive = 30


# Each process gets its own listening socket (SO_REUSEPORT) and the kernel spreads new
# connections over them. With one shared socket, whichever process woke first took them: in
# bench/gateway.py one of two processes held 31 of 32 clients while the other idled, and the
# gateway's added p99 swung from +36 to +204 ms between identical runs. Caveat: connections
# queued on a process that dies (not ones being served) are reset; clients and proxies retry
# a reset connection.
reuse_port = True


def worker_exit(server, worker):
    """Drain the gateway's metering writer before the process ends (serving.meterwriter)."""
    import sys

    meterwriter = sys.modules.get("serving.meterwriter")  # loaded only if this worker served the gateway
    if meterwriter is not None:
        meterwriter.writer.stop()
