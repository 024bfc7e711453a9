"""The ``atoll`` command: start daemons, inspect a cluster, print a plan."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading


def _watch_parent(pid: int, stop: threading.Event) -> None:
    """Exit when the process that started us is gone, so no daemon outlives its test or cluster."""

    def loop():
        while not stop.wait(0.5):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                stop.set()

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def _serve_until_stopped(daemon, ready_file: str | None, exit_with_parent: int | None, banner: str) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if exit_with_parent:
        _watch_parent(exit_with_parent, stop)
    daemon.start()
    print(banner, flush=True)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            f.write(daemon.address)
        os.replace(tmp, ready_file)
    stop.wait()
    daemon.stop()
    # A request thread may still sit in a data-plane wait (bounded by its own deadline); the
    # daemon is stopped, so exit now rather than join it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _use_tls(args) -> None:
    """Set the daemon's TLS before it binds or dials anything."""
    from atoll import _tls

    _tls.use(_tls.Tls.from_files(args.tls_ca, args.tls_cert, args.tls_key))


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
            allow_pickle=args.allow_pickle,
        )
    )
    _serve_until_stopped(
        daemon, args.ready_file, args.exit_with_parent, f"atoll controller listening on {daemon.address}"
    )


def _worker(args) -> None:
    _use_tls(args)
    import torch

    from atoll._auth import resolve_token
    from atoll.worker import WorkerDaemon

    if args.threads:
        torch.set_num_threads(args.threads)
    daemon = WorkerDaemon(
        controller=args.controller,
        token=resolve_token(token_file=args.token_file),
        device=args.device,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        island=args.island,
        allow_pickle=args.allow_pickle,
    )
    _serve_until_stopped(
        daemon, args.ready_file, args.exit_with_parent, f"atoll worker ({args.device}) listening on {daemon.address}"
    )


def _status(args) -> None:
    from atoll.client import connect

    client = connect(args.controller, token_file=args.token_file)
    print(client.status().render())
    client.close()


def _plan(args) -> None:
    from atoll._plan_cli import print_plan

    print_plan(args)


def _add_common(p, with_daemon: bool = True) -> None:
    p.add_argument(
        "--token-file", default=None, help="cluster token file (default: $ATOLL_TOKEN_FILE or ~/.atoll/token)"
    )
    if with_daemon:
        p.add_argument("--ready-file", default=None, help="write the bound address here once serving")
        p.add_argument(
            "--exit-with-parent", type=int, default=None, metavar="PID", help="exit when process PID is gone"
        )
        p.add_argument(
            "--allow-pickle", action="store_true", help="UNSAFE: let programs carry arbitrary pickled objects"
        )
        p.add_argument("--log-level", default="WARNING")
        p.add_argument("--tls-cert", default=None, help="PEM certificate this daemon serves gRPC with")
        p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
        p.add_argument("--tls-ca", default=None, help="PEM CA the cluster's certificates chain to (enables TLS)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="atoll", description="atoll: asynchronous MPMD dataflow runtime for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("controller", help="run the controller daemon")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--heartbeat-interval", type=float, default=1.0, help="seconds between a worker's heartbeats (told to workers)"
    )
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds of silence before a worker is dead")
    p.add_argument("--step-timeout", type=float, default=600.0, help="deadline of one step on a worker (s)")
    p.add_argument(
        "--lease-timeout", type=float, default=30.0, help="seconds of client silence before its jobs are closed"
    )
    _add_common(p)
    p.set_defaults(run=_controller)

    p = sub.add_parser("worker", help="run a worker daemon owning one device")
    p.add_argument("--controller", required=True, metavar="HOST:PORT")
    p.add_argument("--device", default="cpu")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (gRPC and data plane)")
    p.add_argument("--advertise-host", default=None, help="address peers use to reach this worker (default: --host)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--island", default="", help="island label: workers with a fast interconnect (default: host name)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    _add_common(p)
    p.set_defaults(run=_worker)

    p = sub.add_parser("status", help="list the workers and jobs of a cluster")
    p.add_argument(
        "--controller",
        default=os.environ.get("ATOLL_CONTROLLER"),
        required="ATOLL_CONTROLLER" not in os.environ,
        metavar="HOST:PORT",
        help="controller address (default: $ATOLL_CONTROLLER)",
    )
    _add_common(p, with_daemon=False)
    p.set_defaults(run=_status)

    p = sub.add_parser("plan", help="compile a model file and print its plan, without a cluster")
    p.add_argument("model_file", help="a Python file defining build() -> dict of pipeline() arguments")
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--schedule", default=None)
    p.add_argument("--virtual-stages", type=int, default=None)
    p.add_argument("--data-parallel", type=int, default=None, help="replicas of the pipeline (workers = stages x N)")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1], help="1: ZeRO-1 over the replicas")
    p.add_argument("--tensor-parallel", type=int, default=None, help="workers per stage, the stage sharded over them")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tensor-parallel: slice the sequence")
    p.add_argument("--rematerialize", action="store_true")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_plan)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "WARNING").upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    from atoll.errors import AtollError

    try:
        args.run(args)
    except KeyboardInterrupt:
        pass
    except AtollError as e:
        sys.exit(f"atoll {args.command}: {e}")


if __name__ == "__main__":
    main()
