"""Calls to a parameter-server job's shards, each tried down its chain: the head first, and a
member that does not answer is passed over (and for good) for the next, which holds the same
state; and a push passed down the chain, member to member."""

from __future__ import annotations

import threading
from collections.abc import Callable

from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.errors import WorkerUnavailable
from atoll.net.rpc import Endpoint


class ShardPeers:
    def __init__(self, addresses: list[str], chains: list[list[int]], token: str, timeout_s: float):
        self._endpoints = [Endpoint(a, token, pb_grpc.ParameterServerStub, timeout_s) for a in addresses]
        self._chains = [list(c) for c in chains]
        self._unreachable: set[int] = set()
        self._lock = threading.Lock()

    def chain(self, shard: int) -> list[int]:
        with self._lock:
            return [s for s in self._chains[shard] if s not in self._unreachable]

    def reconfigure(self, chains: list[list[int]]) -> None:
        with self._lock:
            self._chains = [list(c) for c in chains]

    def call(self, shard: int, method: str, request, members: list[int] | None = None, skip=(WorkerUnavailable,)):
        """``method`` on the first member of ``shard``'s chain that answers (``members``: these
        instead, in this order), passing over members whose call raises one of ``skip``."""
        tried = []
        for server in self.chain(shard) if members is None else members:
            try:
                return self._endpoints[server].call(method, request)
            except skip as e:
                tried.append(f"server {server}: {e}")
                if isinstance(e, WorkerUnavailable):
                    with self._lock:
                        self._unreachable.add(server)
        raise WorkerUnavailable(f"shard {shard}: no server of its chain answers ({'; '.join(tried) or 'chain empty'})")

    def start(self, shard: int, method: str, request) -> Callable[[], object]:
        """``call`` started now on the chain's first member: a function that returns the reply
        (trying the rest of the chain then, should that member not answer)."""
        chain = self.chain(shard)
        if not chain:
            return lambda: self.call(shard, method, request)
        answer = self._endpoints[chain[0]].start(method, request)

        def result():
            try:
                return answer.result()
            except WorkerUnavailable:
                with self._lock:
                    self._unreachable.add(chain[0])
                return self.call(shard, method, request)

        return result

    def pass_down(self, shard: int, me: int, method: str, request) -> None:
        """Chain replication: ``method`` on the first server after ``me`` in ``shard``'s chain that
        answers (it passes it on in turn); nothing when ``me`` is the tail, or none after it answers."""
        chain = self.chain(shard)
        after = chain[chain.index(me) + 1 :] if me in chain else []
        if after:
            try:
                self.call(shard, method, request, members=after)
            except WorkerUnavailable:  # every member after this one is gone: this one is the tail now
                pass

    def join(self, shard: int, server: int) -> None:
        """``server`` joins the tail of ``shard``'s chain (it now holds a copy)."""
        with self._lock:
            if server not in self._chains[shard]:
                self._chains[shard].append(server)
            self._unreachable.discard(server)
