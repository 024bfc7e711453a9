"""The client processes of tests/test_soak.py, forked from one process that imported torch and
atoll once (eight separate imports cost the suite about 20 s of CPU), each then a client of its own:

    python -m tests.soak_clients ADDRESS TOKEN CLIENTS STEPS WARM OUT_DIR

Prints "pid SEED PID" for each client; each client submits a 2-stage job, prints "warm SEED" after
WARM steps and waits until "go" comes on this process's stdin, then trains on, writes its losses to
OUT_DIR/SEED.json and prints "done SEED" (or "failed SEED"). Exits 0 once every client has ended
well. Each line goes out in one write(2), shorter than a pipe's atomic size, so the clients' lines
never interleave (print's buffered writes did, once in a CI run, inside a 2 KB line of losses).
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch._dynamo  # noqa: F401 (imported once here, not in every client: export needs it)
import torch.export  # noqa: F401

import atoll
from tests import models


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write: whole, never mixed with another client's


def client(address: str, token: str, seed: int, steps: int, warm: int, go_fd: int, out: Path) -> None:
    model, batches, loss_fn = models.mlp(seed)
    x, y = batches[0]
    with atoll.connect(address, token) as connection:
        job = connection.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=2, microbatches=2)
        losses = []
        for i in range(steps):
            if i == warm:
                say(f"warm {seed}")
                os.read(go_fd, 1)  # the parent measures memory, then lets every client go on
            losses.append(job.step(*batches[i % len(batches)]))
        job.close()
    (out / f"{seed}.json").write_text(json.dumps(losses))
    say(f"done {seed}")


def main() -> int:
    address, token = sys.argv[1], sys.argv[2]
    clients, steps, warm = (int(a) for a in sys.argv[3:6])
    out = Path(sys.argv[6])
    go_read, go_write = os.pipe()
    pids = []
    for seed in range(clients):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(go_write)
                client(address, token, seed, steps, warm, go_read, out)
                code = 0
            except BaseException:  # noqa: BLE001 (reported, and the exit code says it failed)
                traceback.print_exc()
                say(f"failed {seed}")  # the parent reads a line for it, not forever
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
        say(f"pid {seed} {pid}")
    os.close(go_read)
    if sys.stdin.readline().strip() == "go":
        os.write(go_write, b"g" * clients)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
