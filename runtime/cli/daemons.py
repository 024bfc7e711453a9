"""``atoll controller`` and ``atoll worker``: start a daemon, serve until SIGTERM or Ctrl-C, stop it.

A daemon exits 0 on SIGTERM or Ctrl-C (SIGINT), having reported NOT_SERVING on its health service
and, for a worker, left the controller's registry. What a daemon imports (torch, the controller)
is imported here only once its command runs, so other commands never pay for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time

from atoll.cli.parser import controller_address
from atoll.cli.stop_signal import STOP_SIGNALS, StopSignal


def _watch_parent(pid: int) -> None:
    """Stop (as on SIGTERM) when the process that started us is gone, so no daemon outlives its
    test or cluster."""

    def loop():
        while True:
            time.sleep(0.5)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def interrupt_while_starting() -> None:
    """Until ``serve_until_stopped`` has started the daemon, SIGTERM and SIGINT raise
    KeyboardInterrupt, so that stopping a daemon while it starts up ends it cleanly too."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)


def serve_until_stopped(daemon, ready_file: str | None, exit_with_parent: int | None, banner: str) -> None:
    """Start ``daemon``, announce it (stdout, and ``ready_file``: its address on the first line and,
    with a metrics server, ``metrics HOST:PORT`` on the second), serve until SIGTERM or SIGINT,
    stop it, and exit 0. A startup error stops what was started and propagates."""
    if exit_with_parent:
        _watch_parent(exit_with_parent)
    try:
        daemon.start()
        stop = StopSignal()  # kept to the exit: a second signal while stopping changes nothing
        metrics = getattr(daemon, "metrics_address", "")
        print(banner + (f"; metrics on http://{metrics}/metrics" if metrics else ""), flush=True)
        if ready_file:
            tmp = f"{ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(daemon.address + (f"\nmetrics {metrics}" if metrics else ""))
            os.replace(tmp, ready_file)
        stop.wait()
    except KeyboardInterrupt:  # SIGTERM or SIGINT while starting (interrupt_while_starting)
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            daemon.stop()
        raise
    daemon.stop()
    # A request thread may still sit in a data-plane wait (bounded by its own deadline); the
    # daemon is stopped, so exit now rather than join it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _use_tls(args) -> None:
    """Set the daemon's TLS before it binds or dials anything."""
    from atoll.net import tls as _tls

    _tls.use(_tls.Tls.from_files(args.tls_ca, args.tls_cert, args.tls_key))


def _options(args, names) -> dict:
    """The daemon's keyword arguments ``names``, each from the parsed option of the same name; a
    name in seconds drops its ``_s`` (``step_timeout_s`` is ``--step-timeout``)."""
    return {name: getattr(args, name.removesuffix("_s")) for name in names}


def run_controller(args) -> None:
    _use_tls(args)
    from atoll.controller.daemon import ControllerConfig, ControllerDaemon

    # every setting of the controller is an option of `atoll controller`
    config = ControllerConfig(**_options(args, (f.name for f in dataclasses.fields(ControllerConfig))))
    daemon = ControllerDaemon(config)
    serve_until_stopped(
        daemon, args.ready_file, args.exit_with_parent, f"atoll controller listening on {daemon.address}"
    )


def run_worker(args) -> None:
    controller = controller_address(args)
    _use_tls(args)
    import torch

    from atoll.net.auth import resolve_token
    from atoll.worker.daemon import WorkerDaemon, check_device

    check_device(args.device)  # before anything else: the most basic of a worker's settings
    if args.threads:
        torch.set_num_threads(args.threads)
    daemon = WorkerDaemon(
        controller=controller,
        token=resolve_token(token_file=args.token_file),
        **_options(args, ("device", "host", "port", "advertise_host", "island", "allow_pickle", "register_timeout_s")),
    )
    serve_until_stopped(
        daemon, args.ready_file, args.exit_with_parent, f"atoll worker ({args.device}) listening on {daemon.address}"
    )


DAEMONS = {"controller": run_controller, "worker": run_worker}
"""The commands that run a daemon (atoll.cli.commands.main exits them at once when they end)."""
