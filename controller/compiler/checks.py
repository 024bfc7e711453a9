"""The settings a job may not combine, refused before any pass runs, each with the reason."""

from __future__ import annotations

from atoll.core.config import JobConfig
from atoll.core.names import DEVICE_KINDS, DISPATCH_MODES, SPLIT_BACKWARD_SCHEDULES, TRANSPORTS
from atoll.core.optim import validate_optimizer
from atoll.errors import InvalidInput


def check_config(cfg: JobConfig) -> None:
    """Raises InvalidInput naming the first setting (or pair of settings) that cannot run."""
    validate_optimizer(cfg.optimizer, cfg.optimizer_args)
    if cfg.dispatch not in DISPATCH_MODES:
        raise InvalidInput(f"dispatch must be one of {', '.join(DISPATCH_MODES)}; got {cfg.dispatch!r}")
    if cfg.precision == "fp16":
        raise InvalidInput(
            'precision "fp16" needs dynamic loss scaling, which atoll does not do: use "bf16" (same bytes, '
            "float32's exponent range, no scaling)"
        )
    if cfg.precision not in ("fp32", "bf16"):
        raise InvalidInput(f'precision must be "fp32" or "bf16", got {cfg.precision!r}')
    if cfg.zero not in (0, 1, 2, 3):
        raise InvalidInput(f"zero must be 0, 1, 2 or 3 (a ZeRO stage), got {cfg.zero}")
    if cfg.zero and cfg.data_parallel < 2:
        raise InvalidInput(f"zero={cfg.zero} shards model state across data-parallel replicas: needs data_parallel > 1")
    if cfg.reshard_after_forward and cfg.zero != 3:
        raise InvalidInput(
            "reshard_after_forward frees ZeRO-3's gathered parameters after each compute: "
            f"needs zero=3, got zero={cfg.zero}"
        )
    if cfg.tensor_parallel_plan and cfg.tensor_parallel == 1:
        raise InvalidInput("tensor_parallel_plan names how to shard modules: it needs tensor_parallel > 1")
    if cfg.sequence_parallel and cfg.tensor_parallel == 1:
        raise InvalidInput(
            "sequence_parallel slices the sequence over a tensor-parallel island: needs tensor_parallel > 1"
        )
    cfg.layouts()  # auto_microbatches and auto_virtual_stages: what "auto" runs, and only for it
    if cfg.schedule in SPLIT_BACKWARD_SCHEDULES and (why := cfg.split_backward_refused()):
        raise InvalidInput(f"schedule {cfg.schedule!r} splits the backward; {why}")
    if cfg.base and cfg.base_name:
        raise InvalidInput("a job is a resident base (base_name) or attaches to one (base), not both")
    if (cfg.base or cfg.base_name) and cfg.auto_resume:
        raise InvalidInput(
            "auto_resume moves a job to other workers; a resident base and the jobs attached to it share "
            "their workers' tensors, so it is not built for them"
        )
    if cfg.auto_resume and not cfg.checkpoint_path:
        raise InvalidInput("auto_resume restores from a checkpoint: it needs checkpoint_path")
    if cfg.checkpoint_every < 1:
        raise InvalidInput(f"checkpoint_every must be a positive number of steps, got {cfg.checkpoint_every}")
    if not cfg.weight > 0:
        raise InvalidInput(f"weight must be positive, got {cfg.weight}")
    if not cfg.data_plane_timeout_s > 0:
        raise InvalidInput(f"data_plane_timeout_s must be positive, got {cfg.data_plane_timeout_s}")
    if cfg.device not in DEVICE_KINDS:
        raise InvalidInput(f"unknown device kind {cfg.device!r} (known: {', '.join(DEVICE_KINDS)})")
    if cfg.transport != "auto" and cfg.transport not in TRANSPORTS:
        raise InvalidInput(f"unknown transport {cfg.transport!r} (known: auto, {', '.join(TRANSPORTS)})")
