"""How long the `atoll` commands take before they answer (imports included), next to a bare
Python start, each the median of ``--repeat`` runs. Prints one JSON object.

    python bench/cli.py [--repeat 5]

`atoll status` runs against a one-worker LocalCluster started here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import atoll  # noqa: E402


def _seconds(args: list[str], env: dict, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        times.append(time.perf_counter() - started)
        if run.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed: {run.stderr[-2000:]}")
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    atoll_cli = [sys.executable, "-m", "atoll.cli"]
    with atoll.LocalCluster(workers=1) as cluster:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATOLL_")}
        env.update(ATOLL_CONTROLLER=cluster.address, ATOLL_TOKEN=cluster.token)
        figures = {
            "python_start_s": _seconds([sys.executable, "-c", "pass"], env, args.repeat),
            "import_atoll_s": _seconds([sys.executable, "-c", "import atoll"], env, args.repeat),
            "atoll_help_s": _seconds([*atoll_cli, "--help"], env, args.repeat),
            "atoll_status_help_s": _seconds([*atoll_cli, "status", "--help"], env, args.repeat),
            "atoll_status_s": _seconds([*atoll_cli, "status"], env, args.repeat),
            "import_atoll_client_s": _seconds([sys.executable, "-c", "import atoll.client.client"], env, args.repeat),
        }
    result = {"benchmark": "cli", "repeat": args.repeat, **{k: round(v, 3) for k, v in figures.items()}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
