"""Remote values on their holders: placing a tensor on a worker, reading and freeing it there, and
naming each holder's current value-server address (who reads a value is controller/values.py)."""

from __future__ import annotations

import logging
import threading
import uuid

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.cluster.registry import Registry, WorkerRecord
from atoll.controller.values import ValueTable
from atoll.core.wire import spec_of_pb_tensor, tensor_spec_to_pb
from atoll.errors import AtollError, NotEnoughWorkers, NotFound

log = logging.getLogger("atoll.controller")


def holder_ref(worker: WorkerRecord, ref: pb.RemoteRef) -> pb.RemoteRef:
    return pb.RemoteRef(value_id=ref.value_id, worker_id=worker.worker_id, address=worker.value_address, spec=ref.spec)


class RemoteValues:
    def __init__(self, registry: Registry, lock: threading.Lock):
        """``lock`` is the controller's (controller/jobs.py, JobTable): a value's holder is chosen
        by the workers' load, which placement changes under it."""
        self.registry = registry
        self._lock = lock
        self.table = ValueTable(self._free_on_holder)

    def holder(self, ref: pb.RemoteRef) -> WorkerRecord:
        worker = self.registry.get(ref.worker_id)
        if worker is None or not worker.alive:
            raise NotFound(f"remote value {ref.value_id}: its worker {ref.worker_id!r} is gone, and the value with it")
        return worker

    def resolve(self, refs) -> list[pb.RemoteRef]:
        """The references with their holders' current value-server addresses (checked alive)."""
        return [holder_ref(self.holder(r), r) for r in refs]

    def kept(self, worker: WorkerRecord, ref: pb.RemoteRef) -> pb.RemoteRef:
        """A forward step's output kept on ``worker``: a live value from now on."""
        self.table.add(ref.value_id, worker.worker_id)
        return holder_ref(worker, ref)

    def put(self, request: pb.PutValueRequest) -> pb.RemoteRef:
        """Place a tensor on a worker (the one named, else the least loaded of ``island``) and keep it there."""
        with self._lock:
            workers = [w for w in self.registry.live() if not request.island or w.island == request.island]
            if request.worker_id:
                workers = [w for w in workers if w.worker_id == request.worker_id]
                if not workers:
                    where = f" on island {request.island!r}" if request.island else ""
                    raise NotFound(f"no live worker {request.worker_id!r}{where} to hold a value")
            if not workers:
                raise NotEnoughWorkers(f"no live worker on island {request.island!r} to hold a value")
            worker = min(workers, key=lambda w: (len(w.jobs), int(w.worker_id[1:])))
        value_id = uuid.uuid4().hex
        worker.endpoint.call("PutValue", pb.PutValueRequest(tensor=request.tensor, value_id=value_id))
        self.table.add(value_id, worker.worker_id)
        spec = tensor_spec_to_pb(spec_of_pb_tensor(request.tensor))
        return holder_ref(worker, pb.RemoteRef(value_id=value_id, spec=spec))

    def get(self, request: pb.RemoteRef) -> pb.TensorData:
        self.table.check([request.value_id])
        return self.holder(request).endpoint.call("GetValue", request)

    def _free_on_holder(self, value_id: str, worker_id: str) -> None:
        worker = self.registry.get(worker_id)
        if worker is None or not worker.alive:
            return  # the value went with its worker
        try:
            worker.endpoint.call("FreeValue", pb.RemoteRef(value_id=value_id, worker_id=worker_id))
        except AtollError as e:  # the worker may be dying; its values go with it
            log.warning("freeing remote value %s on %s: %s", value_id, worker.describe(), e)
