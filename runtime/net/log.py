"""Structured log lines: every record a daemon writes carries the worker, job and step it is about.

The job and step are context variables, set around the work of one request (a worker loading a
plan or running a step, the controller dispatching a step) and reset after it, so a request
thread of the gRPC pool never carries them into its next request. The worker id is one per
process (set when the worker registers). ``ContextFilter`` copies all three onto each record;
the CLI's log format prints them:

    2025-01-01 12:00:00,000 WARNING atoll.worker.daemon [worker=w1 job=job0 step=7] ...

Setting and resetting two context variables costs well under a microsecond: cheap enough for
every step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s [worker=%(worker)s job=%(job)s step=%(step)s] %(message)s"

_job: contextvars.ContextVar[str] = contextvars.ContextVar("atoll_job", default="-")
_step: contextvars.ContextVar[str] = contextvars.ContextVar("atoll_step", default="-")
_worker = "-"


def set_worker(worker_id: str) -> None:
    """This process's worker id (a worker daemon, once registered)."""
    global _worker
    _worker = worker_id or "-"


@contextlib.contextmanager
def context(job: str = "", step: int | None = None):
    """Within the block, log records name ``job`` and ``step`` (the client's step number, from 1)."""
    job_token = _job.set(job or "-")
    step_token = _step.set("-" if not step else str(step))
    try:
        yield
    finally:
        _step.reset(step_token)
        _job.reset(job_token)


def in_context(of):
    """Decorate a method ``(self, request, ...)``: it runs in ``context(*of(request))``, where
    ``of`` returns (job id, step number or None)."""

    def decorate(method):
        @functools.wraps(method)
        def wrapped(self, request, *args, **kwargs):
            with context(*of(request)):
                return method(self, request, *args, **kwargs)

        return wrapped

    return decorate


class ContextFilter(logging.Filter):
    """Adds ``worker``, ``job`` and ``step`` to every record (attach it to a handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = _worker
        record.job = _job.get()
        record.step = _step.get()
        return True


def configure(level: str) -> None:
    """Log to stderr at ``level`` with the structured format (the CLI's daemons and commands)."""
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
