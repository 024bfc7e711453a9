"""Exceptions the client raises; each maps to one gRPC status code so both ends agree."""

from __future__ import annotations

import grpc


class AtollError(RuntimeError):
    """Base class of every error atoll reports to its caller."""

    code = grpc.StatusCode.UNKNOWN


class InvalidInput(AtollError, ValueError):
    """The request was malformed or does not match the compiled program (shape, dtype, arguments)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(AtollError, LookupError):
    """An unknown job or worker id."""

    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(AtollError, PermissionError):
    """The call carried no cluster token, or the wrong one."""

    code = grpc.StatusCode.UNAUTHENTICATED


class NotPermitted(AtollError, PermissionError):
    """The caller is authenticated, but may not make this call (a worker's work comes only from
    the controller it registered with)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotEnoughWorkers(AtollError):
    """The program needs more live workers than the cluster has free."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class JobFailed(AtollError):
    """The job can no longer run: a worker died or a step failed part-way (state is undefined)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class WorkerUnavailable(AtollError):
    """A daemon could not be reached, or stopped answering."""

    code = grpc.StatusCode.UNAVAILABLE
    DAEMON = "daemon"
    """What a message says was not reached."""


class ControllerUnavailable(WorkerUnavailable):
    """The controller could not be reached (it is down, or restarting); the message names its
    address. A client sends its unanswered steps again for a while first (``reconnect_timeout_s``)."""

    DAEMON = "controller"


class DeadlineExceeded(AtollError, TimeoutError):
    """A call or a data-plane wait ran past its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidInput,
        NotFound,
        Unauthenticated,
        NotEnoughWorkers,
        JobFailed,
        WorkerUnavailable,
        DeadlineExceeded,
        NotPermitted,
    )
}


def from_status(code: grpc.StatusCode, message: str) -> AtollError:
    return _BY_CODE.get(code, AtollError)(message)
