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
plan, and too much for every small job, which is left alone. Closing a job unfreezes, so its
plan's cycles can be collected; the next large load freezes again.
"""

from __future__ import annotations

import gc

LARGE_RANKS = 64
"""A job of this many pipeline ranks or more is frozen once loaded."""


def settle(ranks: int) -> None:
    """A job of ``ranks`` pipeline ranks was loaded."""
    if ranks >= LARGE_RANKS:
        gc.collect()
        gc.freeze()


def release() -> None:
    """A job was closed: its objects may hold cycles only the collector can free."""
    gc.unfreeze()
