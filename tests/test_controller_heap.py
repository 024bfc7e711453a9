"""controller/heap.py: a large job's plan is frozen out of the collector's scans while it lives;
closing a small job beside it leaves it frozen, closing the large one unfreezes."""

import gc

from atoll.controller import heap


def test_only_a_large_jobs_close_unfreezes():
    gc.unfreeze()
    try:
        kept = [[object()] for _ in range(100)]  # stands in for a plan's objects
        heap.settle("small", heap.LARGE_RANKS - 1)
        assert gc.get_freeze_count() == 0  # a small job is left alone
        heap.settle("large", heap.LARGE_RANKS)
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept)
        heap.release("small")
        assert gc.get_freeze_count() == frozen  # the large plan stays out of the scans
        heap.release("unknown")
        assert gc.get_freeze_count() == frozen
        heap.release("large")
        assert gc.get_freeze_count() == 0
        heap.release("large")  # closing twice is fine
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
