"""Where a parameter-server job's parameters live: keys, consistent hashing, chains, bytes.

As in the parameter server (Li et al., OSDI'14), the model is a set of keys: a parameter, or a
range of rows of a large one (an embedding table is split into ranges of ``rows_per_key`` rows).
Keys are placed by consistent hashing: every server has ``VNODES`` points on a ring, a key belongs
to the first server point clockwise of its own hash, so adding or losing a server moves only the
keys next to its points. Server ``i``'s keys form shard ``i``; with replication ``k`` the shard is
held by a chain of ``k`` servers, ``i`` and its next ``k - 1`` successors, the head first.
Pure logic: no torch, no network.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

from atoll.errors import InvalidInput

VNODES = 64
"""Ring points per server: enough that a few servers split the keys evenly in expectation."""

ROW_BYTES = 8
"""A row number travels as an int64."""


@dataclass(frozen=True, slots=True)
class Key:
    key: str
    param: str
    row_start: int
    row_end: int
    shard: int
    sparse: bool

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


def ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")


class Ring:
    """Consistent hashing of key names over ``servers`` servers."""

    def __init__(self, servers: int, vnodes: int = VNODES):
        points = sorted((ring_hash(f"server-{s}#{v}"), s) for s in range(servers) for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._servers = [s for _, s in points]

    def owner(self, name: str) -> int:
        i = bisect.bisect(self._hashes, ring_hash(name)) % len(self._hashes)
        return self._servers[i]


def split_keys(shapes: dict[str, tuple[int, ...]], sparse: set[str], servers: int, rows_per_key: int) -> list[Key]:
    """Every parameter as keys, each placed on its shard. A parameter with more than
    ``rows_per_key`` rows is split into row ranges; a scalar is one key of one "row"."""
    if servers < 1:
        raise InvalidInput(f"a parameter-server job needs at least one server, got {servers}")
    if rows_per_key < 1:
        raise InvalidInput(f"rows_per_key must be positive, got {rows_per_key}")
    unknown = sorted(sparse - shapes.keys())
    if unknown:
        raise InvalidInput(f"sparse parameters {unknown} are not parameters of the model")
    ring = Ring(servers)
    keys = []
    for param, shape in shapes.items():
        rows = shape[0] if shape else 1
        cuts = list(range(0, rows, rows_per_key)) + [rows]
        whole = len(cuts) == 2
        for r0, r1 in zip(cuts, cuts[1:]):
            name = param if whole else f"{param}[{r0}:{r1}]"
            keys.append(Key(name, param, r0, r1, ring.owner(name), param in sparse))
    return keys


def chains(servers: int, replication: int) -> list[list[int]]:
    """Shard ``i``'s chain: server ``i`` (the head) and its ``replication - 1`` successors."""
    if not 1 <= replication <= servers:
        raise InvalidInput(f"replication must be between 1 and the number of servers ({servers}), got {replication}")
    return [[(i + j) % servers for j in range(replication)] for i in range(servers)]


def step_bytes(keys: list[Key], row_bytes: dict[str, int], touched: dict[str, list[int]]) -> tuple[int, int]:
    """(pulled, pushed) payload bytes of one task step: every dense key's value and gradient, and
    for each sparse parameter the unique rows the batch touches (``touched``: parameter -> row
    numbers), each row's value or gradient and its number (8 bytes) both ways. ``row_bytes``:
    parameter -> the bytes of one row (of a scalar: the whole)."""
    moved = 0
    for k in keys:
        if k.sparse:
            n = sum(k.row_start <= r < k.row_end for r in touched.get(k.param, ()))
            moved += n * (row_bytes[k.param] + ROW_BYTES)
        else:
            moved += k.rows * row_bytes[k.param]
    return moved, moved
