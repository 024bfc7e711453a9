"""``atoll plan MODEL_FILE``: compile a pipeline in-process and print its plan, with no cluster.

The model file is the user's own Python, run locally; it defines ``build()`` returning the
keyword arguments of ``Client.pipeline`` (model, example_input, example_target, loss_fn, stages,
microbatches, and optionally schedule, virtual_stages, optimizer, optimizer_args, split_points,
rematerialize). Command-line flags override them.
"""

from __future__ import annotations

import json
import runpy

from controller.compiler import PipelineRequest, compile_pipeline
from runtime._trace import trace_pipeline
from runtime.errors import InvalidInput
from runtime.plan import Plan

_OVERRIDES = ("stages", "microbatches", "schedule", "virtual_stages")


def build_plan(model_file: str, **overrides) -> Plan:
    namespace = runpy.run_path(model_file)
    if "build" not in namespace:
        raise InvalidInput(f"{model_file} defines no build() returning the arguments of Client.pipeline")
    spec = dict(namespace["build"]())
    spec.update({k: v for k, v in overrides.items() if v is not None and v is not False})
    for key in ("model", "example_input", "example_target", "loss_fn", "stages", "microbatches"):
        if key not in spec:
            raise InvalidInput(f"build() in {model_file} must return '{key}'")
    traced = trace_pipeline(
        spec["model"], spec["example_input"], spec["example_target"], spec["loss_fn"], spec["microbatches"]
    )
    compiled = compile_pipeline(
        PipelineRequest(
            blocks=traced.blocks,
            loss=traced.loss,
            ranks=spec["stages"],
            microbatches=spec["microbatches"],
            input=traced.input,
            target=traced.target,
            schedule=spec.get("schedule", "gpipe"),
            virtual_stages=spec.get("virtual_stages", 1),
            optimizer=spec.get("optimizer", "sgd"),
            optimizer_args=spec.get("optimizer_args", {}),
            split_points=spec.get("split_points", []),
            rematerialize=spec.get("rematerialize", False),
        )
    )
    return Plan(compiled.report())


def print_plan(args) -> None:
    plan = build_plan(args.model_file, rematerialize=args.rematerialize, **{k: getattr(args, k) for k in _OVERRIDES})
    print(json.dumps(plan.report, indent=1) if args.json else plan.render())
