"""A client's connection to the controller, without torch: the base of ``atoll.Client``, and all
that ``atoll status`` needs (so that command does not pay for importing torch)."""

from __future__ import annotations

import os
import threading
import uuid

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.client.plan import ClusterStatus
from atoll.errors import ControllerUnavailable, InvalidInput
from atoll.net import address as _address
from atoll.net.auth import resolve_token
from atoll.net.rpc import Endpoint
from atoll.net.tls import Tls

CONTROLLER_ENV = "ATOLL_CONTROLLER"
CONNECT_CHECK_S = 10.0
"""How long opening a connection waits for the controller's first answer."""


class Connection:
    """Calls to one controller, each with the cluster token and a deadline; a client session."""

    def __init__(
        self,
        address: str,
        token: str,
        *,
        timeout_s: float = 120.0,
        step_timeout_s: float = 900.0,
        tls: Tls | None = None,
        reconnect_timeout_s: float = 60.0,
    ):
        self.address = address
        self._token, self._tls = token, tls
        """For calls straight to workers (a parameter-server job's tasks)."""
        self._endpoint = Endpoint(
            address,
            token,
            pb_grpc.ControllerStub,
            default_timeout_s=timeout_s,
            tls=tls,
            unavailable=ControllerUnavailable,
        )
        self.step_timeout_s = step_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        """How long a step whose controller cannot be reached is sent again before it raises
        ControllerUnavailable (a controller restarted on its state directory takes its jobs back;
        atoll.client.job)."""
        self.session = uuid.uuid4().hex
        """This client's session: the jobs it submits live while it renews the session's lease."""
        self._ended = threading.Event()
        self._keepalive: threading.Thread | None = None

    def _keep_alive(self) -> None:
        """Renew the session's lease in the background from the first submission on (a daemon
        thread: it ends with the process, and the controller then closes the jobs)."""
        if self._keepalive is not None:
            return

        def loop():
            interval = 1.0
            while not self._ended.wait(interval):
                try:
                    reply = self._call("KeepAlive", pb.Session(session=self.session), timeout_s=10.0)
                    interval = max(0.2, reply.lease_timeout_s / 4)
                except Exception:  # noqa: BLE001 (the controller may be restarting: try again soon)
                    interval = 1.0

        self._keepalive = threading.Thread(target=loop, name="atoll-lease", daemon=True)
        self._keepalive.start()

    def _call(self, method: str, request, timeout_s: float | None = None):
        return self._endpoint.call(method, request, timeout_s)

    def status(self, all: bool = False) -> ClusterStatus:
        """Islands, workers, jobs and the admission queue. Workers dead and jobs ended for longer
        than the controller's grace period are left out, unless ``all``."""
        reply = self._call("Status", pb.StatusRequest(all=all))
        return ClusterStatus.from_pb(reply)

    def close(self) -> None:
        """Disconnect. Jobs this client submitted (not detached) are closed by the controller once
        the session's lease runs out (the controller's --lease-timeout, 30 s by default)."""
        self._ended.set()
        self._endpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_connection(
    kind, address, token, token_file, timeout_s: float, tls: Tls | None, reconnect_timeout_s: float = 60.0
):
    """A ``kind`` (Connection or a subclass) to the controller at ``address`` (default:
    $ATOLL_CONTROLLER), its token resolved as ``resolve_token`` says; the address's form, the
    controller's presence and the token are checked at once."""
    address = address or os.environ.get(CONTROLLER_ENV, "")
    if not address:
        raise InvalidInput(f"no controller address: pass connect(address='HOST:PORT') or set ${CONTROLLER_ENV}")
    address = _address.checked(address, "controller address")
    token = resolve_token(token, token_file)
    connection = kind(address, token, timeout_s=timeout_s, tls=tls, reconnect_timeout_s=reconnect_timeout_s)
    try:
        # named by the address, not the RPC: "Ping" means nothing to whoever typed the address
        what = f"no controller answered at {address}"
        connection._endpoint.call("Ping", pb.Empty(), timeout_s=min(timeout_s, CONNECT_CHECK_S), what=what)
    except BaseException:
        connection.close()
        raise
    return connection
