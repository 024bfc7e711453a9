"""The ``atoll`` command: start daemons, inspect a cluster, print a plan.

Every user error ends the command with exit code 1 (2 for a malformed command line) and one
line on stderr, ``atoll COMMAND: what was wrong``; ``--log-level DEBUG`` adds the traceback.
The daemons exit 0 on SIGTERM or Ctrl-C (SIGINT), having reported NOT_SERVING on their health
service and, for a worker, left the controller's registry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # controller/compiler/schedules.py SCHEDULES (checked by a test)
CONTROLLER_ENV = "ATOLL_CONTROLLER"
TOKEN_FILE_ENV = "ATOLL_TOKEN_FILE"
DAEMONS = ("controller", "worker")

log = logging.getLogger("atoll.cli")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("atoll")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None, False, "") or the
    help names it already."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default in ("", argparse.SUPPRESS):
            return action.help
        if "(default:" in (action.help or ""):  # the help says it in words
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A malformed command line is one line on stderr, not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


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


def _serve_until_stopped(daemon, ready_file: str | None, exit_with_parent: int | None, banner: str) -> None:
    """Start ``daemon``, announce it (stdout, and ``ready_file``: its address on the first line and,
    with a metrics server, ``metrics HOST:PORT`` on the second), serve until SIGTERM or SIGINT,
    stop it, and exit 0. A startup error stops what was started and propagates."""
    stop = threading.Event()
    if exit_with_parent:
        _watch_parent(exit_with_parent)
    try:
        daemon.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        metrics = getattr(daemon, "metrics_address", "")
        print(banner + (f"; metrics on http://{metrics}/metrics" if metrics else ""), flush=True)
        if ready_file:
            tmp = f"{ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(daemon.address + (f"\nmetrics {metrics}" if metrics else ""))
            os.replace(tmp, ready_file)
        stop.wait()
    except KeyboardInterrupt:  # SIGTERM or SIGINT while starting (main() raises it for both)
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


def _controller_address(args) -> str:
    from atoll.errors import InvalidInput

    if not args.controller:
        raise InvalidInput(f"no controller address: pass --controller HOST:PORT or set ${CONTROLLER_ENV}")
    return args.controller


def _controller(args) -> None:
    _use_tls(args)
    from atoll.controller.daemon import ControllerConfig, ControllerDaemon

    daemon = ControllerDaemon(
        ControllerConfig(
            host=args.host,
            port=args.port,
            token_file=args.token_file,
            heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout,
            step_timeout_s=args.step_timeout,
            lease_timeout_s=args.lease_timeout,
            status_grace_s=args.status_grace,
            allow_pickle=args.allow_pickle,
            metrics_port=args.metrics_port,
        )
    )
    _serve_until_stopped(
        daemon, args.ready_file, args.exit_with_parent, f"atoll controller listening on {daemon.address}"
    )


def _worker(args) -> None:
    controller = _controller_address(args)
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
        device=args.device,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        island=args.island,
        allow_pickle=args.allow_pickle,
        register_timeout_s=args.register_timeout,
    )
    _serve_until_stopped(
        daemon, args.ready_file, args.exit_with_parent, f"atoll worker ({args.device}) listening on {daemon.address}"
    )


def _connect(args, kind=None, timeout_s: float = 120.0):
    """A connection of ``kind`` (default: an ``atoll.Client``) to the command's controller, with
    its token file and TLS flags."""
    from atoll.client.connection import open_connection
    from atoll.net.tls import Tls

    if kind is None:
        from atoll.client.client import Client as kind
    tls = Tls.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    return open_connection(kind, _controller_address(args), None, args.token_file, timeout_s, tls)


def _status(args) -> None:
    from atoll.client.connection import (
        Connection,  # status needs no torch: the command answers in a fraction of a second
    )
    from atoll.errors import DeadlineExceeded, WorkerUnavailable

    client = _connect(args, Connection, timeout_s=args.timeout)

    def show(status) -> None:
        if args.json:
            print(json.dumps(status.to_dict(), indent=None if args.watch else 1), flush=True)
            return
        if args.watch and sys.stdout.isatty():
            sys.stdout.write("\x1b[H\x1b[2J")  # clear the terminal, as watch(1) does
        if args.watch:
            print(f"{client.address} at {time.strftime('%H:%M:%S')} (every {args.watch:g}s, Ctrl-C to stop)")
        print(status.render(), flush=True)

    stop = threading.Event()
    if args.watch:  # Ctrl-C ends the loop between calls: one interrupted mid-call could hang gRPC's exit
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        show(client.status(all=args.all))  # the first answer must come: an error here is the command's
        while args.watch and not stop.wait(args.watch):
            try:
                show(client.status(all=args.all))
            except (WorkerUnavailable, DeadlineExceeded) as e:  # the controller may be restarting
                print(f"atoll status: {e}", file=sys.stderr, flush=True)
    finally:
        client.close()


def _trace(args) -> None:
    with _connect(args) as client:
        trace = client.job(args.job_id).timeline(args.steps, last=args.last, path=args.output)
    if args.png:
        trace.plot(args.png)
    if trace.summary["note"]:
        print(f"atoll trace: {trace.summary['note']}", file=sys.stderr)
    print(json.dumps({"trace": args.output, "png": args.png, **trace.summary}))


def _plan(args) -> None:
    from atoll.cli.plan import print_plan

    print_plan(args)


def _add_common(p, *, daemon: bool = False, cluster: bool = True) -> None:
    p.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="log records at this level and above go to stderr (DEBUG also shows the traceback of an error)",
    )
    if cluster:  # the token and TLS of a cluster the command talks to
        p.add_argument(
            "--token-file",
            default=None,
            metavar="FILE",
            help=f"cluster token file (default: ${TOKEN_FILE_ENV}, else ~/.atoll/token; $ATOLL_TOKEN overrides both)",
        )
        p.add_argument(
            "--tls-ca", default=None, metavar="PEM", help="CA the cluster's certificates chain to (enables TLS)"
        )
        p.add_argument(
            "--tls-cert", default=None, metavar="PEM", help="certificate to present (a daemon serves with it)"
        )
        p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    if daemon:
        p.add_argument(
            "--ready-file",
            default=None,
            metavar="FILE",
            help="once serving, write the bound address here (and, with --metrics-port, 'metrics HOST:PORT' below it)",
        )
        p.add_argument(
            "--exit-with-parent", type=int, default=None, metavar="PID", help="stop when process PID is gone"
        )
        p.add_argument(
            "--allow-pickle", action="store_true", help="UNSAFE: let programs carry arbitrary pickled objects"
        )


def _controller_option(p, what: str) -> None:
    p.add_argument(
        "--controller",
        default=os.environ.get(CONTROLLER_ENV) or None,
        metavar="HOST:PORT",
        help=f"{what} (default: ${CONTROLLER_ENV})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="atoll",
        description="atoll: asynchronous MPMD dataflow runtime for PyTorch",
        formatter_class=_Formatter,
        epilog=f"environment: ${CONTROLLER_ENV} (controller address), ${TOKEN_FILE_ENV} (token file), "
        "$ATOLL_TOKEN (the token itself)",
    )
    parser.add_argument("--version", action="version", version=f"atoll {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str):
        return sub.add_parser(name, help=help, description=help, formatter_class=_Formatter)

    p = command("controller", "run the controller daemon")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: serve other hosts)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one, printed and in --ready-file)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics on --host (0: a free port, printed)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        metavar="S",
        default=1.0,
        help="seconds between a worker's heartbeats (told to workers)",
    )
    p.add_argument(
        "--heartbeat-timeout", type=float, metavar="S", default=5.0, help="seconds of silence before a worker is dead"
    )
    p.add_argument(
        "--step-timeout", type=float, metavar="S", default=600.0, help="deadline of one step on a worker, in seconds"
    )
    p.add_argument(
        "--lease-timeout",
        type=float,
        metavar="S",
        default=30.0,
        help="seconds of client silence before its jobs are closed",
    )
    p.add_argument(
        "--status-grace",
        type=float,
        metavar="S",
        default=60.0,
        help="seconds a dead worker or a failed job still shows in status (status --all shows them all)",
    )
    _add_common(p, daemon=True)
    p.set_defaults(run=_controller)

    p = command("worker", "run a worker daemon owning one device")
    _controller_option(p, "the controller to register with")
    p.add_argument("--device", default="cpu", help="the device this worker owns: cpu or cuda:N")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (gRPC and data plane)")
    p.add_argument("--advertise-host", default=None, help="address peers use to reach this worker (default: --host)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    p.add_argument("--island", default="", help="island label: workers with a fast interconnect (default: host name)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument(
        "--register-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to keep trying while no controller answers (it may be starting too)",
    )
    _add_common(p, daemon=True)
    p.set_defaults(run=_worker)

    p = command("status", "list the islands, workers, jobs and admission queue of a cluster")
    _controller_option(p, "controller address")
    p.add_argument("--json", action="store_true", help="print the status as JSON (islands, workers, jobs, queue)")
    p.add_argument(
        "--all", action="store_true", help="also workers dead and jobs failed longer ago than the controller's grace"
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="show the status again every SECONDS (2 if not given) until Ctrl-C; with --json, one JSON line each",
    )
    p.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for the controller's answer"
    )
    _add_common(p)
    p.set_defaults(run=_status)

    p = command("trace", "write a job's timelines (measured and predicted) as Chrome trace JSON")
    p.add_argument("job_id", help="the job, as status lists it")
    p.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="trace JSON to write (open in ui.perfetto.dev)"
    )
    p.add_argument("--last", type=int, default=1, metavar="N", help="the job's last N steps (workers keep 64)")
    p.add_argument(
        "--steps", type=int, nargs="+", default=None, metavar="STEP", help="these step numbers instead of --last"
    )
    p.add_argument("--png", default=None, metavar="FILE", help="also draw the timelines here (needs atoll[plot])")
    _controller_option(p, "controller address")
    _add_common(p)
    p.set_defaults(run=_trace)

    p = command("plan", "compile a model file and print its plan, without a cluster")
    p.add_argument("model_file", help="a Python file defining build() -> dict of pipeline() arguments")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (overrides build())")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per batch (overrides build())")
    p.add_argument("--schedule", default=None, choices=SCHEDULES, help="pipeline schedule (overrides build())")
    p.add_argument("--virtual-stages", type=int, default=None, help="model chunks per rank (interleaved_1f1b)")
    p.add_argument("--data-parallel", type=int, default=None, help="replicas of the pipeline (workers = stages x N)")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1], help="1: ZeRO-1 over the replicas")
    p.add_argument("--tensor-parallel", type=int, default=None, help="workers per stage, the stage sharded over them")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tensor-parallel: slice the sequence")
    p.add_argument("--rematerialize", action="store_true", help="recompute activations in backward, not stash them")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_common(p, cluster=False)
    p.set_defaults(run=_plan)
    return parser


def _one_line(error: BaseException) -> str:
    from atoll.errors import AtollError

    text = str(error)
    if not isinstance(error, (AtollError, OSError)) or not text:
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from atoll.net import log as _log

    _log.configure(args.log_level)
    daemon = args.command in DAEMONS
    if daemon:  # stopping while starting up: see _serve_until_stopped
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _interrupt)
    code = 0
    try:
        args.run(args)
    except KeyboardInterrupt:  # Ctrl-C (or, for a daemon, SIGTERM) ends a command normally
        pass
    except Exception as e:  # a user error (AtollError, a missing file, ...) or a bug: one line either way
        if args.log_level == "DEBUG":
            traceback.print_exc()
        print(f"atoll {args.command}: {_one_line(e)}", file=sys.stderr)
        code = 1
    if daemon:  # a daemon's threads (gRPC, data plane) must not hold the exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
