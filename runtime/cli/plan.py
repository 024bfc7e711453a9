"""``atoll plan MODEL_FILE``: compile a pipeline in-process and print its plan, with no cluster.

The model file is the user's own Python, run locally; it defines ``build()`` returning the
keyword arguments of ``Client.pipeline`` (model, example_input, example_target, loss_fn, stages,
microbatches, and optionally schedule, virtual_stages, optimizer, optimizer_args, split_points,
rematerialize). Command-line flags override them. The program goes through the same client code
and the same controller decoder and compiler as a real submission, so the plan is the one a
cluster would compile (less the placement).
"""

from __future__ import annotations

import json
import os
import runpy

from atoll._rpc import atoll_pb2 as pb
from atoll.client.client import Client
from atoll.client.plan import Plan
from atoll.controller.compiler.pipeline import compile_pipeline
from atoll.controller.service import decode_program
from atoll.errors import InvalidInput

_OVERRIDES = (
    "stages",
    "microbatches",
    "schedule",
    "virtual_stages",
    "data_parallel",
    "zero",
    "reshard_after_forward",
    "tensor_parallel",
    "sequence_parallel",
)


class _PlanOnlyClient(Client):
    """Answers SubmitPipeline by compiling in this process; there is no controller to call."""

    session = ""

    def __init__(self):
        self.address = "in-process"
        self.step_timeout_s = 0.0

    def _keep_alive(self) -> None:  # nothing to keep alive: no controller
        pass

    def _calibrated(self, config, submit, batch):
        """No workers to calibrate on: schedule="auto" simulates at the stages' FLOP counts, in the
        job's own layout."""
        return config

    def _call(self, method: str, request, timeout_s: float | None = None):
        assert method == "SubmitPipeline", method
        compiled = compile_pipeline(decode_program(request))
        return pb.SubmitReply(job_id="", plan_json=json.dumps(compiled.report()))


def build_plan(model_file: str, **overrides) -> Plan:
    if not os.path.isfile(model_file):
        raise InvalidInput(f"{model_file}: no such file")
    namespace = runpy.run_path(model_file)
    if "build" not in namespace:
        raise InvalidInput(f"{model_file} defines no build() returning the arguments of Client.pipeline")
    spec = dict(namespace["build"]())
    spec.update({k: v for k, v in overrides.items() if v is not None and v is not False})
    try:
        model = spec.pop("model")
    except KeyError:
        raise InvalidInput(f"build() in {model_file} must return 'model'") from None
    try:
        return _PlanOnlyClient().pipeline(model, **spec).plan
    except TypeError as e:  # a missing or unknown argument of Client.pipeline
        raise InvalidInput(f"build() in {model_file} returned arguments Client.pipeline does not take: {e}") from None


def print_plan(args) -> None:
    plan = build_plan(args.model_file, rematerialize=args.rematerialize, **{k: getattr(args, k) for k in _OVERRIDES})
    print(json.dumps(plan.report, indent=1) if args.json else plan.render())
