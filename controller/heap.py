"""A large job's plan kept out of the cyclic garbage collector's scans.

A job's compiled plan lives as long as the job: its stages, dataflow, action lists and memory plan
are many objects (a 1,024-stage pipeline, hundreds of thousands). Python's collector walks every
live object on each full collection, and the allocations of dispatching steps trigger one every
few steps: with a 1,024-stage plan loaded, the first 30 relayed steps cost the controller 23 ms
of CPU each against 9-10 ms after (`bench/dispatch.py`'s simulated workers; with the collector
off, 8.6-9.1 ms throughout). So once a large job is loaded, a full collection first frees the
compilation's garbage (fx graphs hold cycles, and with them stage weights: frozen, they would stay),
then everything alive is frozen (``gc.freeze``: a generation the collector skips; reference
counting still frees it). That collection costs about 0.15 s here, nothing beside compiling such a
plan, and too much for every small job, which is left alone. Closing a large job unfreezes, so its
plan's cycles can be collected (not refrozen at once: the closing call still holds the job, and
freezing it again would keep its cycles); the next large load freezes again. Closing a small job
leaves the frozen generation as it is, so the large jobs beside it stay out of the scans.
"""

from __future__ import annotations

import gc
import threading

LARGE_RANKS = 64
"""A job of this many pipeline ranks or more is frozen once loaded."""

_lock = threading.Lock()
_large: set[str] = set()  # the live jobs whose plans were frozen


def settle(job_id: str, ranks: int) -> None:
    """Job ``job_id`` of ``ranks`` pipeline ranks was loaded."""
    if ranks >= LARGE_RANKS:
        with _lock:
            _large.add(job_id)
            gc.collect()
            gc.freeze()


def release(job_id: str) -> None:
    """Job ``job_id`` was closed: if its plan was frozen, its objects may hold cycles only the
    collector can free."""
    with _lock:
        if job_id in _large:
            _large.discard(job_id)
            gc.unfreeze()
