"""Whole-model split: one exported model -> per-stage exported programs and the dataflow between
them (docs/architecture.md, "From a model to a plan").

The client exports the whole model once. Here its graph is cut at submodule boundaries: every
compute node belongs to the innermost module that ran it (``nn_module_stack``); nodes are grouped
into *segments*, runs of nodes of one module, starting with the top-level children and going one
level deeper wherever a segment alone costs more than a stage should; contiguous segments form
stages, balanced by cost, or stages start at modules named by the user (as the split spec of
torch.distributed.pipelining). Every value computed in one stage and used by a later one becomes an
edge from its producer to each consumer, so a residual crosses once, not hop by hop. A parameter
used by several stages (tied embeddings) is copied into each and listed as tied.

Each stage then becomes an exported program of its own (built from its nodes where they are plain
ATen operations, controller/compiler/stage_program.py; else exported again), so workers load it as
any other exported program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from atoll.controller.compiler.partition import balanced_partition
from atoll.controller.compiler.program import fake_inputs, fake_mode
from atoll.controller.compiler.stage_program import lift
from atoll.core.dataflow import BATCH, Dataflow, Edge, TiedParameter
from atoll.core.graphs import deserialize, export, graph_module, serialize
from atoll.core.wire import EdgeSpec, TensorSpec
from atoll.errors import InvalidInput

COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True, slots=True)
class SplitStage:
    """One pipeline stage cut from the model: its segments and its exported program."""

    index: int
    """The stage's position in pipeline order (0 reads the batch)."""
    modules: tuple[str, ...]
    """The segments it runs, by module name ("" for the model's own code)."""
    start: str
    """Its first operation as a split point names it exactly: ``"module#k"``, the k-th operation
    the module runs itself (not in a child); "" for stage 0."""
    program: bytes
    """The stage's exported program: flat inputs (its incoming edges) -> flat outputs."""


@dataclass(frozen=True, slots=True)
class SplitModel:
    """What the split pass hands on: the stages and the dataflow that joins them."""

    stages: list[SplitStage]
    """One entry per stage, in pipeline order."""
    dataflow: Dataflow
    """The edges between the stages (and from the batch), with their tensor specs."""


def module_path(node: fx.Node) -> str:
    """The innermost module that ran ``node`` ("" for code of the model's own forward)."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def _prefix(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def _depth(key: str) -> int:
    return len(key.split(".")) if key else 0


@dataclass(slots=True)
class _Segment:
    key: str
    depth: int
    nodes: list[int]
    cost: float


class _FlopsPerNode(fx.Interpreter):
    """Runs the graph on fake tensors, weights included: an in-place op (BatchNorm's running
    statistics) must not touch the real buffers, which go into the stage programs."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode, mode):
        super().__init__(gm)
        self.counter = counter
        self.mode = mode
        self.flops: dict[fx.Node, int] = {}

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        return self.mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    def run_node(self, n: fx.Node):
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        self.flops[n] = self.counter.get_total_flops() - before
        return out


def flops_per_node(gm: fx.GraphModule, make_inputs) -> dict[fx.Node, int]:
    """Each node's forward FLOPs (torch's FlopCounterMode), the graph run on fake tensors from
    ``make_inputs()`` (called inside the fake mode, where it allocates nothing)."""
    with fake_mode() as mode, FlopCounterMode(display=False) as counter, torch.no_grad():
        run = _FlopsPerNode(gm, counter, mode)
        run.run(*make_inputs())
    return run.flops


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


class _ModelGraph:
    """The exported model as a list of compute nodes with their modules, costs and users."""

    def __init__(self, data: bytes, input_spec: EdgeSpec, aliases: dict[str, str]):
        ep = deserialize(data, "model program")
        gm = ep.module()
        for node in list(gm.graph.nodes):  # the exported module's input guard is not model code
            if node.op == "call_module" and str(node.target).startswith("_guards"):
                gm.graph.erase_node(node)
        self.gm = gm
        self.persistent = set(gm.state_dict(keep_vars=True))
        """The buffers the model saves (the others stay out of the stages' state dicts too)."""
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        got = tuple(TensorSpec.of(n.meta["val"]) for n in self.placeholders if _is_tensor(n))
        if len(got) != len(self.placeholders) or got != input_spec.tensors:
            raise InvalidInput(
                f"the model was exported with inputs {got}, but a microbatch of the input is {input_spec}"
            )
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.paths = [module_path(n) for n in self.nodes]
        self._name_tensors(aliases)
        flops = flops_per_node(gm, lambda: fake_inputs(input_spec))
        # cost as the compiler's BlockInfo.cost: forward + backward FLOPs, plus a few optimizer
        # element-wise operations per parameter (charged to the first node using it)
        self.costs = [3.0 * flops.get(n, 0) for n in self.nodes]
        charged: set[str] = set()
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.users and self.canonical(node.target) in self.params:
                name = self.canonical(node.target)
                first = min((self.index[u] for u in node.users if u in self.index), default=None)
                if first is not None and name not in charged:
                    charged.add(name)
                    self.costs[first] += 4.0 * self.params[name].numel()

    def _name_tensors(self, aliases: dict[str, str]) -> None:
        """One name per shared tensor (its first name in the model), so each stage holding it
        names it alike. The client lists the shared names: an exported archive stores each
        name's tensor separately, so sharing cannot be seen here."""
        self.aliases = dict(aliases)
        named = dict(self.gm.named_parameters(remove_duplicate=False))
        for alias, name in self.aliases.items():
            if alias not in named and alias not in dict(self.gm.named_buffers(remove_duplicate=False)):
                raise InvalidInput(f"shared tensor {alias!r} (the same as {name!r}) is not in the exported model")
        self.params = {n: p for n, p in named.items() if n not in self.aliases}

    def canonical(self, target: str) -> str:
        return self.aliases.get(target, target)

    def crossing(self, boundary: int) -> list[fx.Node]:
        """Values computed before node ``boundary`` and used at or after it."""
        out = []
        for node in self.nodes[:boundary]:
            if any(u is self.output or self.index.get(u, -1) >= boundary for u in node.users):
                out.append(node)
        return out

    def cuts_non_tensor(self, boundary: int) -> fx.Node | None:
        return next((n for n in self.crossing(boundary) if not _is_tensor(n)), None)


def _segments(g: _ModelGraph, num_stages: int) -> list[_Segment]:
    """Runs of nodes per module, top-level children first, split deeper where a segment alone
    costs more than a stage's share (or there are fewer segments than stages; then, as a last
    resort, between single operations)."""

    def runs(indices: list[int], depth: int) -> list[_Segment]:
        out: list[_Segment] = []
        for i in indices:
            key = _prefix(g.paths[i], depth)
            if out and out[-1].key == key:
                out[-1].nodes.append(i)
                out[-1].cost += g.costs[i]
            else:
                out.append(_Segment(key, depth, [i], g.costs[i]))
        return out

    segments = runs(list(range(len(g.nodes))), 1)
    share = sum(g.costs) / num_stages
    while True:
        candidates = sorted(
            (s for s in segments if len(runs(s.nodes, s.depth + 1)) > 1), key=lambda s: s.cost, reverse=True
        )
        pick = next((s for s in candidates if s.cost > share or len(segments) < num_stages), None)
        if pick is not None:
            at = segments.index(pick)
            segments[at : at + 1] = runs(pick.nodes, pick.depth + 1)
        elif len(segments) < num_stages:  # too few modules (ops in the model's own forward): cut between ops
            pick = max((s for s in segments if len(s.nodes) > 1), key=lambda s: s.cost)
            at = segments.index(pick)
            segments[at : at + 1] = [_Segment(pick.key, pick.depth, [i], g.costs[i]) for i in pick.nodes]
        else:
            return segments


def _auto_boundaries(g: _ModelGraph, num_stages: int) -> list[int]:
    segments = _segments(g, num_stages)
    # a boundary may only cut tensors: merge segments across any other cut (e.g. a tuple of sizes)
    merged: list[_Segment] = []
    for seg in segments:
        if merged and g.cuts_non_tensor(seg.nodes[0]) is not None:
            merged[-1].nodes += seg.nodes
            merged[-1].cost += seg.cost
            merged[-1].key += f"+{seg.key}"
        else:
            merged.append(_Segment(seg.key, seg.depth, list(seg.nodes), seg.cost))
    ranges = balanced_partition([s.cost for s in merged], num_stages)
    return [merged[r.start].nodes[0] for r in ranges[1:]]


def _named_boundaries(g: _ModelGraph, split_at: list[str], num_stages: int) -> list[int]:
    if len(split_at) != num_stages - 1:
        raise InvalidInput(f"{num_stages} stages need {num_stages - 1} split points, got {len(split_at)}: {split_at}")
    starts = []
    for name in split_at:
        if "#" in name:  # exactly: the k-th operation that module runs itself (SplitStage.start)
            path, _, k = name.rpartition("#")
            own = [i for i, p in enumerate(g.paths) if p == path]
            first = own[int(k)] if k.isdigit() and int(k) < len(own) else None
        else:
            first = next((i for i, p in enumerate(g.paths) if p == name or p.startswith(f"{name}.")), None)
        if first is None:
            known = sorted({_prefix(p, d) for p in g.paths for d in (1, 2)} - {""})
            raise InvalidInput(
                f"split point {name!r} names no module that runs in the model's forward "
                f"(modules include: {', '.join(known[:30])})"
            )
        starts.append(first)
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise InvalidInput(
            f"split points must name modules in the order the forward runs them, each after the first "
            f"module, got {split_at}"
        )
    for name, b in zip(split_at, starts):
        bad = g.cuts_non_tensor(b)
        if bad is not None:
            raise InvalidInput(
                f"split point {name!r} cuts through '{bad.name}', a {type(bad.meta.get('val')).__name__} "
                f"(only tensors can cross stages); choose another module"
            )
    return starts


def split_model(
    data: bytes, input_spec: EdgeSpec, num_stages: int, split_at: list[str], aliases: dict[str, str]
) -> SplitModel:
    """``aliases``: other names of the model's shared tensors -> their first name (from the client)."""
    g = _ModelGraph(data, input_spec, aliases)
    if len(g.nodes) < num_stages:
        raise InvalidInput(f"cannot split a model of {len(g.nodes)} operations into {num_stages} stages")
    if split_at:
        starts = _named_boundaries(g, split_at, num_stages)
    else:
        starts = _auto_boundaries(g, num_stages)
    bounds = [0, *starts, len(g.nodes)]
    stage_index = [s for s, (a, b) in enumerate(zip(bounds, bounds[1:])) for _ in range(a, b)]
    stage_of = dict(zip(g.nodes, stage_index))
    modules = _stage_modules(g, stage_index, num_stages)
    batch_index = {n: i for i, n in enumerate(g.placeholders)}
    last = num_stages - 1

    # what each stage outputs: values used by a later stage; the last stage outputs the model's output
    model_outputs = list(g.output.args[0]) if isinstance(g.output.args[0], (tuple, list)) else [g.output.args[0]]
    outputs: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for node in g.nodes:
        s = stage_of[node]
        if s < last and any(u is g.output or stage_of.get(u, s) > s for u in node.users):
            if not _is_tensor(node):
                raise InvalidInput(f"stage {s} would pass '{node.name}' on, which is not a tensor")
            outputs[s].append(node)
    if not all(isinstance(x, fx.Node) and _is_tensor(x) for x in model_outputs):
        raise InvalidInput("the model must return a tensor or a tuple of tensors (its output feeds the loss)")
    outputs[last] = model_outputs

    stages, edges, used_params = [], [], {}
    for s in range(num_stages):
        graph, env, inputs = fx.Graph(), {}, []

        def value(x: fx.Node, graph=graph, env=env, inputs=inputs, s=s):
            if x not in env:
                if x.op == "get_attr":
                    target = g.canonical(x.target)
                    env[x] = graph.get_attr(target)
                    if target in g.params:
                        used_params.setdefault(target, set()).add(s)
                else:  # computed by an earlier stage, or the batch input: a stage input
                    env[x] = graph.placeholder(x.name)
                    env[x].meta["val"] = x.meta.get("val")
                    inputs.append(x)
            return env[x]

        for node in g.nodes[bounds[s] : bounds[s + 1]]:
            env[node] = graph.node_copy(node, value)
        graph.output(tuple(value(x) for x in outputs[s]))
        stages.append(_export_stage(g, graph, s, [x.meta["val"] for x in inputs], modules[s], _start(g, bounds[s])))
        by_source: dict[int, list[tuple[int, int, fx.Node]]] = {}
        for dst_index, x in enumerate(inputs):
            src = BATCH if x in batch_index else stage_of[x]
            src_index = batch_index[x] if src == BATCH else outputs[src].index(x)
            by_source.setdefault(src, []).append((src_index, dst_index, x))
        for src in sorted(by_source):
            items = by_source[src]
            spec = EdgeSpec(
                f"{'input' if src == BATCH else src}->{s}", tuple(TensorSpec.of(x.meta["val"]) for *_, x in items)
            )
            edges.append(Edge(src, s, tuple(i for i, _, _ in items), tuple(j for _, j, _ in items), spec))
    tied = tuple(
        TiedParameter(name, tuple(sorted(ss)), TensorSpec.of(g.params[name]))
        for name, ss in used_params.items()
        if len(ss) > 1
    )
    return SplitModel(stages, Dataflow(num_stages, tuple(edges), tied))


def _stage_modules(g: _ModelGraph, stage_index: list[int], num_stages: int) -> list[tuple[str, ...]]:
    """The modules each stage runs, coarsest first: top-level names, deeper where a stage cuts one."""
    stages_of: dict[str, set[int]] = {}
    for i, path in enumerate(g.paths):
        for d in range(1, _depth(path) + 1):
            stages_of.setdefault(_prefix(path, d), set()).add(stage_index[i])
    names: list[list[str]] = [[] for _ in range(num_stages)]
    for i, path in enumerate(g.paths):
        depth = 1
        while _depth(path) > depth and len(stages_of[_prefix(path, depth)]) > 1:
            depth += 1
        names[stage_index[i]].append(_prefix(path, depth))
    return [tuple(dict.fromkeys(n)) for n in names]


def _start(g: _ModelGraph, first: int) -> str:
    """The split point naming operation ``first`` exactly (SplitStage.start)."""
    if first == 0:
        return ""
    path = g.paths[first]
    return f"{path}#{sum(1 for p in g.paths[:first] if p == path)}"


def _export_stage(
    g: _ModelGraph, graph: fx.Graph, s: int, input_vals: list, modules: tuple[str, ...], start: str
) -> SplitStage:
    lifted = lift(g.gm, graph, g.persistent)
    if lifted is not None:
        program = serialize(lifted)
    else:  # traced again (controller/compiler/stage_program.py says when)
        module = graph_module(g.gm, graph)  # copies the attributes the graph reads, under their names
        args = tuple(torch.zeros(v.shape, dtype=v.dtype) for v in input_vals)
        program = export(module, args, f"stage {s} ({', '.join(modules)}) could not be exported")
    return SplitStage(s, modules, start, program)
