"""Remote values on the client side: a handle to a tensor that stays on a worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atoll._rpc import atoll_pb2 as pb
from atoll.core.wire import tensor_from_pb, tensor_spec_from_pb

if TYPE_CHECKING:
    from atoll.client.client import Client


class RemoteValue:
    """A tensor kept on a worker: made by ``client.put`` or kept by ``job.forward(..., keep=True)``.

    Pass it to any job's ``step``/``evaluate``/``forward`` in place of a tensor: the worker that
    needs it pulls it from the holder over the data plane; neither the client nor the controller
    carries its bytes. ``result()`` fetches a copy; ``free()`` (or dropping the last reference)
    releases it on the worker."""

    def __init__(self, client: Client, ref: pb.RemoteRef):
        self._client = client
        self.ref = ref
        self.spec = tensor_spec_from_pb(ref.spec, "remote value")
        self._freed = False
        self._readers: list = []  # the calls of steps sent with this value, while unfinished

    def _read_by(self, call) -> None:
        """A step sent with this value (its StepCall): ``free`` waits for it to end."""
        self._readers = [c for c in self._readers if not c.done()] + [call]

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def worker_id(self) -> str:
        return self.ref.worker_id

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    def result(self) -> torch.Tensor:
        """A local copy of the tensor (through the controller: the client asked for the bytes)."""
        return tensor_from_pb(self._client._call("GetValue", self.ref), "remote value")

    def free(self) -> None:
        """Release the tensor on its worker (idempotent), after the steps this client already sent
        with it have ended (the controller, too, frees a value only once the steps it has accepted
        that read it have ended; a step sent after this is refused)."""
        if not self._freed:
            self._freed = True
            for call in self._readers:
                call.wait()
            self._readers = []
            self._client._call("FreeValue", self.ref)

    def __del__(self):
        if not self._freed:
            try:
                self.free()
            except Exception:  # the cluster or the interpreter may already be gone
                pass

    def __repr__(self) -> str:
        return f"RemoteValue({self.spec} on {self.worker_id}, id {self.ref.value_id[:8]})"
