"""Program analysis: load each stage's exported program, derive its input and output specs from
the graph, and measure its cost with fake tensors (nothing real is allocated or computed).

Fake tensors claim the device the stage will run on, so kernels are chosen as they will be there:
on a CPU worker, scaled_dot_product_attention takes the fused CPU kernel (which saves q, k, v and
a log-sum-exp), whereas plain meta tensors would take the math path and save the whole attention
matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from atoll.controller.compiler import fake_kernels
from atoll.core.graphs import BlockGraph, deserialize, flatten
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class StageInfo:
    index: int
    data: bytes
    """The serialized exported program, forwarded untouched to the worker that runs it."""
    input: EdgeSpec
    output: EdgeSpec
    forward_flops: int
    parameter_count: int
    parameter_bytes: int


def _placeholder_specs(ep: torch.export.ExportedProgram, name: str) -> EdgeSpec:
    user_inputs = set(ep.graph_signature.user_inputs)
    specs = []
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in user_inputs:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise InvalidInput(f"edge '{name}': a non-tensor input ({type(val).__name__}) cannot cross a stage")
            specs.append(TensorSpec.of(val))
    return EdgeSpec(name, tuple(specs))


def fake_mode() -> FakeTensorMode:
    """A fake-tensor mode in which the real (loaded) parameters may take part, its kernels agreeing
    with the real ones (``fake_kernels.mend``)."""
    fake_kernels.mend()
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_inputs(spec: EdgeSpec, device: str = "cpu") -> list[torch.Tensor]:
    """Empty tensors of the spec; call inside a fake mode, where they allocate nothing."""
    return [t.empty(device) for t in spec.tensors]


def analyze_stage(index: int, data: bytes) -> tuple[StageInfo, BlockGraph]:
    ep = deserialize(data, f"stage {index} program")
    graph = BlockGraph(f"stage {index}", ep)
    input_spec = _placeholder_specs(ep, f"stage {index} input")
    params = list(graph.module.parameters())
    with fake_mode(), FlopCounterMode(display=False) as counter, torch.no_grad():
        out = graph.call_flat(fake_inputs(input_spec))
    output_spec = EdgeSpec(f"stage {index} output", tuple(TensorSpec.of(t) for t in flatten(out)))
    info = StageInfo(
        index=index,
        data=data,
        input=input_spec,
        output=output_spec,
        forward_flops=int(counter.get_total_flops()),
        parameter_count=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
    )
    return info, graph


def analyze_loss(data: bytes, last_output: EdgeSpec, target: EdgeSpec) -> BlockGraph:
    ep = deserialize(data, "loss program")
    graph = BlockGraph("loss", ep)
    got = _placeholder_specs(ep, "loss.input")
    expected = last_output.tensors + target.tensors
    if got.tensors != expected:
        raise InvalidInput(
            f"loss program takes {got}, but the model outputs {last_output} and a target microbatch is {target}"
        )
    with fake_mode(), torch.no_grad():
        out = graph.call_flat(fake_inputs(EdgeSpec("loss.input", expected)))
    leaves = flatten(out)
    if len(leaves) != 1 or leaves[0].shape != () or not leaves[0].is_floating_point():
        raise InvalidInput(
            f"loss_fn must return one floating-point scalar, returned "
            f"{', '.join(str(TensorSpec.of(t)) for t in leaves)}"
        )
    return graph
