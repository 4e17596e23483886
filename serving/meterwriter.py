"""Metering off the client's path: one writer thread per process writes answered gateway
requests in batches.

The gateway answers first and meters after (serving.gateway.MeteredResponse, a stream when
it ends). Metered on the request's own thread, the write still held the client's kept-alive
connection, so its next request waited for the statement, and concurrent requests of one key
queued on their hourly rollup row's lock, one after the other (bench/gateway.py, 32 clients:
the metering write took 1.5 ms at p50 and 10-26 ms at p99, all of it added to the next
request of that client). Handed to this writer, the request's thread is free as soon as the
answer is written. The writer takes everything queued meanwhile and writes it with one
statement (serving.services.record_usages: exactly once per uid, one rollup upsert per hour,
key and service of the batch), then adds the tokens to the rate-limit windows in one Redis
pipeline. Then it lets the next batch gather for GATHER seconds (ATRIUM_METER_GATHER_MS,
default 50 ms) before it writes again: a lone request is written at once, and under load one
statement and one pipeline carry every request of those 50 ms. Each write costs two round
trips and wakes this thread; with no pause the batches held 1.4 requests on average at 32
clients, and PostgreSQL spent 1.06-1.16 ms of CPU per gateway request against 0.63-0.82 ms
with it (bench/gateway.py, gunicorn, 32 clients x 100 ms; the added latency moved within the
runs' noise). flush() and stop() cut the pause short; a stopping writer never pauses.

- Exactly once: record_usages skips a uid already recorded, so a batch whose commit was lost
  with its connection is simply written again.
- Database unavailable: the batch is kept and written again with backoff (0.05 s doubling to
  5 s) until it succeeds. A batch that fails for another reason is written request by
  request, so one bad request cannot hold back the others; a request that cannot be written
  is logged with its uid, as a failure to meter always was.
- A worker stopping (SIGTERM, gunicorn's graceful stop): the queue is drained before the
  process exits (gunicorn's worker_exit hook in gunicorn.conf.py, atexit otherwise), for up
  to STOP_TIMEOUT; what is still not written then is logged with its uids.
- What is lost: a process killed outright (SIGKILL, out of memory) loses the requests queued
  and not yet committed - those answered in the last milliseconds - as it always lost the
  request it was metering; the pause makes that up to GATHER seconds of answers.
- A caller inside a transaction (a test's transaction, ATOMIC_REQUESTS) is metered on its
  own thread and connection: another connection would not see what it has not committed.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection
from redis.exceptions import RedisError

from serving import ratelimit
from serving import services as svc

log = logging.getLogger("atrium.gateway")

MAX_BATCH = 500
GATHER = settings.ATRIUM_METER_GATHER_MS / 1000
STOP_TIMEOUT = 10.0
BACKOFF_FIRST, BACKOFF_MAX = 0.05, 5.0


@dataclass(frozen=True)
class Job:
    usage: svc.Usage
    limits: tuple[ratelimit.Limit, ...]  # the request's rate limits, to add its tokens to


def record(batch: list[Job]) -> set:
    """Write a batch now, on the caller's connection; add the recorded tokens to the rate
    limits. Returns the uids recorded (a repeated uid is not). Database errors propagate."""
    jobs = {job.usage.uid: job for job in batch}.values()  # a uid twice in one batch counts once
    recorded = svc.record_usages([job.usage for job in jobs])
    done = [job for job in jobs if job.usage.uid in recorded]
    spent = [(list(job.limits), job.usage.tokens) for job in done]
    months = [(job.usage.project_id, svc.month_start(job.usage.time), job.usage.tokens) for job in done]
    try:
        ratelimit.add_tokens_many(spent, months=months)
    except RedisError:
        log.warning("tokens of %d metered requests not added to the rate-limit windows (Redis unavailable)",
                    len(spent))
    return recorded


class MeterWriter:
    def __init__(self, *, max_batch: int = MAX_BATCH, gather: float | None = None):
        self.max_batch = max_batch
        self.gather = GATHER if gather is None else gather
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._writing = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_requested = threading.Event()
        self._hurry = threading.Event()  # flush() or stop(): no pause before the next batch
        self._deadline = 0.0
        self._batch: list[Job] = []  # being written
        self.batches = 0  # statements written by the thread (for tests and diagnostics)

    def after_fork(self) -> None:
        """A forked child has none of the parent's threads, and the parent's queue is the parent's."""
        self._reset()

    def submit(self, usage: svc.Usage, limits=()) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._stop_requested.clear()
                self._thread = threading.Thread(target=self._run, name="atrium-meter-writer", daemon=True)
                self._thread.start()
            self._queue.append(Job(usage, tuple(limits)))
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._writing

    def flush(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Wait until everything submitted so far is written (or given up on); False on timeout."""
        end = time.monotonic() + timeout
        self._hurry.set()
        with self._cond:
            while self._queue or self._writing:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Drain the queue and end the thread; True when every submitted request was written.
        A second call after one that ran out of time gives up at once (worker_exit, then atexit)."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return True
            if self._stopping and time.monotonic() >= self._deadline:
                return False
            self._stopping = True
            self._deadline = time.monotonic() + timeout
            self._stop_requested.set()
            self._hurry.set()
            self._cond.notify_all()
        thread.join(timeout + 1.0)
        with self._cond:
            left = [job.usage.uid for job in self._batch + list(self._queue)]
            if self._thread is thread and not thread.is_alive():
                self._thread = None
        if left or thread.is_alive():
            log.error("gateway stopping: %d answered requests not metered (uids %s)", len(left),
                      ", ".join(str(u) for u in left[:50]))
            return False
        return True

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                    if not self._queue:
                        return  # stopping, and everything was written
                    batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]
                    self._writing, self._batch = len(batch), batch
                if connection.close_at is not None and time.monotonic() >= connection.close_at:
                    connection.close()  # DATABASE_CONN_MAX_AGE, as at the end of a request
                try:
                    self._write(batch)
                finally:
                    with self._cond:
                        self.batches += 1
                        self._writing, self._batch = 0, []
                        self._cond.notify_all()
                # let the next batch gather; requests submitted meanwhile do not wake this thread
                # (nobody waits on the condition), flush() and stop() end the pause at once
                if self.gather > 0 and not self._stopping and self._hurry.wait(self.gather):
                    self._hurry.clear()
        finally:
            connection.close()  # this thread's own connection

    def _write(self, batch: list[Job]) -> None:
        delay = BACKOFF_FIRST
        while True:
            try:
                record(batch)
                return
            except (OperationalError, InterfaceError) as exc:  # the connection or the server: write it again
                connection.close()
                if self._stopping and time.monotonic() >= self._deadline:
                    log.error("gateway stopping with the database unavailable: %d answered requests not metered "
                              "(uids %s)", len(batch), ", ".join(str(j.usage.uid) for j in batch[:50]))
                    return
                log.warning("metering %d gateway requests failed (%s); writing them again in %.2f s", len(batch),
                            type(exc).__name__, delay)
                if self._stopping:  # keep trying until the stop's deadline, not past it
                    time.sleep(max(0.0, min(delay, self._deadline - time.monotonic())))
                else:  # a stop() cuts the wait short
                    self._stop_requested.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX)
            except DatabaseError:
                if len(batch) > 1:  # find the one that cannot be written; write the others
                    for job in batch:
                        self._write([job])
                    return
                log.exception("gateway request %s was answered but could not be metered", batch[0].usage.uid)
                return
            except Exception:  # a bug: never let it end the thread
                log.exception("gateway requests %s were answered but could not be metered",
                              ", ".join(str(j.usage.uid) for j in batch[:50]))
                return


writer = MeterWriter()
atexit.register(writer.stop)
os.register_at_fork(after_in_child=writer.after_fork)


def meter(usage: svc.Usage, limits=()) -> None:
    """Meter one answered request: by the writer thread, or right here inside a transaction."""
    if connection.in_atomic_block:
        record([Job(usage, tuple(limits))])
    else:
        writer.submit(usage, limits)
