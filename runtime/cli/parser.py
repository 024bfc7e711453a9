"""The ``atoll`` command line: every command's options and help, and nothing that runs them.

Importing this module imports argparse alone (no torch, no gRPC), so that ``atoll status --help``
answers at once; atoll.cli.commands maps each command to the function that runs it.
"""

from __future__ import annotations

import argparse
import os

from atoll.core.names import SCHEDULE_CHOICES

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
CONTROLLER_ENV = "ATOLL_CONTROLLER"
TOKEN_FILE_ENV = "ATOLL_TOKEN_FILE"


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


def controller_address(args) -> str:
    """The command's --controller (its default is $ATOLL_CONTROLLER), or an error naming both."""
    from atoll.errors import InvalidInput

    if not args.controller:
        raise InvalidInput(f"no controller address: pass --controller HOST:PORT or set ${CONTROLLER_ENV}")
    return args.controller


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
    p.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="record workers and jobs in DIR (SQLite): restarted on it, the controller takes its jobs back",
    )
    _add_common(p, daemon=True)

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

    p = command("plan", "compile a model file and print its plan, without a cluster")
    p.add_argument("model_file", help="a Python file defining build() -> dict of pipeline() arguments")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (overrides build())")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per batch (overrides build())")
    p.add_argument("--schedule", default=None, choices=SCHEDULE_CHOICES, help="pipeline schedule (overrides build())")
    p.add_argument("--virtual-stages", type=int, default=None, help="model chunks per rank (interleaved_1f1b)")
    p.add_argument("--data-parallel", type=int, default=None, help="replicas of the pipeline (workers = stages x N)")
    p.add_argument(
        "--zero", type=int, default=None, choices=[0, 1, 2, 3], help="ZeRO stage over the replicas (JobConfig.zero)"
    )
    p.add_argument(
        "--reshard-after-forward", action="store_true", help="with --zero 3: gather and free each stage per compute"
    )
    p.add_argument("--tensor-parallel", type=int, default=None, help="workers per stage, the stage sharded over them")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tensor-parallel: slice the sequence")
    p.add_argument("--rematerialize", action="store_true", help="recompute activations in backward, not stash them")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_common(p, cluster=False)
    return parser
