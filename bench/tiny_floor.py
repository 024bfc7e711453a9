"""The floor under bench/dispatch.py's tiny training steps: the same 4-stage chain (a Linear(8, 8)
per stage, batch 2, one microbatch, MSE, SGD) in 4 plain PyTorch processes joined by Unix socket
pairs, with no runtime at all: no controller, no client, no plan, no bookkeeping. Each step is the
chain's dependency order itself (F0..F3, then B3..B0, each stage's SGD step after its backward), so
it is what any runtime for this job could reach on this machine with Python driving PyTorch."""

from __future__ import annotations

import multiprocessing
import socket
import time

import torch
import torch.nn.functional as F

ROWS = 2


def _recv_into(sock: socket.socket, buffer: torch.Tensor) -> torch.Tensor:
    view, got = memoryview(buffer.numpy()).cast("B"), 0
    while got < len(view):
        got += sock.recv_into(view[got:])
    return buffer


def _stage(rank: int, stages: int, left, right, warmup: int, steps: int, results, make_model) -> None:
    torch.set_num_threads(1)
    model, x = make_model(stages)  # each process builds the same seeded model and keeps its own stage
    linear = model[rank]
    optimizer = torch.optim.SGD(linear.parameters(), lr=1e-3, foreach=True)
    incoming, grad_in = torch.empty_like(x), torch.empty_like(x)
    losses = []

    def step() -> None:
        inp = x if left is None else _recv_into(left, incoming).clone().requires_grad_(True)
        out = linear(inp)
        if right is None:
            loss = F.mse_loss(out, x)
            loss.backward()
            losses.append(loss.item())
        else:
            right.sendall(memoryview(out.detach().numpy()).cast("B"))
            out.backward(_recv_into(right, grad_in))
        if left is not None:
            left.sendall(memoryview(inp.grad.numpy()).cast("B"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    results.put((rank, time.perf_counter() - wall, time.process_time() - cpu, losses[:3]))


def no_runtime_floor(make_model, stages: int = 4, steps: int = 2000, warmup: int = 100, timeout_s: float = 120) -> dict:
    """Tiny training steps per second through ``stages`` plain processes; ``make_model(stages)``
    returns (the seeded nn.Sequential, the batch), as bench/dispatch.py's ``tiny`` does."""
    ctx = multiprocessing.get_context("fork")  # run before the caller starts threads, as the gloo chain is
    links = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(stages - 1)]
    results = ctx.Queue()
    procs = []
    for rank in range(stages):
        left = links[rank - 1][1] if rank > 0 else None
        right = links[rank][0] if rank < stages - 1 else None
        args = (rank, stages, left, right, warmup, steps, results, make_model)
        procs.append(ctx.Process(target=_stage, args=args, daemon=True))
    for p in procs:
        p.start()
    try:
        by_rank = sorted(results.get(timeout=timeout_s) for _ in procs)
    finally:
        for a, b in links:
            a.close()
            b.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    cpu_ms = [round(cpu / steps * 1e3, 3) for _, _, cpu, _ in by_rank]
    return {
        "steps_per_s": round(steps / by_rank[0][1], 1),
        "cpu_ms_per_step_by_stage": cpu_ms,
        "cpu_ms_per_step_total": round(sum(cpu_ms), 3),
        "first_losses": by_rank[-1][3],
    }
