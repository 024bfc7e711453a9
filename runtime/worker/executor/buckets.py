"""Data-parallel gradient averaging, bucketed and overlapped with the rest of the backward.

A parameter's gradient is final once the last backward of its stage in the step has accumulated
into it. During that backward a hook collects such gradients into buckets and starts each
bucket's all-reduce as soon as it is full, while autograd goes on with the rest of the stage (as
DDP does); whatever is left starts when that backward ends. Bucket sizes are DDP's: the step's
first bucket ``FIRST_BUCKET_BYTES`` (it starts early), the rest ``BUCKET_BYTES``. Each collective
costs gloo a fixed amount of work on every rank (2(n-1) ring rounds through its TCP loop), so many
small buckets cost more than they overlap: on 8 CPU workers of the GPT example (1.2 MB of
gradients), 256 KiB buckets cost each worker 9.6 ms of gloo-thread CPU per step, DDP's sizes 4 ms.
The rank's remaining work (sends, other stages, ALL_REDUCE_GRAD's wait) overlaps the transfers.
Tied parameters wait for ALL_REDUCE_GRAD: REDUCE_GRAD replaces their gradients first.

Every replica runs the same plan, so its hooks fire in the same order and the all-reduces pair
up one to one.
"""

from __future__ import annotations

import torch

FIRST_BUCKET_BYTES = 1024 * 1024
BUCKET_BYTES = 25 * 1024 * 1024


class GradBuckets:
    def __init__(self, stage_params: dict[int, list[torch.nn.Parameter]], tied: set[int], group, timeout_s: float):
        """``stage_params``: this rank's parameters by stage; ``tied``: ids of tied parameters."""
        self.group = group
        self.timeout_s = timeout_s
        self._stage_of = {id(p): s for s, ps in stage_params.items() for p in ps}
        self._all = [p for ps in stage_params.values() for p in ps]
        self._tied = tied
        self._armed: int | None = None  # the stage whose last backward of the step is running
        self._bucket: list[torch.Tensor] = []
        self._bucket_bytes = 0
        self._started: set[int] = set()
        self._handles: list = []
        self.reduced_bytes = 0
        for p in self._all:  # ``ready`` leaves the tied ones out, for this hook and for its other callers
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient has been accumulated: called by autograd's post-accumulate hook, and
        by the backwards that add gradients themselves (atoll.core.linear_grads, the split
        backward's weight half). During its stage's last backward of the step the gradient is
        final and goes into the bucket; tied parameters wait for ALL_REDUCE_GRAD."""
        if self._armed is None or id(p) in self._tied or self._stage_of.get(id(p)) != self._armed or p.grad is None:
            return
        self._bucket.append(p.grad)
        self._started.add(id(p))
        self._bucket_bytes += p.grad.nbytes
        if self._bucket_bytes >= (BUCKET_BYTES if self._handles else FIRST_BUCKET_BYTES):
            self._launch()

    def _launch(self) -> None:
        if self._bucket:
            self._handles.append((self.group.all_reduce_sum(self._bucket), self._bucket))
            self.reduced_bytes += self._bucket_bytes
        self._bucket, self._bucket_bytes = [], 0

    def last_backward(self, stage: int):
        """Context for the step's last backward of ``stage``: its final gradients go out as they come."""
        buckets = self

        class _Armed:
            def __enter__(self):
                buckets._armed = stage

            def __exit__(self, *exc):
                buckets._armed = None
                buckets._launch()

        return _Armed()

    def finish(self) -> int:
        """Reduce what has not gone yet (tied parameters), wait for everything, divide by the
        replica count; returns the gradient bytes reduced this step."""
        self._bucket = [p.grad for p in self._all if p.grad is not None and id(p) not in self._started]
        self._bucket_bytes = sum(g.nbytes for g in self._bucket)
        self._launch()
        for handle, grads in self._handles:
            handle.wait(self.timeout_s)
            torch._foreach_div_(grads, self.group.world_size)  # one call, not one per gradient
        reduced, self.reduced_bytes = self.reduced_bytes, 0
        self._handles, self._started = [], set()
        return reduced

    def reset(self) -> None:
        """After a failed step: forget what was started (the job is failed anyway)."""
        self._armed, self._bucket, self._bucket_bytes = None, [], 0
        self._handles, self._started, self.reduced_bytes = [], set(), 0
