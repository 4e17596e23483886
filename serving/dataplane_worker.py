"""gunicorn's worker class for the gateway's data plane (serving.dataplane): uvicorn's worker,
with its fast event loop and HTTP parser asked for by name and its access log off (the ingress
controller logs every /v1/ request; the ledger keeps every billed one with its request id).

Why gunicorn around uvicorn: gunicorn.conf.py's `reuse_port` gives each process its own
listening socket, so the kernel spreads connections over the processes; uvicorn's own
`--workers` share one socket, and whichever process wakes first takes the connections (in
bench/gateway.py the added p50 moved between +7.6 and +15 ms from one run to the next). And
gunicorn's graceful stop and `worker_exit` hook drain the metering writer as for the portal.

    gunicorn serving.dataplane:application -k serving.dataplane_worker.Worker -w 2
"""

from uvicorn_worker import UvicornWorker


class Worker(UvicornWorker):
    CONFIG_KWARGS = {"loop": "uvloop", "http": "httptools", "lifespan": "on", "access_log": False}
