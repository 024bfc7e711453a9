"""The worker's side of the data plane's rendezvous: a torch.distributed store whose every
operation is a call to the controller (controller/cluster/rendezvous.py), with the cluster token and the
job's namespace secret from the plan. Process groups (gloo, NCCL) and CUDA IPC meet through it.

gloo uses ``set``, ``get`` and ``wait`` while a group forms; NCCL also when it first communicates,
so the transport that made a group keeps its store (a Python store must outlive its C++ users).
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import AtollError
from atoll.net.rpc import Endpoint

POLL_S = 1.0
"""How long one waiting call may wait at the controller (it caps this itself)."""


class ControllerStore(dist.Store):
    def __init__(self, controller: Endpoint, namespace: str, secret: str, prefix: str, timeout_s: float):
        super().__init__()
        self._controller, self._namespace, self._secret = controller, namespace, secret
        self._prefix, self._timeout_s = prefix, timeout_s

    def _call(self, op: str, keys: list[str], **fields) -> pb.RendezvousReply:
        request = pb.RendezvousRequest(
            namespace=self._namespace, secret=self._secret, op=op, keys=[self._prefix + k for k in keys], **fields
        )
        try:
            return self._controller.call("Rendezvous", request, timeout_s=POLL_S + 10.0)
        except AtollError as e:  # c10d reports store failures as RuntimeError
            raise RuntimeError(f"rendezvous {op} {keys}: {e}") from None

    def _wait(self, op: str, keys: list[str], timeout_s: float) -> pb.RendezvousReply:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            reply = self._call(op, keys, wait_s=max(0.0, min(POLL_S, remaining)))
            if reply.ready:
                return reply
            if remaining <= 0:
                raise RuntimeError(f"Timed out after {timeout_s:g}s waiting for rendezvous keys {keys}")

    def set(self, key: str, value) -> None:
        self._call("set", [key], value=value if isinstance(value, bytes) else str(value).encode())

    def get(self, key: str) -> bytes:
        return self._wait("get", [key], self._timeout_s).value

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait("check", list(keys), self._timeout_s if timeout is None else timeout.total_seconds())

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys)).ready

    def add(self, key: str, amount: int) -> int:
        return self._call("add", [key], amount=amount).number

    def delete_key(self, key: str) -> bool:
        return self._call("delete", [key]).ready

    def compare_set(self, key: str, expected, desired) -> bytes:
        raise RuntimeError("the atoll rendezvous has no compare_set (the process groups atoll makes do not use it)")

    def num_keys(self) -> int:
        raise RuntimeError("the atoll rendezvous does not count keys")

    def clone(self) -> ControllerStore:
        return self.prefixed("")

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def prefixed(self, prefix: str) -> ControllerStore:
        """The same namespace under a further key prefix (a group of its own)."""
        return ControllerStore(self._controller, self._namespace, self._secret, self._prefix + prefix, self._timeout_s)
