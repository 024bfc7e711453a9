"""Resident base models (JobConfig.base_name) and the jobs attached to them (JobConfig.base).

A base is a job whose parameters are all frozen, loaded once and held on its workers until it is
closed. A job attached to it is placed on the base's workers, cut into stages where the base is
cut, and its workers make its frozen parameters the base's own tensors (runtime/worker/loader.py),
so the base is held once however many jobs train adapters on it. Closing the base stops new
attachments; the jobs attached keep its tensors (the workers' references) until they close.
"""

from __future__ import annotations

from atoll._rpc import atoll_pb2 as pb
from atoll.controller.compiler.pipeline import CompiledPipeline
from atoll.controller.jobs import Job, JobState, JobTable
from atoll.errors import InvalidInput, NotFound, NotPermitted


def resident(jobs: JobTable, name: str) -> Job:
    """The loaded base called ``name``."""
    for job in jobs.all():
        if job.compiled.request.config.base_name == name and job.state is JobState.READY:
            return job
    known = sorted(j.compiled.request.config.base_name for j in jobs.all() if j.compiled.request.config.base_name)
    raise NotFound(f"no resident base named {name!r} (loaded: {', '.join(known) or 'none'}; see Client.load_base)")


def refuse_duplicate(jobs: JobTable, name: str) -> None:
    if any(j.compiled.request.config.base_name == name and j.state is not JobState.FAILED for j in jobs.all()):
        raise InvalidInput(f"a resident base named {name!r} is loaded already; close it first or choose another name")


def cut_like(base: Job, request: pb.PipelineProgram) -> None:
    """Unless the job names its own split points, cut it where the base is cut, at the same
    operations of the same modules (a job's frozen parameters must sit on the worker whose base
    stage holds them; adapters add operations, so positions in the graph would not do)."""
    if not request.config.split_at:
        request.config.split_at.extend(s.start for s in base.compiled.stages[1:])


def readable(job: Job, session: str) -> Job:
    """The job, if ``session`` may read and save its tensors: an attached job's adapters are its
    client's alone (a detached one's, whoever holds the cluster token)."""
    if job.compiled.request.config.base and job.session and session != job.session:
        raise NotPermitted(
            f"job {job.job_id} trains adapters of another client: only the client that attached it reads or saves them"
        )
    return job


def check_fits(compiled: CompiledPipeline, base: Job) -> None:
    """The attached job has the base's layout: each of its workers holds the base's same stages."""
    mine, theirs = compiled.topology, base.compiled.topology
    for what in ("num_stages", "ranks", "data_parallel", "tensor_parallel", "stage_ranks"):
        if getattr(mine, what) != getattr(theirs, what):
            raise InvalidInput(
                f"a job attached to base {base.name!r} runs in the base's layout: its {what} is "
                f"{getattr(mine, what)}, the base's {getattr(theirs, what)}"
            )
    if compiled.request.config.device != base.compiled.request.config.device:
        raise InvalidInput(f"base {base.name!r} runs on {base.compiled.request.config.device} workers")
    dead = [w.describe() for w in base.workers if not w.alive]
    if dead:
        raise InvalidInput(f"base {base.name!r} lost workers ({', '.join(dead)}); load it again")
