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
threads = 16
# Idle keep-alive connections from the proxy in front stay open between requests.
keepalive = 30
