"""The controller's memory of recent compile work: the same model cut and sharded the same way is
not cut or sharded again.

Two passes of a compile cost the most and are pure functions of their inputs: the split (the
model's archive loaded, costed on fake tensors and cut into stage programs: 0.5 s for the 6-layer
example GPT in 4 stages) and tensor parallelism's per-stage sharding (each island rank's program
rewritten and exported again: 1.5-4 s a job for the suite's small Hugging Face models). Jobs are
often submitted again with those inputs unchanged: the same model under another schedule or
optimizer, a layout sweep, a resubmitted or restarted job. So recent results are kept, keyed by
digests of the programs they read and the rest of their arguments, within a byte budget on the
programs they hold (which carry the weights): a model larger than the budget is never kept, and
the least recently used result goes first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_BUDGET_BYTES = 256 << 20
"""Program bytes kept across closed jobs: a few small models, never a large one."""


class CompileCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self._kept: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits: Counter[str] = Counter()
        """Per kind of work ("split", "shard"): results reused."""
        self.misses: Counter[str] = Counter()
        """Per kind of work: results computed."""

    def get(
        self, kind: str, blobs: tuple[bytes, ...], inputs: tuple, compute: Callable[[], T], size: Callable[[T], int]
    ) -> T:
        """``compute()``'s result, or a kept one of the same ``kind`` for the same ``blobs`` (programs,
        compared by digest) and hashable ``inputs`` (the rest of the arguments). ``size``: the bytes
        a result holds. A failure is not kept: bad input fails every time. Results are shared:
        callers must not change them."""
        if sum(len(b) for b in blobs) > self.budget_bytes:  # could not be kept: not worth hashing
            return self._computed(kind, compute)
        key = (kind, tuple((hashlib.blake2b(b, digest_size=32).digest(), len(b)) for b in blobs), inputs)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                self.hits[kind] += 1
                return kept[0]
        result = self._computed(kind, compute)
        held = size(result)
        with self._lock:
            if held <= self.budget_bytes and key not in self._kept:
                self._kept[key] = (result, held)
                self._bytes += held
                while self._bytes > self.budget_bytes:
                    _, (_, dropped) = self._kept.popitem(last=False)
                    self._bytes -= dropped
        return result

    def _computed(self, kind: str, compute: Callable[[], T]) -> T:
        with self._lock:
            self.misses[kind] += 1
        return compute()


COMPILED = CompileCache()
"""The process's cache, used by the compiler's split and shard passes."""
