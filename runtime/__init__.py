"""atoll: a Pathways-style asynchronous MPMD dataflow runtime for PyTorch.

import atoll
with atoll.LocalCluster(workers=4) as cluster, cluster.client() as client:
    job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss,
                          stages=4, microbatches=8, schedule="1f1b")
    loss = job.step(x, y)
"""

import importlib
from typing import TYPE_CHECKING

# Each public name and the module that defines it. They are imported on first use, so that
# ``import atoll`` (and every ``atoll`` command that needs no torch, such as ``atoll status``)
# does not pay for importing torch.
_EXPORTS = {
    "Client": "atoll.client.client",
    "Job": "atoll.client.job",
    "StepFuture": "atoll.client.job",
    "StepResult": "atoll.client.job",
    "AdapterJob": "atoll.client.lora",
    "LoraConfig": "atoll.client.lora",
    "connect": "atoll.client.client",
    "LocalCluster": "atoll.client.local",
    "ClusterStatus": "atoll.client.plan",
    "Plan": "atoll.client.plan",
    "ParameterServerJob": "atoll.client.parameter_server",
    "TaskStep": "atoll.client.parameter_server",
    "Program": "atoll.client.program",
    "Value": "atoll.client.program",
    "RemoteValue": "atoll.client.remote",
    "Trace": "atoll.client.trace",
    **dict.fromkeys(
        (
            "AtollError",
            "ControllerUnavailable",
            "DeadlineExceeded",
            "InvalidInput",
            "JobFailed",
            "NotEnoughWorkers",
            "NotFound",
            "NotPermitted",
            "Unauthenticated",
            "WorkerUnavailable",
        ),
        "atoll.errors",
    ),
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'atoll' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from atoll.client.client import Client, connect
    from atoll.client.job import Job, StepFuture, StepResult
    from atoll.client.local import LocalCluster
    from atoll.client.lora import AdapterJob, LoraConfig
    from atoll.client.parameter_server import ParameterServerJob, TaskStep
    from atoll.client.plan import ClusterStatus, Plan
    from atoll.client.program import Program, Value
    from atoll.client.remote import RemoteValue
    from atoll.client.trace import Trace
    from atoll.errors import (
        AtollError,
        ControllerUnavailable,
        DeadlineExceeded,
        InvalidInput,
        JobFailed,
        NotEnoughWorkers,
        NotFound,
        NotPermitted,
        Unauthenticated,
        WorkerUnavailable,
    )

__all__ = [
    "AdapterJob",
    "AtollError",
    "Client",
    "ClusterStatus",
    "ControllerUnavailable",
    "DeadlineExceeded",
    "InvalidInput",
    "Job",
    "JobFailed",
    "LocalCluster",
    "LoraConfig",
    "NotEnoughWorkers",
    "NotFound",
    "NotPermitted",
    "ParameterServerJob",
    "Plan",
    "Program",
    "RemoteValue",
    "StepFuture",
    "StepResult",
    "TaskStep",
    "Trace",
    "Unauthenticated",
    "Value",
    "WorkerUnavailable",
    "connect",
]
