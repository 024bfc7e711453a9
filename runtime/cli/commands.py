"""The ``atoll`` command: run one command of the command line (atoll.cli.parser), reporting errors.

Every user error ends the command with exit code 1 (2 for a malformed command line) and one
line on stderr, ``atoll COMMAND: what was wrong``; ``--log-level DEBUG`` adds the traceback.
The daemons (atoll.cli.daemons) exit 0 on SIGTERM or Ctrl-C (SIGINT). The commands here (status,
trace, plan) import what they need only when they run: ``atoll status`` never imports torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from atoll.cli.daemons import DAEMONS, interrupt_while_starting
from atoll.cli.malloc import exec_with_daemon_malloc
from atoll.cli.parser import build_parser, controller_address
from atoll.cli.stop_signal import StopSignal
from atoll.core.names import SCHEDULES as SCHEDULES  # atoll.cli.commands.SCHEDULES, as it always was


def _connect(args, kind=None, timeout_s: float = 120.0):
    """A connection of ``kind`` (default: an ``atoll.Client``) to the command's controller, with
    its token file and TLS flags."""
    from atoll.client.connection import open_connection
    from atoll.net.tls import Tls

    if kind is None:
        from atoll.client.client import Client as kind
    tls = Tls.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    return open_connection(kind, controller_address(args), None, args.token_file, timeout_s, tls)


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

    # Ctrl-C ends the loop between calls: one interrupted mid-call could hang gRPC's exit
    stop = StopSignal() if args.watch else None
    try:
        show(client.status(all=args.all))  # the first answer must come: an error here is the command's
        while args.watch and not stop.wait(args.watch):
            try:
                show(client.status(all=args.all))
            except (WorkerUnavailable, DeadlineExceeded) as e:  # the controller may be restarting
                print(f"atoll status: {e}", file=sys.stderr, flush=True)
    finally:
        client.close()
        if stop is not None:
            stop.close()


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


COMMANDS = {**DAEMONS, "status": _status, "trace": _trace, "plan": _plan}
"""Each command of build_parser() and the function that runs it with the parsed arguments."""


def _one_line(error: BaseException) -> str:
    from atoll.errors import AtollError

    text = str(error)
    if not isinstance(error, (AtollError, OSError)) or not text:
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    daemon = args.command in DAEMONS
    if daemon and argv is None:  # a daemon started from a shell: with its malloc settings, once
        exec_with_daemon_malloc(sys.argv[1:])
    from atoll.net import log as _log

    _log.configure(args.log_level)
    if daemon:  # stopping while starting up: see serve_until_stopped
        interrupt_while_starting()
    code = 0
    try:
        COMMANDS[args.command](args)
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
