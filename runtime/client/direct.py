"""Batches posted by the client straight to the workers that read them (Worker.PostBatch), so a
step's rows never pass through the controller: the step itself still goes to the controller,
which checks its specs, orders it and dispatches it (StepRequest.direct).

A batch of ``Job.direct_batch_bytes`` or more goes this way. Below that, one message through the
controller costs less than a message to each reading worker plus one to the controller (a tiny
step is dominated by per-call costs, not bytes). The route (which worker reads which rows) is
asked from the controller once per job (``BatchRoute``); every post carries the cluster token,
over TLS where the client has it, as every other call.
"""

from __future__ import annotations

import logging

from atoll._rpc import atoll_pb2 as pb
from atoll._rpc import atoll_pb2_grpc as pb_grpc
from atoll.core.wire import shard_rows
from atoll.errors import AtollError, WorkerUnavailable
from atoll.net.rpc import Endpoint

log = logging.getLogger("atoll.client")


def specs_only(tensors: list[pb.TensorData]) -> list[pb.TensorData]:
    """The tensors' dtypes and shapes, without their bytes: what the controller checks."""
    return [pb.TensorData(dtype=t.dtype, shape=t.shape) for t in tensors]


class BatchPoster:
    """One job's route to its batch readers, and a connection to each."""

    def __init__(self, client, job_id: str):
        self._client, self._job_id = client, job_id
        self._route: list[pb.BatchReader] | None = None
        self._endpoints: dict[str, Endpoint] = {}

    def _readers(self) -> list[pb.BatchReader]:
        if self._route is None:
            self._route = list(self._client._call("BatchRoute", pb.JobRef(job_id=self._job_id)).readers)
            for reader in self._route:
                if reader.address not in self._endpoints:
                    self._endpoints[reader.address] = Endpoint(
                        reader.address,
                        self._client._token,
                        pb_grpc.WorkerStub,
                        self._client._endpoint.default_timeout_s,  # a call's deadline, not a step's
                        tls=self._client._tls,
                    )
        return self._route

    def holders(self) -> tuple[str, str]:
        """The workers to hold a batch's inputs and its targets: the first reader of each ("" for a
        job that names no readers, an auto_resume one)."""
        readers = self._readers()
        inputs = next((r.worker_id for r in readers if r.inputs), "")
        return inputs, next((r.worker_id for r in readers if r.targets), "")

    def post(self, seq: int, inputs: list[pb.TensorData], targets: list[pb.TensorData]) -> bool:
        """Give every reader its rows of step ``seq``'s batch (all at once); True once each has
        them. False where the job takes no posted batches (an auto_resume job: the controller
        keeps its batches to run a step again) or a post failed: the step then carries its batch
        through the controller, as any other, and meets any fault there (a batch posted to the
        other readers is dropped by the worker once a later step runs). A worker this client
        cannot reach (only the controller may reach workers on a private network) turns posting
        off for the job: later steps do not wait for a connection that will not come."""
        readers = self._readers()
        if not readers:
            return False
        sent = []
        for reader in readers:
            part = pb.PostBatchRequest(
                job_id=self._job_id,
                step=seq,
                inputs=[shard_rows(t, reader.replica, reader.replicas) for t in inputs] if reader.inputs else [],
                targets=[shard_rows(t, reader.replica, reader.replicas) for t in targets] if reader.targets else [],
            )
            endpoint = self._endpoints[reader.address]
            sent.append((endpoint, endpoint.future("PostBatch", part)))
        try:
            for endpoint, future in sent:
                endpoint.resolve(future, "PostBatch")
        except AtollError as e:
            if isinstance(e, WorkerUnavailable):  # not reachable from here (a private network?): stop trying
                self._route = []
            log.warning(
                "job %s step %d: posting its batch failed (%s); it goes through the controller%s",
                self._job_id,
                seq,
                e,
                ", as will the job's later batches" if self._route == [] else "",
            )
            return False
        return True

    def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.close()
        self._endpoints.clear()
        self._route = None
