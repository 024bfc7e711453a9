"""A job's trained state on its workers: gathered whole for the client, saved to a checkpoint
(atoll.core.checkpoint) and loaded back from one, cut for the job's layout."""

from __future__ import annotations

from dataclasses import dataclass

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.cluster.dispatch import Call, DispatchError
from atoll.controller.gang import Gang
from atoll.controller.jobs import Job
from atoll.controller.lifecycle import Lifecycle
from atoll.controller.statedir import MemoryState
from atoll.core import checkpoint
from atoll.core.wire import tensor_from_pb, tensor_to_pb
from atoll.errors import InvalidInput, JobFailed


@dataclass(kw_only=True, eq=False)
class StateStore:
    gang: Gang
    """Reads and writes go in gang order, after the steps sent before them."""
    lifecycle: Lifecycle
    """Fails a job that lost a worker while saving."""
    records: MemoryState
    """The state directory: an auto_resume job's journal starts again there at each checkpoint."""
    step_timeout_s: float
    load_timeout_s: float

    def get_state(self, job: Job) -> pb.StateReply:
        # every replica holds the same weights: replica 0's are read, from every rank of each island;
        # under ZeRO-3 every replica is asked, since they gather the weights from each other's shards
        compiled = job.compiled
        replica0 = job.workers[: compiled.topology.ranks * compiled.topology.tensor_parallel]
        asked = job.workers if compiled.request.config.zero == 3 else replica0
        calls = [Call(w, "GetState", pb.GetStateRequest(job_id=job.job_id)) for w in asked]
        with job.order:  # after every step the client has sent so far
            pending = self.gang.dispatch(calls, self.step_timeout_s, lane=job.lane)
        replies = pending.replies()[: len(replica0)]
        pieces: dict[str, dict[int, pb.TensorData]] = {}  # name -> island rank -> tensor
        for i, reply in enumerate(replies):
            for t in reply.tensors:  # a tied parameter comes from each holder, alike
                pieces.setdefault(t.name, {})[compiled.topology.coordinates(i)[2]] = t.tensor
        cuts, tensors = compiled.cuts, {}
        for name, by_rank in pieces.items():
            cut = cuts.get(name)  # a tensor-parallel piece per island rank, joined here; else whole on each
            whole = (
                by_rank[0]
                if cut is None
                else tensor_to_pb(cut.join([tensor_from_pb(by_rank[t], name) for t in sorted(by_rank)]))
            )
            tensors[name] = pb.NamedTensor(name=name, tensor=whole)
        for alias, name in job.compiled.request.aliases.items():  # the model's other names of shared tensors
            if name in tensors:
                tensors[alias] = pb.NamedTensor(name=alias, tensor=tensors[name].tensor)
        return pb.StateReply(tensors=list(tensors.values()))

    def save(self, job: Job, path: str) -> pb.SaveReply:
        """The client's Save: a failure keeps the previous checkpoint and says whether the job
        survives it."""
        if not path:
            raise InvalidInput("a checkpoint needs a path")
        try:
            version, step = self.write(job, path)
        except DispatchError as e:
            cause = self.gang.blame(job, e)  # a worker that died is marked dead, and the job fails
            message = f"saving job {job.job_id} failed; the previous checkpoint is kept. Cause: {cause}"
            if job.auto_resume and not all(w.alive for w in job.workers):
                job.broken = cause  # restored before its next step (controller/resume.py)
                raise InvalidInput(message + " (the job is restored before its next step)") from None
            if not all(w.alive for w in job.workers):
                self.lifecycle.fail(job, f"saving failed: {cause}")
                raise JobFailed(message) from None
            raise InvalidInput(message) from None
        return pb.SaveReply(path=path, version=version.name, step=step)

    def checkpoint(self, job: Job) -> None:
        """An auto_resume job's checkpoint: its journal of steps starts again from it."""
        self.write(job, job.compiled.request.config.checkpoint_path)
        job.journal.clear()
        self.records.journal_clear(job.job_id)

    def write(self, job: Job, path: str):
        """Every worker of replica 0 writes its own tensors into a new version of the checkpoint at
        ``path``; the manifest and the switch of ``current`` come last (atoll.core.checkpoint).
        Returns (version directory, step); a failed save removes its version and raises DispatchError."""
        compiled, topo = job.compiled, job.compiled.topology
        with job.order:  # after every step the client has sent so far
            step = job.steps  # training steps taken (the client waits for its steps before saving)
            version = checkpoint.new_version(path, step)
            replica0 = list(enumerate(job.workers[: topo.ranks * topo.tensor_parallel]))
            files = {i: checkpoint.worker_file(*topo.coordinates(i)[1:]) for i, _ in replica0}
            calls = [
                Call(w, "SaveState", pb.SaveStateRequest(job_id=job.job_id, directory=str(version), file=files[i]))
                for i, w in replica0
            ]
            if compiled.request.config.zero:  # the other replicas gather their shards with replica 0, writing nothing
                others = job.workers[len(replica0) :]
                empty = pb.SaveStateRequest(job_id=job.job_id, directory=str(version))
                calls += [Call(w, "SaveState", empty) for w in others]
            pending = self.gang.dispatch(calls, self.step_timeout_s, lane=job.lane)
        try:
            replies = pending.settle().replies()  # no worker still writing when a failed version goes
        except DispatchError:
            checkpoint.discard(version)
            raise
        cfg = compiled.request.config
        manifest = {
            "step": step,
            "layout": job.report["layout"],
            "optimizer": cfg.optimizer,
            "optimizer_args": cfg.optimizer_args,
            "cuts": {n: c.to_json() for n, c in compiled.cuts.items()},
            "files": [
                {"file": files[i], "rank": topo.coordinates(i)[1], "tp": topo.coordinates(i)[2]}
                | {"keys": {s.key: [list(s.shape), s.dtype] for s in r.tensors}}
                for (i, _), r in zip(replica0, replies)  # replica 0's, first
            ],
        }
        checkpoint.commit(version, manifest)
        return version, step

    def restore(self, job: Job, path: str) -> dict:
        """Load every worker's state from the checkpoint at ``path``, cut for this job's layout."""
        version, manifest = checkpoint.open_current(path)
        cfg = job.compiled.request.config
        if manifest["optimizer"] != cfg.optimizer:
            raise InvalidInput(
                f"the checkpoint at {path} holds {manifest['optimizer']} state; this job uses {cfg.optimizer}"
            )
        cuts = [c.to_pb(n) for n, c in job.compiled.cuts.items()]
        request = pb.LoadStateRequest(job_id=job.job_id, directory=str(version), cuts=cuts)
        self.gang.dispatch(
            [Call(w, "LoadState", request) for w in job.workers], self.load_timeout_s, lane=job.lane
        ).replies()
        job.steps = manifest["step"]  # the job's training steps go on counting from the checkpoint's
        return {"path": path, "version": version.name, "step": manifest["step"]}
