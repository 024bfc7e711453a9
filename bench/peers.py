"""Where a benchmark's peer processes come from: torch's ranks (pipelining, DDP, FSDP2) and the
physical-limit probes.

They fork from one server process (multiprocessing's ``forkserver``) that imported the
benchmark's own module, and with it torch and atoll, once. Spawned, each peer started a fresh
interpreter and imported all of that again: about 4-5 s of CPU a peer on a 2-core machine, and
``bench/pipeline.py`` at its smallest size starts eight of them (more than half of its CPU).
The server starts under the malloc settings LocalCluster gives atoll's daemons (GLIBC_TUNABLES
are read when a process starts), so every peer runs under the same settings as the daemons it
is set against. A variable set in this process after the server started does not reach the
peers: a benchmark that must pass one (bench/transport.py's CUDA MPS rows) spawns its own.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing import forkserver
from pathlib import Path
from unittest import mock

from atoll.cli.malloc import daemon_malloc_tunables


def daemon_malloc():
    """Context: processes started inside it get the malloc settings LocalCluster gives atoll's
    daemons (``DAEMON_MALLOC``), so a benchmark's peers and measurements run under the same."""
    return mock.patch.dict(os.environ, GLIBC_TUNABLES=daemon_malloc_tunables(os.environ.get("GLIBC_TUNABLES", "")))


def peer_context():
    """The multiprocessing context to start peers with; starts its server on first use."""
    ctx = multiprocessing.get_context("forkserver")
    # The server imports the benchmark's script by its module name. Python 3.11's server neither
    # imports its default, "__main__", nor applies the sys.path it is given, so the path goes in
    # PYTHONPATH. Each peer still runs the script's body as ``__mp_main__``, its imports cached.
    ctx.set_forkserver_preload([Path(sys.modules["__main__"].__file__).stem])
    path = os.pathsep.join(p for p in sys.path if p)
    with daemon_malloc(), mock.patch.dict(os.environ, PYTHONPATH=path):
        forkserver.ensure_running()
    return ctx
