"""gRPC plumbing shared by both daemons and the client: servers with the token check, calls with
deadlines, and one mapping between atoll errors and status codes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
import traceback
from concurrent import futures

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll import errors
from atoll.net import address as _address
from atoll.net import chunked
from atoll.net import tls as _tls
from atoll.net.auth import TokenInterceptor, call_metadata

log = logging.getLogger("atoll")

# The calls that carry weights travel in pieces (atoll.net.chunked); this caps every other message.
MAX_MESSAGE_BYTES = 1 << 30
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a daemon that restarts (a controller on its state directory) is tried again within a
    # second or two, not after gRPC's default backoff of up to two minutes
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
ATOLL_ERROR_KEY = "atoll-error"
"""Trailing metadata of an error a daemon raised itself (naming its class): an UNAVAILABLE without
it is the transport's, the daemon was not reached (``unreachable``)."""


def _channel(api, address: str, tls: _tls.Tls | None):
    """A channel of ``api`` (grpc or grpc.aio) to ``address``, over TLS when the process or the
    caller has it."""
    if tls is None:
        return api.insecure_channel(address, options=CHANNEL_OPTIONS)
    return api.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)


def make_server(token: str, host: str, port: int, max_workers: int = 128) -> tuple[grpc.Server, int]:
    """A started-later server bound to host:port (port 0 picks a free one); returns the bound port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[TokenInterceptor(token)],
        options=CHANNEL_OPTIONS,
    )
    _check_free(host, port)
    tls = _tls.current()
    try:
        if tls is not None:
            bound = server.add_secure_port(_address.join(host, port), tls.server_credentials())
        else:
            bound = server.add_insecure_port(_address.join(host, port))
    except RuntimeError:  # newer gRPC raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise errors.WorkerUnavailable(f"could not bind {_address.join(host, port)}")
    return server, bound


def _check_free(host: str, port: int) -> None:
    """Refuse a host that does not resolve, or a port something already listens on, in one clear
    line (gRPC's own refusal also writes a log line of its C core to stderr). Binds as gRPC does,
    with SO_REUSEADDR, so a port left in TIME_WAIT by a daemon that just stopped counts as free."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as e:
        raise errors.WorkerUnavailable(f"could not bind {host}:{port}: {e.strerror or e}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise errors.WorkerUnavailable(f"could not bind {host}:{port}: {e.strerror}") from None


class Health:
    """A daemon's standard gRPC health service (``grpc.health.v1.Health``), answered without the
    token (atoll.net.auth) so ``grpc_health_probe`` and Kubernetes' gRPC probes can ask it. It reports
    the same status for the whole server ("") and for each of ``services`` (e.g. "atoll.v1.Worker");
    NOT_SERVING until ``set(True)``, and for good once ``shutdown()`` is called."""

    def __init__(self, server: grpc.Server, *services: str):
        self._servicer = grpc_health.HealthServicer()
        self._names = ("", *services)
        self.serving = True  # the servicer starts with "" SERVING: set(False) below overrides it
        self._down = False
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self.set(False)

    def set(self, serving: bool) -> None:
        if serving == self.serving or self._down:  # called on every heartbeat: mostly nothing to do
            return
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            self._servicer.set(name, status)

    def shutdown(self) -> None:
        """NOT_SERVING from now on (the daemon is stopping)."""
        self.serving, self._down = False, True
        self._servicer.enter_graceful_shutdown()


def rpc_handler(method):
    """Turn exceptions raised by a servicer method into gRPC status codes with clear messages."""

    @functools.wraps(method)
    def wrapped(self, request, context):
        try:
            return method(self, request, context)
        except errors.AtollError as e:
            context.set_trailing_metadata(((ATOLL_ERROR_KEY, type(e).__name__),))
            context.abort(e.code, str(e))
        except Exception as e:  # a bug or an unexpected torch error: report it, keep serving
            log.error("%s failed:\n%s", method.__name__, traceback.format_exc())
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: {type(e).__name__}: {e}")

    return wrapped


def rpc_stream_handler(method):
    """rpc_handler for a servicer method that yields its replies (server streaming)."""

    @functools.wraps(method)
    def wrapped(self, request, context):
        try:
            yield from method(self, request, context)
        except errors.AtollError as e:
            context.set_trailing_metadata(((ATOLL_ERROR_KEY, type(e).__name__),))
            context.abort(e.code, str(e))
        except Exception as e:
            log.error("%s failed:\n%s", method.__name__, traceback.format_exc())
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: {type(e).__name__}: {e}")

    return wrapped


def chunked_method(service: str):
    """The ``Chunked`` RPC of a servicer of ``service``: calls of any size in pieces (atoll.net.chunked)."""

    @rpc_stream_handler
    def Chunked(self, request_iterator, context):
        yield from chunked.serve(self, service, request_iterator, context)

    return Chunked


def _service_of(stub_class) -> str:
    return stub_class.__name__.removesuffix("Stub")


def _chunked_reply(service: str, method: str, head, parts: list[bytes]):
    return chunked.parse(chunked.message_types(service, method)[1], head, parts, f"reply of {method}")


class Answer:
    """The reply of a call in flight (``Endpoint.start``)."""

    def __init__(self, future, what: str, unavailable: type[errors.AtollError]):
        self._future, self._what, self._unavailable = future, what, unavailable

    def result(self):
        """The reply, or the call's atoll error (as ``Endpoint.call`` raises it)."""
        try:
            return self._future.result()
        except grpc.RpcError as e:
            raise as_atoll_error(e, self._what, self._unavailable) from None


class Endpoint:
    """A connection to one daemon: every call carries the token and a deadline."""

    def __init__(
        self,
        address: str,
        token: str,
        stub_class,
        default_timeout_s: float = 60.0,
        controller_key: str = "",
        tls: _tls.Tls | None = None,
        unavailable: type[errors.AtollError] = errors.WorkerUnavailable,
    ):
        self.address = address
        self.unavailable = unavailable
        """The error of a call that did not reach the daemon."""
        self._channel = _channel(grpc, address, _tls.current(tls))
        self._stub = stub_class(self._channel)
        self._service = _service_of(stub_class)
        self._metadata = call_metadata(token, controller_key)
        self.default_timeout_s = default_timeout_s

    def call(self, method: str, request, timeout_s: float | None = None, what: str | None = None):
        """``what`` names the call in its error (default: "METHOD on ADDRESS")."""
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        try:
            if method in chunked.CHUNKED_METHODS:  # weights ride in these: in pieces, of any size
                # a chunked call's request is built for it (a dispatch copies one it shares): its
                # weights need not be put back after the call
                pieces = chunked.pieces(method, request, keep=False)
                replies = self._stub.Chunked(pieces, timeout=timeout, metadata=self._metadata)
                return _chunked_reply(self._service, method, *chunked.assemble(replies))
            return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise as_atoll_error(e, what or f"{method} on {self.address}", self.unavailable) from None

    def start(self, method: str, request, timeout_s: float | None = None) -> Answer:
        """``call`` (of a method that is not chunked) started now and answered later, in gRPC's own
        threads: several calls to several daemons in flight without a Python thread each."""
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        future = getattr(self._stub, method).future(request, timeout=timeout, metadata=self._metadata)
        return Answer(future, f"{method} on {self.address}", self.unavailable)

    def stream(self, method: str, request, timeout_s: float | None = None):
        """A server-streaming call: an iterator of replies; errors come as atoll errors."""
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        replies = getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)
        try:
            yield from replies
        except grpc.RpcError as e:
            raise as_atoll_error(e, f"{method} on {self.address}", self.unavailable) from None

    def future(self, method: str, request, timeout_s: float | None = None) -> grpc.Future:
        """Start a call without waiting; ``resolve(future)`` gets its reply or atoll error."""
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        return getattr(self._stub, method).future(request, timeout=timeout, metadata=self._metadata)

    def settled(self, method: str, request, timeout_s: float | None = None) -> futures.Future:
        """``future``'s call made now, in this thread, and returned finished (its reply, or its
        ``grpc.RpcError``, set): for a caller that waits for the reply at once. A blocking call
        hands no reply between threads: 0.39-0.41 against 0.53 ms per small call here, and half
        the client's CPU."""
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        done: futures.Future = futures.Future()
        try:
            done.set_result(getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as e:
            done.set_exception(e)
        return done

    def resolve(self, future: grpc.Future, method: str, timeout_s: float | None = None):
        try:
            return future.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise errors.DeadlineExceeded(f"{method} on {self.address}: no answer within {timeout_s}s") from None
        except grpc.RpcError as e:
            raise as_atoll_error(e, f"{method} on {self.address}", self.unavailable) from None

    def close(self) -> None:
        self._channel.close()


class AsyncCalls:
    """Many unary calls in flight at once without a thread each: one asyncio loop thread drives
    them over ``grpc.aio`` channels (one per address, made on first use). Used for dispatch,
    where a step is one call per worker (or per relay group) and many steps may be in flight;
    a thread per call would cost more, and a bounded pool of them could deadlock by queuing
    part of a step behind its own waiting calls."""

    def __init__(self, token: str, stub_class, controller_key: str = "", step_channel=None):
        """``step_channel``: send ``RunStep`` calls as messages on a long-lived stream per worker,
        made by this class (atoll.net.step_channel.StepChannel, which builds on this module)."""
        self._token = token
        self._step_channel = step_channel
        self._step_channels: dict = {}
        self._metadata = call_metadata(token, controller_key)
        self._stub_class = stub_class
        self._service = _service_of(stub_class)
        self._channels: dict[str, tuple[grpc.aio.Channel, object]] = {}
        self._in_flight: dict[str, dict[futures.Future, tuple[str, futures.Future]]] = {}
        """Per address, the futures handed out for calls in flight -> (method, the call's own future)."""
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()

    def use_controller_key(self, key: str) -> None:
        """Carry the controller's key from now on (a worker relaying the controller's steps)."""
        self._metadata = call_metadata(self._token, key)

    def call(self, address: str, method: str, request, timeout_s: float) -> futures.Future:
        """Start the call now; a Future of its reply, or of its atoll error (or of ``abandon``'s)."""
        handed = futures.Future()
        running = asyncio.run_coroutine_threadsafe(self._call(address, method, request, timeout_s), self._loop)
        with self._lock:
            self._in_flight.setdefault(address, {})[handed] = (method, running)

        def ended(call: futures.Future) -> None:
            with self._lock:
                self._in_flight.get(address, {}).pop(handed, None)
            if call.cancelled():  # by abandon, which has settled ``handed`` already
                return
            with contextlib.suppress(futures.InvalidStateError):  # abandoned meanwhile
                if call.exception() is not None:
                    handed.set_exception(call.exception())
                else:
                    handed.set_result(call.result())

        running.add_done_callback(ended)
        return handed

    def abandon(self, address: str, methods: frozenset[str], error: errors.AtollError) -> int:
        """End the calls of ``methods`` in flight to ``address`` now with ``error`` (its daemon was
        declared dead: a frozen one would hold their callers until their deadlines); returns how many."""
        with self._lock:
            calls = self._in_flight.get(address, {})
            abandoned = {h: running for h, (method, running) in calls.items() if method in methods}
            for handed in abandoned:
                del calls[handed]
        for handed, running in abandoned.items():
            with contextlib.suppress(futures.InvalidStateError):
                handed.set_exception(error)
            running.cancel()
        return len(abandoned)

    async def _call(self, address: str, method: str, request, timeout_s: float):
        entry = self._channels.get(address)  # only touched on the loop's thread
        if entry is None:
            channel = _channel(grpc.aio, address, _tls.current())
            entry = self._channels[address] = (channel, self._stub_class(channel))
        if method == "RunStep" and self._step_channel is not None:
            step_channel = self._step_channels.get(address)
            if step_channel is None or step_channel.broken is not None:
                step_channel = self._step_channels[address] = self._step_channel(entry[1], self._metadata, address)
            return await step_channel.run(request, timeout_s)
        try:
            if method in chunked.CHUNKED_METHODS:
                pieces = chunked.pieces(method, request, keep=False)  # as in Endpoint.call
                call = entry[1].Chunked(pieces, timeout=timeout_s, metadata=self._metadata)
                return _chunked_reply(self._service, method, *chunked.assemble([c async for c in call]))
            return await getattr(entry[1], method)(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise as_atoll_error(e, f"{method} on {address}") from None

    def close(self) -> None:
        async def close_all():
            for step_channel in self._step_channels.values():
                step_channel.close()
            for channel, _ in self._channels.values():
                await channel.close()
            self._channels.clear()

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(5.0)
            self._loop.call_soon_threadsafe(self._loop.stop)


def raised_by_daemon(e: grpc.RpcError) -> bool:
    """Whether a call's error is an atoll error the daemon raised itself (``rpc_handler`` marks
    those in the trailing metadata), not one gRPC reported on the way."""
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return any(key == ATOLL_ERROR_KEY for key, _ in trailing or ())


def unreachable(e: BaseException | None) -> bool:
    """Whether a call's error says its daemon was not reached (or went away mid-call), rather than
    an error the daemon raised itself."""
    if not isinstance(e, grpc.RpcError) or e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    return not raised_by_daemon(e)


def as_atoll_error(e: grpc.RpcError, what: str, unavailable=errors.WorkerUnavailable) -> errors.AtollError:
    """The atoll error of a failed call; ``unavailable`` is the error of a daemon not reached
    (ControllerUnavailable for a client's calls). An UNAVAILABLE or DEADLINE_EXCEEDED the daemon
    raised keeps its words (a wait of its own that ran out names what it waited for)."""
    code, details = e.code(), e.details() or ""
    if unreachable(e):
        return unavailable(f"{what}: {unavailable.DAEMON} unreachable ({details})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not raised_by_daemon(e):
        return errors.DeadlineExceeded(f"{what}: no answer before the deadline")
    return errors.from_status(code, details)
