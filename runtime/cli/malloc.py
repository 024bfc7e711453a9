"""glibc malloc settings for atoll's daemons, and how a daemon started by hand gets them: glibc
reads ``GLIBC_TUNABLES`` when a process starts, so ``atoll controller`` and ``atoll worker`` run
without them re-execute themselves once with them (``exec_with_daemon_malloc``), before any heavy
import; ``LocalCluster`` starts its daemons with them set (atoll.client.local). Light on purpose:
the CLI imports it before torch."""

from __future__ import annotations

import os
import sys

DAEMON_MALLOC = {
    "glibc.malloc.hugetlb": "1",
    "glibc.malloc.arena_max": "2",
    "glibc.malloc.mmap_threshold": str(32 * 2**20),
    "glibc.malloc.trim_threshold": str(128 * 2**20),
}
"""glibc malloc settings for the daemons (glibc 2.35 and later; older ones ignore them), measured on
this project's 2-core VM, where a first touch of fresh memory is costly:

- ``hugetlb=1``: large blocks in transparent huge pages. A daemon copies a model's weights several
  times on their way to the workers: submitting a 1.2 GB model took 56-68 s, 80% of the controller's
  CPU in the kernel zeroing new 4 KiB pages; 43-51 s with this alone.
- ``arena_max=2``: a daemon's threads (gRPC's pool, the executor, the heartbeat) share two malloc
  arenas (glibc's default allows eight per core): a ZeRO-3 worker's peak RSS growth over training
  (bench/zero.py, 4 workers) averaged 44.3 MiB without it (two runs, 40-54 MiB) and 40.3 MiB with
  it (four runs, 34-49 MiB), FSDP2's ranks under the same settings 42.7 MiB (40-45); steps/s unchanged.
- ``mmap_threshold=32 MiB``, ``trim_threshold=128 MiB``: a step's blocks of up to 32 MiB (a
  Linear(1024, 1024)'s weight gradient is 4 MiB) come from the heap and go back to it, instead
  of from fresh pages each step. glibc raises its mmap threshold by itself after a first free, but
  then trims the heap's top once more than twice that is free, which a backward's freed gradients
  are, so the next step faults the pages in again. One thread, 4 x (Linear(1024, 1024) + GELU)
  at 32 rows, three alternated runs: backward 14.7 / 13.4 / 14.1 ms without these two, 12.1 /
  12.4 / 10.0 with them; 23 ms with none of these settings. Setting one disables glibc's
  adjustment of both, so both are set. Larger blocks are still mapped and unmapped on their own.
"""


def _missing(tunables: str) -> dict[str, str]:
    """The ``DAEMON_MALLOC`` settings ``tunables`` does not name (a value the caller gave wins)."""
    named = {t.partition("=")[0] for t in tunables.split(":")}
    return {k: v for k, v in DAEMON_MALLOC.items() if k not in named}


def daemon_malloc_tunables(tunables: str) -> str:
    """``GLIBC_TUNABLES`` with ``DAEMON_MALLOC`` added; a tunable the caller set keeps its value."""
    given = [t for t in tunables.split(":") if t]
    return ":".join(given + [f"{k}={v}" for k, v in _missing(tunables).items()])


def has_daemon_malloc(environ) -> bool:
    """Whether ``environ`` carries every ``DAEMON_MALLOC`` setting (the caller's own value of one
    counts: it wins)."""
    return not _missing(environ.get("GLIBC_TUNABLES", ""))


def exec_with_daemon_malloc(argv: list[str]) -> None:
    """Run ``python -m atoll.cli *argv`` in place of this process (same PID) with ``DAEMON_MALLOC``
    added to ``GLIBC_TUNABLES``, unless they are there already or this is not Linux (whose glibc
    they are for). Returns only when there is nothing to do."""
    if sys.platform != "linux" or has_daemon_malloc(os.environ):
        return
    env = {**os.environ, "GLIBC_TUNABLES": daemon_malloc_tunables(os.environ.get("GLIBC_TUNABLES", ""))}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "atoll.cli", *argv], env)
