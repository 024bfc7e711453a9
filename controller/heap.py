"""The controller's long-lived objects kept out of the cyclic garbage collector's scans.

A job's compiled plan lives as long as the job: its stages, dataflow, action lists and memory plan
are many objects (a 1,024-stage pipeline, hundreds of thousands). Python's collector walks every
live object on each full collection, and the allocations of dispatching steps trigger one every
few steps: with a 1,024-stage plan loaded that walk cost the controller more CPU per step than the
step's dispatch (about 23 against 9 ms; `bench/dispatch.py`'s simulated workers, with the
collector off: 8.6-9.1 ms). So once a job is loaded, everything alive then is frozen (``gc.freeze``:
moved to a generation the collector skips; reference counting still frees it). Closing a job
unfreezes, so its plan's reference cycles can be collected, and the next load freezes again.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """A job was loaded: what is alive now is left out of later collections."""
    gc.freeze()


def release() -> None:
    """A job was closed: its objects may hold cycles only the collector can free."""
    gc.unfreeze()
