"""A zygote: one process that imports what the daemons import (torch, gRPC, atoll) once, then forks
each daemon of a LocalCluster from that warm image.

Why: importing torch and the daemon modules costs each daemon 2 to 3 s of CPU; a cluster of a
controller and N workers paid it N + 1 times, which made cluster startup most of the test suite's
CPU on a 2-core machine. A fork costs milliseconds. The zygote starts no thread of its own and
creates no gRPC object before it forks, so each child starts as clean as a fresh interpreter.

Protocol, one JSON object per line (atoll.client.zygote is the other end):
  stdin   {"argv": [...], "log": PATH, "env": {...}}  run ``atoll ARGV`` with output to PATH
  stdout  {"ready": PID}                               imports done, requests welcome
          {"started": PID} or {"error": TEXT}          one answer per request, in order
          {"exited": PID, "code": N}                   a child ended (N < 0: killed by signal -N)
The zygote ends when its stdin closes; children it started outlive it only as long as their
``--exit-with-parent`` process lives.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import sys
import traceback


def _say(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _run_child(request: dict, keep: list[int]) -> None:
    """In the forked child: become ``atoll ARGV`` with stdout and stderr in the log. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        for fd in keep:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["atoll", *request["argv"]]
        from atoll.cli.commands import main

        main(request["argv"])  # a daemon command ends in os._exit itself
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


# What a daemon imports only once it works: gRPC's server and channel, export's (de)serializer
# (sympy, dynamo, torch.distributed's tensor and FSDP modules come with it) and tracer (networkx,
# inductor's pieces). Measured with an import audit hook on a TP job: a worker imported about 840
# modules after its fork and the controller 1,200, about 1.7 s of CPU each, in every daemon of
# every cluster; imported here, the forks share them.
WARM_IMPORTS = (
    "grpc._server",
    "grpc._channel",
    "grpc.experimental",
    "encodings.idna",
    "google.protobuf.descriptor_pb2",
    "multiprocessing.synchronize",
    "numpy.ctypeslib",
    "torch._export.serde.serialize",
    "torch.export._trace",
    "torch._export.passes.replace_autocast_with_hop_pass",
    "torch._export.passes.replace_set_grad_with_hop_pass",
    "torch._inductor.compiler_bisector",
    "torch._inductor.fx_passes.dedupe_symint_uses",
    "torch._inductor.ir",
    "torch._subclasses.schema_check_mode",
    "torch.fx.experimental.validator",
    "torch.utils.serialization",
)


def serve() -> None:
    # Everything a daemon imports, once (the daemon commands import these lazily).
    import importlib

    import atoll.controller.daemon  # noqa: F401
    import atoll.worker.daemon  # noqa: F401

    for name in WARM_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # private modules come and go between torch versions: only a head start
            pass
    # What is alive now (the modules' 330,000 objects) lives as long as each daemon: frozen, the
    # cyclic collector skips it in the daemons (a full collection took 170-190 ms here, 0 once
    # frozen: a stall in whatever step it fell in) and no collection writes to its shared pages.
    gc.freeze()

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears SIGCHLD
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group; the parent decides
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    _say({"ready": os.getpid()})
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                _reap()
                continue
            data = os.read(0, 65536)
            if not data:  # the parent closed our stdin (or died): done
                _reap()
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = json.loads(line)
                    pid = os.fork()
                except Exception as e:  # a malformed request or no fork: say so, keep serving
                    _say({"error": f"{type(e).__name__}: {e}"})
                    continue
                if pid == 0:
                    _run_child(request, [wake_r, wake_w])
                _say({"started": pid})


if __name__ == "__main__":
    serve()
