"""Where a job's data-plane groups meet: a key-value store behind the controller's gRPC.

gloo, NCCL and CUDA IPC set up their connections by exchanging addresses through a
torch.distributed store. A TCPStore would listen on a port of its own that checks nothing (and
lists its keys to anyone who asks), so the store lives here instead: every operation is a
``Controller.Rendezvous`` call, which carries the cluster token (checked before anything is parsed,
atoll.net.rpc) and names a namespace with its secret. The controller opens one namespace per load of
a job, hands its secret only to that job's workers in their plans, and drops it when the job is
unloaded. A caller with the token but not the secret is refused; sizes are bounded, so no call can
make the controller allocate more than ``MAX_VALUE_BYTES`` per key and ``MAX_KEYS`` per namespace.
The worker's side is atoll.worker.rendezvous.
"""

from __future__ import annotations

import hmac
import secrets
import threading
from dataclasses import dataclass, field

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import InvalidInput, NotPermitted

MAX_KEYS = 4096
"""Keys in one namespace: a job of W workers uses a few per worker and group."""
MAX_VALUE_BYTES = 1 << 20
MAX_KEY_CHARS = 1024
MAX_WAIT_S = 1.0
"""A waiting call answers after this long at most (the worker asks again until its own deadline),
so waiting workers never hold the controller's request threads for long."""
OPS = ("set", "get", "check", "add", "delete")


@dataclass(slots=True)
class _Namespace:
    secret: str
    values: dict[str, bytes] = field(default_factory=dict)


class Rendezvous:
    def __init__(self):
        self._spaces: dict[str, _Namespace] = {}
        self._changed = threading.Condition()

    def open(self, name: str, secret: str = "") -> str:
        """A new, empty namespace; returns its secret (``secret``: a restarted controller's
        namespace of a job it takes back, whose workers hold that secret)."""
        secret = secret or secrets.token_hex(16)
        with self._changed:
            self._spaces[name] = _Namespace(secret)
        return secret

    def close(self, name: str) -> None:
        with self._changed:
            self._spaces.pop(name, None)
            self._changed.notify_all()  # waiters on it answer "not there" at once

    def serve(self, request: pb.RendezvousRequest) -> pb.RendezvousReply:
        if request.op not in OPS:
            raise InvalidInput(f"unknown rendezvous operation {request.op!r} (known: {', '.join(OPS)})")
        keys = list(request.keys)
        if not keys or len(keys) > MAX_KEYS or any(len(k) > MAX_KEY_CHARS for k in keys):
            raise InvalidInput(f"a rendezvous call names 1 to {MAX_KEYS} keys of at most {MAX_KEY_CHARS} characters")
        if request.op != "check" and len(keys) != 1:
            raise InvalidInput(f"rendezvous {request.op} takes one key, got {len(keys)}")
        if len(request.value) > MAX_VALUE_BYTES:
            raise InvalidInput(f"a rendezvous value holds at most {MAX_VALUE_BYTES} bytes, got {len(request.value)}")
        wait_s = min(max(request.wait_s, 0.0), MAX_WAIT_S) if request.wait_s == request.wait_s else 0.0  # NaN: 0
        with self._changed:
            space = self._space(request)
            if request.op in ("get", "check"):
                here = lambda: self._spaces.get(request.namespace) is space and all(k in space.values for k in keys)  # noqa: E731
                ready = self._changed.wait_for(here, wait_s)
                value = space.values[keys[0]] if ready and request.op == "get" else b""
                return pb.RendezvousReply(ready=ready, value=value)
            key = keys[0]
            if request.op == "delete":
                return pb.RendezvousReply(ready=space.values.pop(key, None) is not None)
            if key not in space.values and len(space.values) >= MAX_KEYS:
                raise InvalidInput(f"rendezvous namespace {request.namespace} is full ({MAX_KEYS} keys)")
            if request.op == "set":
                space.values[key] = bytes(request.value)
                number = 0
            else:  # add: a counter kept as decimal text, as torch.distributed stores keep it
                try:
                    number = int(space.values.get(key, b"0")) + request.amount
                except ValueError:
                    raise InvalidInput(f"rendezvous key {key!r} does not hold a counter") from None
                space.values[key] = str(number).encode()
            self._changed.notify_all()
            return pb.RendezvousReply(ready=True, number=number)

    def _space(self, request: pb.RendezvousRequest) -> _Namespace:
        """The namespace the request names, once its secret matches (compared in constant time)."""
        space = self._spaces.get(request.namespace)
        if space is None or not hmac.compare_digest(space.secret.encode(), request.secret.encode()):
            raise NotPermitted(
                f"rendezvous namespace {request.namespace!r}: unknown, closed, or the secret is wrong "
                f"(only the workers of the job it belongs to hold it)"
            )
        return space
