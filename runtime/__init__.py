"""atoll: a Pathways-style asynchronous MPMD dataflow runtime for PyTorch.

import atoll
with atoll.LocalCluster(workers=4) as cluster, cluster.client() as client:
    job = client.pipeline(model, example_input=x, example_target=y, loss_fn=loss,
                          stages=4, microbatches=8, schedule="1f1b")
    loss = job.step(x, y)
"""

from atoll.client import Client, Job, StepFuture, StepResult, connect
from atoll.errors import (
    AtollError,
    DeadlineExceeded,
    InvalidInput,
    JobFailed,
    NotEnoughWorkers,
    NotFound,
    NotPermitted,
    Unauthenticated,
    WorkerUnavailable,
)
from atoll.local import LocalCluster
from atoll.plan import ClusterStatus, Plan
from atoll.program import Program, Value
from atoll.remote import RemoteValue
from atoll.trace import Trace

__all__ = [
    "AtollError",
    "Client",
    "ClusterStatus",
    "DeadlineExceeded",
    "InvalidInput",
    "Job",
    "JobFailed",
    "LocalCluster",
    "NotEnoughWorkers",
    "NotFound",
    "NotPermitted",
    "Plan",
    "Program",
    "RemoteValue",
    "StepFuture",
    "StepResult",
    "Trace",
    "Unauthenticated",
    "Value",
    "WorkerUnavailable",
    "connect",
]
