"""The client processes of tests/test_soak.py, forked from one process that imported torch and
atoll once (eight separate imports cost the suite about 20 s of CPU), each then a client of its own:

    python -m tests.soak_clients ADDRESS TOKEN CLIENTS STEPS WARM

Prints "pid SEED PID" for each client; each client submits a 2-stage job, prints "warm SEED" after
WARM steps and waits until "go" comes on this process's stdin, then trains on and prints "losses
SEED [...]" (or "failed SEED"). Exits 0 once every client has ended well. Each line is one write,
shorter than a pipe's atomic size, so the clients' lines never interleave.
"""

import json
import os
import sys
import traceback

import torch._dynamo  # noqa: F401 (imported once here, not in every client: export needs it)
import torch.export  # noqa: F401

import atoll
from tests import models


def client(address: str, token: str, seed: int, steps: int, warm: int, go_fd: int) -> None:
    model, batches, loss_fn = models.mlp(seed)
    x, y = batches[0]
    with atoll.connect(address, token) as connection:
        job = connection.pipeline(model, example_input=x, example_target=y, loss_fn=loss_fn, stages=2, microbatches=2)
        losses = []
        for i in range(steps):
            if i == warm:
                print(f"warm {seed}", flush=True)
                os.read(go_fd, 1)  # the parent measures memory, then lets every client go on
            losses.append(job.step(*batches[i % len(batches)]))
        job.close()
    print(f"losses {seed} {json.dumps(losses)}", flush=True)


def main() -> int:
    address, token = sys.argv[1], sys.argv[2]
    clients, steps, warm = (int(a) for a in sys.argv[3:6])
    go_read, go_write = os.pipe()
    pids = []
    for seed in range(clients):
        sys.stdout.flush()  # nothing buffered is copied into the child
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(go_write)
                client(address, token, seed, steps, warm, go_read)
                code = 0
            except BaseException:  # noqa: BLE001 (reported, and the exit code says it failed)
                traceback.print_exc()
                print(f"failed {seed}", flush=True)  # the parent reads a line for it, not forever
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
        print(f"pid {seed} {pid}", flush=True)
    os.close(go_read)
    if sys.stdin.readline().strip() == "go":
        os.write(go_write, b"g" * clients)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
