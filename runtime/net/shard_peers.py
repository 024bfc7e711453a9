"""Calls to a parameter-server job's shards, along their chains as the controller last configured
them (chain replication, van Renesse and Schneider, OSDI'04): an update goes to the head, which
passes it down member to member, and is acknowledged only once the tail has it. Membership is the
controller's alone: a member that does not answer is not passed over here (a member passed over
while alive would miss updates and could later serve, or be copied from, without them); the call
fails, and a task's call is tried again, on the chain as it then stands, until the controller
has declared the member dead and taken it out (``failover_s``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.errors import WorkerUnavailable
from atoll.net.rpc import Endpoint


class ShardPeers:
    def __init__(self, addresses: list[str], chains: list[list[int]], token: str, timeout_s: float, failover_s=30.0):
        self._endpoints = [Endpoint(a, token, pb_grpc.ParameterServerStub, timeout_s) for a in addresses]
        self._chains = [list(c) for c in chains]
        self._lock = threading.Lock()
        self.failover_s = failover_s
        """How long a call waits for the controller to take a member that does not answer out of
        its chain (a dead worker is declared so after the heartbeat timeout)."""

    def chain(self, shard: int) -> list[int]:
        with self._lock:
            return list(self._chains[shard])

    def reconfigure(self, chains: list[list[int]]) -> None:
        with self._lock:
            self._chains = [list(c) for c in chains]

    def call(self, shard: int, method: str, request, members: list[int] | None = None, skip=(WorkerUnavailable,)):
        """``method`` on ``shard``'s head, tried again on the chain's head of the moment until
        ``failover_s`` has passed. ``members``: these instead, in this order, the first that
        answers (passing over those whose call raises one of ``skip``): for reads and copies only."""
        if members is not None:
            tried = []
            for server in members:
                try:
                    return self._endpoints[server].call(method, request)
                except skip as e:
                    tried.append(f"server {server}: {e}")
            raise WorkerUnavailable(f"shard {shard}: no server asked answers ({'; '.join(tried) or 'none asked'})")
        deadline, pause = time.monotonic() + self.failover_s, 0.05
        while True:
            chain = self.chain(shard)
            if not chain:
                raise WorkerUnavailable(f"shard {shard}: no server holds it any more")
            try:
                return self._endpoints[chain[0]].call(method, request)
            except WorkerUnavailable as e:
                if time.monotonic() + pause > deadline:
                    raise WorkerUnavailable(
                        f"shard {shard}: its head, server {chain[0]}, does not answer, and the controller did not "
                        f"take it out of the chain within {self.failover_s:g}s: {e}"
                    ) from None
            time.sleep(pause)
            pause = min(2 * pause, 1.0)

    def start(self, shard: int, method: str, request) -> Callable[[], object]:
        """``call`` started now on the chain's head: a function that returns the reply (trying
        again as ``call`` does, should the head not answer)."""
        chain = self.chain(shard)
        if not chain:
            return lambda: self.call(shard, method, request)
        answer = self._endpoints[chain[0]].start(method, request)

        def result():
            try:
                return answer.result()
            except WorkerUnavailable:
                return self.call(shard, method, request)

        return result

    def pass_down(self, shard: int, me: int, method: str, request) -> None:
        """Chain replication: ``method`` on the server after ``me`` in ``shard``'s chain (it passes
        it on in turn); nothing when ``me`` is the tail. A next member that does not answer fails
        the call: the update is not acknowledged (the task sends it again; it is applied once)."""
        chain = self.chain(shard)
        after = chain[chain.index(me) + 1 :] if me in chain else []
        if not after:
            return
        try:
            self._endpoints[after[0]].call(method, request)
        except WorkerUnavailable as e:
            raise WorkerUnavailable(
                f"shard {shard}: server {after[0]}, next after server {me} in its chain, does not answer ({e}); "
                "the update waits for the controller to take it out"
            ) from None

    def join(self, shard: int, server: int) -> None:
        """``server`` joins the tail of ``shard``'s chain (it now holds a copy)."""
        with self._lock:
            if server not in self._chains[shard]:
                self._chains[shard].append(server)
