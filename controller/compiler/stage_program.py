"""A stage's exported program built from its piece of the model's graph, without tracing it again.

The split copies each stage's nodes out of the client's exported model: ATen operations already,
each with its fake value and metadata. Exporting that graph again (``torch.export.export``) traces
every operation once more through fake tensors and generates code several times: the 6-layer
example GPT's 4-stage split took 1.10 s of CPU that way, 0.49 s built here. For a graph of plain
ATen operations the result is known without tracing: its parameters, buffers and constants become
inputs (as torch.export lifts them), the stage's inputs and outputs stay what they are. ``lift``
builds that ExportedProgram: the same operations in the same order, the same state and
signature, bit-identical outputs and gradients, the same tensor-parallel cut
(tests/test_stage_program.py, against the re-export, on seven models: MLPs, GPTs, tied weights,
Hugging Face GPT-2 and Mistral). Its nodes keep the names they had in the whole model.

Tensor parallelism's rewrite of a stage (and of the loss) for each island rank (new collectives,
cut shapes) is lifted the same way once its fake values are propagated again and its calls of
Python functions (the vocabulary-parallel embedding and cross-entropy) are traced into the ATen
operations they run (``lift_rewritten``): a GPT-2 stage's rewrite for 2 ranks took 1.3-1.6 s of
CPU exported, 0.5-0.7 s lifted.

Anything else (an in-place or other mutating operation, whose effect on an input or a buffer
export would have to record; a higher-order operation or a submodule; a non-tensor attribute; a
repeated or pass-through output; a failure) returns None, and the caller exports the stage as
before. What a lifted program lacks is only export's dtype check ahead of a ``.to`` it traces
itself (``_assert_tensor_metadata``), which computes nothing.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._guards import detect_fake_mode
from torch.export.exported_program import ExportedProgram, ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from atoll.controller.compiler.program import fake_mode
from atoll.core.graphs import export, serialize

log = logging.getLogger("atoll.controller")

_LIFTED = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}
"""torch.export's placeholder prefixes for what it lifts, in its order."""


def lift(root: torch.nn.Module, graph: fx.Graph, persistent: set[str]) -> ExportedProgram | None:
    """``graph`` (its attributes read from ``root``; ``persistent``: the buffers in ``root``'s
    state dict) as an ExportedProgram, or None where only tracing it again can say what it is.
    ``graph`` itself is left as it was."""
    try:
        return _lift(root, graph, persistent)
    except Exception as e:  # a torch whose ExportedProgram wants more than this one's: trace it
        log.debug("a stage is exported again: %s: %s", type(e).__name__, e)
        return None


def _lift(root: torch.nn.Module, graph: fx.Graph, persistent: set[str]) -> ExportedProgram | None:
    if not all(_plain(n) for n in graph.nodes):
        return None
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    if len(set(results)) != len(results) or any(r.op != "call_function" for r in results):
        return None
    params = dict(root.named_parameters(remove_duplicate=False))
    buffers = dict(root.named_buffers(remove_duplicate=False))
    attrs: dict[InputKind, list[tuple[fx.Node, torch.Tensor]]] = {kind: [] for kind in _LIFTED}
    for node in graph.nodes:
        if node.op == "get_attr":
            value = _attribute(root, node.target)
            if not isinstance(value, torch.Tensor):
                return None
            kind = (
                InputKind.PARAMETER
                if node.target in params
                else InputKind.BUFFER
                if node.target in buffers
                else InputKind.CONSTANT_TENSOR
            )
            attrs[kind].append((node, value))

    lifted, env = fx.Graph(), {}
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    graph_mode = detect_fake_mode([n.meta["val"] for n in graph.nodes if "val" in n.meta])
    specs, state_dict, constants = [], {}, {}
    for kind, prefix in _LIFTED.items():
        for node, value in attrs[kind]:
            placeholder = lifted.placeholder(prefix + node.target.replace(".", "_"))
            placeholder.meta.update(node.meta)
            if "val" not in placeholder.meta:  # the split's own get_attr nodes carry none
                placeholder.meta["val"] = graph_mode.from_tensor(value, static_shapes=True)
            env[node] = placeholder
            kept = kind is InputKind.BUFFER and node.target in persistent
            (state_dict if kind is InputKind.PARAMETER or kept else constants)[node.target] = value
            arg = TensorArgument(placeholder.name)
            specs.append(InputSpec(kind, arg, node.target, kept if kind is InputKind.BUFFER else None))
    for node in inputs:  # after what was lifted, as torch.export orders them
        env[node] = lifted.node_copy(node)
    for node in graph.nodes:
        if node.op == "call_function":
            env[node] = lifted.node_copy(node, env.__getitem__)
    lifted.output(tuple(env[r] for r in results))
    specs += [InputSpec(InputKind.USER_INPUT, TensorArgument(env[n].name), None) for n in inputs]
    outputs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(env[r].name), None) for r in results]
    call = ModuleCallSignature(
        inputs=[],
        outputs=[],
        in_spec=pytree.tree_structure((tuple(inputs), {})),
        out_spec=pytree.tree_structure(tuple(results)),
        forward_arg_names=[n.name for n in inputs],
    )
    return ExportedProgram(
        root=torch.nn.Module(),
        graph=lifted,
        graph_signature=ExportGraphSignature(specs, outputs),
        state_dict=state_dict,
        range_constraints={},
        module_call_graph=[ModuleCallEntry("", call)],
        constants=constants,
    )


def rewritten_program(module: fx.GraphModule, inputs: tuple[torch.Tensor, ...], failure: str) -> bytes:
    """The serialized program of a rewritten graph at ``inputs``: lifted where it can be, else
    exported (a failure raises InvalidInput starting ``failure``)."""
    lifted = lift_rewritten(module, inputs)
    return serialize(lifted) if lifted is not None else export(module, inputs, failure)


def lift_rewritten(module: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> ExportedProgram | None:
    """``lift`` for a graph whose nodes lost or changed their fake values (tensor parallelism's
    rewrite, which cuts shapes and adds collectives): the values are propagated again on fake
    tensors of ``inputs`` and the module's own (sharded) weights, and Python functions the rewrite
    calls are traced into ATen operations, first (``module`` is changed in place)."""
    try:
        with fake_mode() as mode:
            _FakeValues(module, mode).propagate(*inputs)
            if not _inline_functions(module):
                return None
    except Exception as e:  # let torch.export say what is wrong, if anything is
        log.debug("a sharded stage is exported again: %s: %s", type(e).__name__, e)
        return None
    return lift(module, module.graph, set(module.state_dict(keep_vars=True)))


def _inline_functions(module: fx.GraphModule) -> bool:
    """Each call of a Python function in the graph (the vocabulary-parallel embedding) replaced by
    the ATen operations it runs, traced as export would trace it (pre-dispatch, on the call's fake
    arguments); False, with the graph as it was, where that cannot make every node plain ATen."""
    traced = []
    for node in module.graph.nodes:
        if _plain(node):
            continue
        python_call = node.op == "call_function" and not isinstance(node.target, torch._ops.OperatorBase)
        if not python_call or node.kwargs or any(isinstance(a, (list, tuple, dict)) for a in node.args):
            return False
        operands = list(node.all_input_nodes)

        def call(*values, node=node, operands=operands):
            swap = dict(zip(operands, values))
            return node.target(*[swap.get(a, a) if isinstance(a, fx.Node) else a for a in node.args])

        inner = make_fx(call, pre_dispatch=True)(*[a.meta["val"] for a in operands]).graph
        output = next(n for n in inner.nodes if n.op == "output")
        if not isinstance(output.args[0], fx.Node) or any(
            n.op not in ("placeholder", "output") and (n.op != "call_function" or not _plain(n)) for n in inner.nodes
        ):
            return False  # a captured constant, a submodule, several results: export decides
        traced.append((node, operands, inner, output.args[0]))
    for node, operands, inner, result in traced:
        env = dict(zip((n for n in inner.nodes if n.op == "placeholder"), operands))
        with module.graph.inserting_before(node):
            for n in inner.nodes:
                if n.op == "call_function":
                    env[n] = module.graph.node_copy(n, env.__getitem__)
        node.replace_all_uses_with(env[result])
        module.graph.erase_node(node)
    module.recompile()
    return True


class _FakeValues(FakeTensorProp):
    """Fake values for every node, the weights' included (their fakes, not the real tensors)."""

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        return self._mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value


def _plain(node: fx.Node) -> bool:
    """A node whose meaning does not depend on tracing: an ATen operation that writes none of its
    arguments, or picking one result of a multi-output one."""
    if node.op in ("placeholder", "output", "get_attr"):
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.is_mutable


def _attribute(root: torch.nn.Module, target: str):
    value = root
    for part in target.split("."):
        value = getattr(value, part)
    return value
