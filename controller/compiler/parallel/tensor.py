"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) as a compiler pass over one stage's graph.

The pass reads the stage's exported graph and decides, per linear layer, what Megatron decides per
module by hand: a linear whose input is replicated becomes *column-parallel* (each of the T ranks
of the island holds 1/T of its output features), its sharded output is followed through the ops
after it (element-wise ops, reshapes that split features into attention heads, the split of a
fused QKV projection, attention itself), and a linear that takes such a sharded input becomes
*row-parallel* (1/T of its input features; its partial outputs are summed over the island). An
embedding is split by vocabulary rows, and a column-parallel LM head whose vocabulary-sharded
logits leave the last stage is paired with a vocabulary-parallel cross-entropy in the loss.

Any sharded value that reaches an op the pass does not know, or leaves a stage other than as
logits into a cross-entropy, sends the column-parallel layers it came from back to replicated
(the plan lists them with the reason), and the pass runs again. The collectives are custom ops
(atoll.core.collectives), written into each rank's graph: one all-reduce forward per row-parallel
layer (g) and one backward per column-parallel input (f). Each rank's graph is then exported with
its own shards of the weights; the plan lists every collective with its bytes, read from the
exported graphs.
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from atoll.controller.compiler.parallel.graph_ops import ADDMM, LINEAR, SAME_SHAPE, VIEWS, aten
from atoll.controller.compiler.parallel.graph_ops import tensor_value as _val
from atoll.controller.compiler.parallel.sequence import SequencePlan, plan_sequence
from atoll.controller.compiler.split import module_path
from atoll.core import collectives
from atoll.core.graphs import deserialize, export, graph_module
from atoll.core.shards import ParamShard
from atoll.errors import InvalidInput

EMBEDDING = aten.embedding.default
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
CROSS_ENTROPY = aten.cross_entropy_loss.default
SDPA = aten.scaled_dot_product_attention.default
ROLES = ("colwise", "rowwise", "vocab_embedding", "replicate")
_ops = torch.ops.atoll
# per island op: the (direction, "in"/"out") of each collective it runs, as the bytes of its input or
# output tensor; e.g. a reduce-scatter all-reduces its whole input forward and all-gathers its
# output's gradient backward (atoll.core.collectives counts the same tensors as it runs)
COLLECTIVE_OPS = {
    _ops.island_all_reduce.default: (("forward", "in", "all_reduce_sum"),),
    _ops.island_max.default: (("forward", "in", "all_reduce_max"),),
    _ops.island_copy.default: (("backward", "in", "all_reduce_sum"),),
    _ops.island_reduce_scatter.default: (("forward", "in", "reduce_scatter"), ("backward", "out", "all_gather")),
    _ops.island_gather.default: (("forward", "in", "all_gather"), ("backward", "out", "reduce_scatter")),
    _ops.island_gather_whole.default: (("forward", "in", "all_gather"),),
    _ops.island_scatter.default: (("backward", "out", "all_gather"),),
}


@dataclass(frozen=True, slots=True)
class ShardedStage:
    programs: tuple[bytes, ...]
    """Per island rank: the stage's exported program with that rank's shards."""
    params: dict[str, ParamShard]
    """The stage's sharded parameters (the rest are whole on every rank)."""
    modules: dict[str, str]
    """Module -> its role: colwise, rowwise, vocab_embedding, vocab_head, or why it stays replicated."""
    output_dims: dict[int, int]
    """Stage output position -> the dimension it is sharded along (the last stage's logits)."""
    rank_collectives: tuple[dict[str, list[dict]], ...]
    """Per island rank, read off its own program: "forward", "backward" (and "loss_forward" on the
    last stage), each island all-reduce one microbatch runs, in order, with its shape and bytes.
    The simulator checks that the island's ranks meet at each in the same order."""

    @property
    def collectives(self) -> dict[str, list[dict]]:
        return self.rank_collectives[0]

    def bytes(self, direction: str) -> int:
        return sum(c["bytes"] for c in self.collectives.get(direction, ()))


class _Conflict(Exception):
    def __init__(self, origins, reason: str):
        super().__init__(reason)
        self.origins = frozenset(origins)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Shard:
    dim: int
    origins: frozenset


@dataclass(slots=True)
class _Decisions:
    """One pass's result over a graph."""

    place: dict = field(default_factory=dict)
    column: dict = field(default_factory=dict)  # node -> (weight, bias, out dim)
    row: set = field(default_factory=set)
    embedding: set = field(default_factory=set)
    loss: set = field(default_factory=set)
    params: dict = field(default_factory=dict)  # name -> (ParamShard, origins)
    local_args: dict = field(default_factory=dict)  # node -> args rewritten to local sizes
    output_dims: dict = field(default_factory=dict)
    output_origins: frozenset = frozenset()
    replicated: dict = field(default_factory=dict)  # module -> reason


def _shape(node) -> tuple[int, ...]:
    return tuple(_val(node).shape)


def _reads_input(node: fx.Node) -> bool:
    """Whether ``node`` is computed from a stage input: token ids are, positions (an arange) are not;
    a table looked up by positions is small and stays whole, as in Megatron-LM."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _view_dim(shape_in, d: int, shape_out, ranks: int, where: str) -> int | None:
    """The output dimension a reshape carries sharded dimension ``d`` to: the one with the same
    elements before it, whose 1/T holds exactly one rank's contiguous piece."""
    outer = math.prod(shape_in[:d])
    piece = shape_in[d] // ranks * math.prod(shape_in[d + 1 :])
    for e in range(len(shape_out)):
        if math.prod(shape_out[:e]) != outer:
            continue
        if shape_out[e] % ranks == 0 and shape_out[e] // ranks * math.prod(shape_out[e + 1 :]) == piece:
            return e
        if shape_out[e] < shape_in[d] and shape_out[e] > 1 and shape_out[e] % ranks:
            raise InvalidInput(
                f"tensor_parallel={ranks} does not divide the {shape_out[e]} heads that {where} splits its "
                f"sharded features into (a view to {list(shape_out)}); choose a degree that divides the heads"
            )
    return None


class _Pass:
    """One propagation over a graph, in its order; raises _Conflict naming the layers to give up."""

    def __init__(self, gm, ranks: int, excluded: set, plan: dict, initial: dict, outputs_ok: bool, reasons=None):
        self.gm, self.ranks, self.excluded, self.plan = gm, ranks, excluded, plan
        self.excluded_reason = reasons or {}
        self.d = _Decisions()
        self.d.place.update(initial)
        self.outputs_ok = outputs_ok
        self.params = dict(gm.named_parameters())

    def param(self, node) -> str | None:
        if isinstance(node, fx.Node) and node.op == "get_attr" and node.target in self.params:
            return node.target
        return None

    def placed(self, node):
        return self.d.place.get(node) if isinstance(node, fx.Node) else None

    def claim(self, name: str, shard: ParamShard, origins) -> None:
        had = self.d.params.get(name)
        if had is not None and had[0] != shard:
            raise _Conflict(origins | had[1], f"parameter {name} would be cut two ways")
        self.d.params[name] = (shard, frozenset(origins) | (had[1] if had else frozenset()))

    def module_says(self, node) -> str | None:
        return self.plan.get(module_path(node))

    def run(self) -> _Decisions:
        for n in self.gm.graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                self.d.place.setdefault(n, None)
            elif n.op == "output":
                self.output(n)
            else:
                self.d.place[n] = self.node(n)
        self.check_parameter_uses()
        return self.d

    def output(self, n) -> None:
        outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else [n.args[0]]
        for i, x in enumerate(outs):
            s = self.placed(x)
            if s is None:
                continue
            if not self.outputs_ok or s.dim != _val(x).dim() - 1:
                raise _Conflict(s.origins, "its shards would leave the stage")
            self.d.output_dims[i] = s.dim
            self.d.output_origins |= s.origins

    def node(self, n):
        t = n.target
        if t in (LINEAR, ADDMM):
            x, w, b = (n.args[0], n.args[1], n.args[2] if len(n.args) > 2 else None)
            if t is ADDMM:
                b, x, w = n.args[0], n.args[1], n.args[2]
            return self.linear(n, x, w, b)
        if t is EMBEDDING and self.param(n.args[0]) and self.placed(n.args[1]) is None and _reads_input(n.args[1]):
            return self.embedding(n)
        if t is CROSS_ENTROPY:
            return self.cross_entropy(n)
        sharded = [s for a in n.all_input_nodes if isinstance(s := self.placed(a), (_Shard, list))]
        if not sharded:
            return None
        return self.propagate(n, sharded)

    def linear(self, n, x, w, b):
        name = self.param(w)
        sx = self.placed(x)
        role = self.module_says(n)
        if name is None or role == "replicate" or n in self.excluded:
            if sx is not None:
                raise _Conflict(sx.origins, f"'{module_path(n) or n.name}' takes shards but stays replicated")
            if name is not None:
                why = "stated by the plan" if role == "replicate" else self.excluded_reason.get(n, "")
                self.d.replicated[module_path(n) or n.name] = why
            return None
        out_dim, in_dim = (0, 1) if n.target is LINEAR else (1, 0)
        weight = self.params[name]
        bias = self.param(b) if b is not None else None
        if sx is None:  # column-parallel
            features = weight.shape[out_dim]
            if role == "rowwise" or features % self.ranks:
                why = "stated rowwise" if role == "rowwise" else f"{features} output features, not divisible"
                self.d.replicated[module_path(n) or n.name] = why
                return None
            origins = frozenset({n})
            self.claim(name, ParamShard(out_dim, (features,)), origins)
            if bias is not None:
                self.claim(bias, ParamShard(0, (features,)), origins)
            self.d.column[n] = (name, bias, out_dim)
            return _Shard(_val(n).dim() - 1, origins)
        if not isinstance(sx, _Shard) or sx.dim != _val(x).dim() - 1:
            raise _Conflict(getattr(sx, "origins", ()), f"'{module_path(n)}' takes its input sharded along another dim")
        if role == "colwise":
            raise _Conflict(sx.origins, f"'{module_path(n)}' is stated colwise but takes shards")
        self.claim(name, ParamShard(in_dim, (weight.shape[in_dim],)), sx.origins)
        self.d.row.add(n)
        return None

    def embedding(self, n):
        name = self.param(n.args[0])
        rows = self.params[name].shape[0]
        if self.module_says(n) == "replicate" or n in self.excluded or rows % self.ranks:
            why = "stated by the plan" if n not in self.excluded else self.excluded_reason.get(n, "")
            self.d.replicated[module_path(n) or n.name] = why or f"{rows} rows, not divisible"
            return None
        self.claim(name, ParamShard(0, (rows,)), frozenset({n}))
        self.d.embedding.add(n)
        return None

    def cross_entropy(self, n):
        x = n.args[0]
        s = self.placed(x)
        if s is None:
            return None
        args = list(n.args) + [None, 1, -100, 0.0][len(n.args) - 2 :]
        weight, reduction, _ignore, smoothing = args[2:6]
        if _val(x).dim() != 2 or s.dim != 1 or weight is not None or reduction not in (1, 2) or smoothing:
            raise _Conflict(s.origins, "the loss is not a plain cross-entropy over 2-d logits")
        self.d.loss.add(n)
        return None

    def propagate(self, n, sharded):
        t = n.target
        if t is operator.getitem:
            src = self.placed(n.args[0])
            return src[n.args[1]] if isinstance(src, list) else None
        s = sharded[0]
        if isinstance(s, list):
            raise _Conflict(frozenset().union(*(x.origins for x in s)), f"{t} takes a list of shards")
        origins = frozenset().union(*(x.origins for x in sharded))
        x = n.args[0]
        sx = self.placed(x)
        if t in VIEWS and sx is not None:
            e = _view_dim(_shape(x), sx.dim, _shape(n), self.ranks, f"'{module_path(n)}'")
            if e is None:
                raise _Conflict(origins, f"a reshape to {list(_shape(n))} mixes the sharded dimension")
            local = list(_shape(n))
            local[e] //= self.ranks
            self.d.local_args[n] = (n.args[0], local, *n.args[2:])
            return _Shard(e, sx.origins)
        if t is aten.transpose.int and sx is not None:
            rank = _val(x).dim()
            a, b = (n.args[1] % rank, n.args[2] % rank)
            return _Shard(b if sx.dim == a else a if sx.dim == b else sx.dim, sx.origins)
        if t is aten.permute.default and sx is not None:
            return _Shard([p % _val(x).dim() for p in n.args[1]].index(sx.dim), sx.origins)
        if t in SPLITS and sx is not None:
            return self.split(n, sx)
        if t is SDPA:
            return self.attention(n, origins)
        if t in SAME_SHAPE or torch.Tag.pointwise in getattr(t, "tags", ()):
            return self.pointwise(n, origins)
        raise _Conflict(origins, f"{getattr(t, '__name__', t)} is not known to tensor parallelism")

    def split(self, n, sx: _Shard):
        rank = _val(n.args[0]).dim()
        dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % rank
        pieces = [tuple(v.shape) for v in n.meta["val"]]
        if dim != sx.dim:
            return [sx] * len(pieces)
        sizes = [p[dim] for p in pieces]
        (origin,) = sx.origins if len(sx.origins) == 1 else (None,)
        col = self.d.column.get(origin)
        if col is None or any(size % self.ranks for size in sizes):
            raise _Conflict(sx.origins, f"a split into {sizes} along the sharded dimension")
        weight, bias, out_dim = col
        if self.d.params[weight][0].blocks != (sum(sizes),):
            raise _Conflict(sx.origins, "a second split of the same features")
        self.claim_blocks(origin, weight, bias, out_dim, tuple(sizes))
        self.d.local_args[n] = (n.args[0], [size // self.ranks for size in sizes], *n.args[2:])
        return [_Shard(dim, sx.origins)] * len(pieces)

    def claim_blocks(self, origin, weight, bias, out_dim, sizes) -> None:
        self.d.params[weight] = (ParamShard(out_dim, sizes), self.d.params[weight][1])
        if bias is not None:
            self.d.params[bias] = (ParamShard(0, sizes), self.d.params[bias][1])

    def attention(self, n, origins):
        q, k, v = (self.placed(a) for a in n.args[:3])
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        if not (isinstance(q, _Shard) and q == k == v and q.dim == 1 and _val(n.args[0]).dim() == 4):
            raise _Conflict(origins, "attention whose q, k and v are not sharded alike by heads")
        if mask is not None and (self.placed(mask) is not None or _val(mask).dim() == 4 and _val(mask).shape[1] != 1):
            raise _Conflict(origins, "an attention mask per head")
        return _Shard(1, origins)

    def pointwise(self, n, origins):
        out = _val(n)
        if out is None:  # e.g. an assertion on the tensor's metadata
            return None
        dims = set()
        for a in n.all_input_nodes:
            s, v = self.placed(a), _val(a)
            if v is None:
                continue
            lead = out.dim() - v.dim()
            if s is not None:
                dims.add(s.dim + lead)
        if len(dims) != 1:
            raise _Conflict(origins, f"an element-wise {n.target} mixes shards")
        (dim,) = dims
        for a in n.all_input_nodes:  # a replicated operand may only broadcast along the sharded dim
            v = _val(a)
            if self.placed(a) is None and v is not None and dim - (out.dim() - v.dim()) >= 0:
                if v.shape[dim - (out.dim() - v.dim())] != 1:
                    raise _Conflict(origins, f"an element-wise {n.target} with a whole (replicated) operand")
        return _Shard(dim, origins)

    def check_parameter_uses(self) -> None:
        """A cut parameter may only be read by the layers that cut it."""
        users = self.d.row | set(self.d.column) | self.d.embedding
        for node in self.gm.graph.nodes:
            if node.op == "get_attr" and node.target in self.d.params:
                for u in node.users:
                    if u not in users:
                        raise _Conflict(self.d.params[node.target][1], f"{node.target} is also read whole")


def _graph_module(data: bytes, what: str) -> fx.GraphModule:
    gm = deserialize(data, what).module()
    for node in list(gm.graph.nodes):  # the exported module's input guard is not model code
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            gm.graph.erase_node(node)
    return gm


def _decide(gm, ranks, plan, initial, outputs_ok, excluded: set, reasons: dict) -> _Decisions:
    while True:
        p = _Pass(gm, ranks, excluded, plan, initial, outputs_ok, reasons)
        try:
            return p.run()
        except _Conflict as c:
            if not c.origins or c.origins <= excluded:
                raise InvalidInput(f"tensor parallelism cannot shard this graph: {c.reason}") from None
            for o in c.origins:
                reasons[o] = c.reason
            excluded |= c.origins


def _rewrite(
    gm: fx.GraphModule, d: _Decisions, rank: int, ranks: int, sp: SequencePlan | None = None
) -> fx.GraphModule:
    graph, env, done = fx.Graph(), {}, {}
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # the program's input and output structure
    call = graph.call_function
    atoll_ops = torch.ops.atoll

    def through(n, x, how, dim=1):
        """``x`` as consumer ``n`` reads it: through one collective (once per value and kind)."""
        key = (x, how, dim)
        if key not in done:
            value = env[x]
            if how in ("grad_sum", "copy"):
                out = call(atoll_ops.island_copy.default, (value,))
            elif how == "all_reduce":
                out = call(atoll_ops.island_all_reduce.default, (value,))
            elif how == "scatter":
                out = call(atoll_ops.island_scatter.default, (value, dim, ranks))
            elif how == "reduce_scatter":
                out = env[x] = call(atoll_ops.island_reduce_scatter.default, (value, dim, ranks))
            else:  # gather, gather_whole: a [B * S, H] slice travels as [B, S, H]
                op = getattr(atoll_ops, "island_" + how).default
                (batch, seq), flat = sp.tokens[x], _val(x).dim() == 2
                hidden = _val(x).shape[-1]
                if flat:
                    value = call(aten.view.default, (value, [batch, seq // ranks, hidden]))
                out = call(op, (value, 1, ranks))
                if flat:
                    out = call(aten.view.default, (out, [batch * seq, hidden]))
            done[key] = out
        return done[key]

    def reads(n):
        uses = sp.uses.get(n, {}) if sp is not None else {}
        return lambda x: through(n, x, *uses[x]) if x in uses else env[x]

    for n in gm.graph.nodes:
        args = reads(n)
        if n in d.column:
            x = n.args[1] if n.target is ADDMM else n.args[0]
            # Megatron's f (or, sequence-parallel, the all-gather), once per input for every layer reading it
            xin = args(x) if sp is not None and x in sp.tokens else through(n, x, "copy")
            new_args = list(fx.map_arg(n.args, args))
            new_args[1 if n.target is ADDMM else 0] = xin
            env[n] = call(n.target, tuple(new_args), fx.map_arg(n.kwargs, args))
        elif n in d.row:
            if n.target is LINEAR:
                x, w, b = n.args[0], n.args[1], n.args[2] if len(n.args) > 2 else None
                partial = call(LINEAR, (env[x], env[w]))
            else:
                b, x, w = n.args
                partial = call(aten.mm.default, (env[x], env[w]))
            if sp is None:
                out = call(atoll_ops.island_all_reduce.default, (partial,))
                env[n] = call(aten.add.Tensor, (out, env[b])) if b is not None else out
            elif b is None:
                env[n] = partial
            else:  # the sum stays partial until reduce-scattered: rank 0 alone adds the bias
                bias = call(aten.mul.Tensor, (through(n, b, "grad_sum"), 1.0 if rank == 0 else 0.0))
                env[n] = call(aten.add.Tensor, (partial, bias))
        elif n in d.embedding:
            rows = gm.get_parameter(n.args[0].target).shape[0] // ranks
            env[n] = call(
                collectives.vocab_parallel_embedding, (env[n.args[0]], env[n.args[1]], rank * rows, sp is None)
            )
        elif n in d.loss:
            vocab = _val(n.args[0]).shape[1] // ranks
            a = list(n.args) + [None, 1, -100, 0.0][len(n.args) - 2 :]
            env[n] = call(collectives.vocab_parallel_cross_entropy, (env[a[0]], env[a[1]], rank * vocab, a[4], a[3]))
        elif n in d.local_args:  # sizes along the sharded dimension, divided by the ranks
            target = aten.split_with_sizes.default if n.target in SPLITS else n.target
            env[n] = call(target, tuple(fx.map_arg(d.local_args[n], args)), fx.map_arg(n.kwargs, args))
        elif sp is not None and n in sp.local_args:  # a reshape of a sequence slice
            env[n] = call(n.target, tuple(fx.map_arg(sp.local_args[n], args)), fx.map_arg(n.kwargs, args))
        else:
            env[n] = graph.node_copy(n, args)
            if sp is not None and n in sp.entry:  # a stage input: this rank's slice of the sequence
                env[n] = call(atoll_ops.island_scatter.default, (env[n], 1, ranks))
    module = graph_module(gm, graph)
    for name, (shard, _) in d.params.items():
        owner, _, leaf = name.rpartition(".")
        full = gm.get_parameter(name)
        piece = torch.nn.Parameter(shard.local(full.detach(), rank, ranks), requires_grad=full.requires_grad)
        setattr(module.get_submodule(owner) if owner else module, leaf, piece)
    return module


def _collectives(data: bytes) -> dict[str, list[dict]]:
    out = {"forward": [], "backward": []}
    for node in deserialize(data, "sharded program").graph.nodes:
        for direction, side, op in COLLECTIVE_OPS.get(node.target, ()):
            v = node.meta["val"] if side == "out" else node.args[0].meta["val"]
            out[direction].append({"op": op, "shape": list(v.shape), "bytes": v.numel() * v.element_size()})
    out["backward"].reverse()  # backward runs them last to first
    return out


def shard_stage(
    data: bytes,
    index: int,
    ranks: int,
    plan: dict,
    inputs: list,
    is_last: bool,
    loss: bytes,
    target_spec,
    sequence_parallel: bool = False,
) -> tuple[ShardedStage, tuple[bytes, ...] | None]:
    """Shard stage ``index`` over ``ranks`` (and its token-wise code along the sequence, with
    ``sequence_parallel``); for the last stage, also its loss (per-rank loss programs, or None
    when the logits stay whole). ``inputs``: example input tensors."""
    gm = _graph_module(data, f"stage {index} program")
    unknown = [m for m, role in plan.items() if role not in ROLES]
    if unknown:
        raise InvalidInput(f"tensor_parallel_plan: unknown role for {unknown} (known: {', '.join(ROLES)})")
    excluded, reasons = set(), {}
    while True:
        d = _decide(gm, ranks, plan, {}, is_last, excluded, reasons)
        loss_programs = None
        if not d.output_dims:
            break
        lgm = _graph_module(loss, "loss program")
        holders = [n for n in lgm.graph.nodes if n.op == "placeholder"]
        if len(holders) == len(d.output_dims) + len(target_spec.tensors) == 2:
            try:
                initial = {holders[0]: _Shard(d.output_dims[0], d.output_origins)}
                ld = _Pass(lgm, ranks, set(), {}, initial, False).run()
                if ld.loss:
                    loss_programs = ld
                    break
                reason = "the loss takes the logits whole"
            except _Conflict as c:
                reason = c.reason
        else:
            reason = "the loss takes more than logits and a target"
        for o in d.output_origins:
            reasons[o] = f"its vocabulary shards cannot enter the loss: {reason}"
        excluded |= d.output_origins
    if not d.column and not d.embedding:
        reasons_shown = (
            "; ".join(f"{m}: {r}" for m, r in d.replicated.items()) or "it has no linear layers or embeddings"
        )
        raise InvalidInput(
            f"stage {index} is too small to shard over tensor_parallel={ranks}: nothing in it can be split "
            f"({reasons_shown})"
        )
    here = {module_path(n) for n in gm.graph.nodes}
    found = {"colwise": d.column, "rowwise": d.row, "vocab_embedding": d.embedding}
    for module, role in plan.items():
        if module in here and role in found and module not in {module_path(n) for n in found[role]}:
            why = d.replicated.get(module, "the compiler finds another role for it")
            raise InvalidInput(f"tensor_parallel_plan says {module!r} is {role}, but it cannot be: {why}")
    sp = None
    if sequence_parallel:
        sharded = {n for n, s in d.place.items() if isinstance(s, (_Shard, list))}
        sp = plan_sequence(gm, ranks, set(d.column), d.row, d.embedding, sharded)
    programs, loss_out = [], []
    for t in range(ranks):
        local_inputs = tuple(inputs)
        module = _rewrite(gm, d, t, ranks, sp)
        programs.append(
            export(module, local_inputs, f"stage {index} (rank {t} of its island) could not be exported after sharding")
        )
        if loss_programs is not None:
            out_local = _val(next(n for n in lgm.graph.nodes if n.op == "placeholder"))
            shape = list(out_local.shape)
            shape[d.output_dims[0]] //= ranks
            args = (torch.zeros(shape, dtype=out_local.dtype), *(s.empty("cpu").zero_() for s in target_spec.tensors))
            loss_out.append(
                export(
                    _rewrite(lgm, loss_programs, t, ranks),
                    args,
                    f"the loss (rank {t}) could not be exported after sharding",
                )
            )
    roles = dict(d.replicated)
    roles.update({module_path(n) or n.name: "colwise" for n in d.column})
    roles.update({module_path(n) or n.name: "vocab_head" for n in d.output_origins})
    roles.update({module_path(n) or n.name: "rowwise" for n in d.row})
    roles.update({module_path(n) or n.name: "vocab_embedding" for n in d.embedding})
    per_rank = []
    for t in range(ranks):
        found = _collectives(programs[t])
        if loss_out:
            found["loss_forward"] = _collectives(loss_out[t])["forward"]
        per_rank.append(found)
    stage = ShardedStage(
        programs=tuple(programs),
        params={name: shard for name, (shard, _) in d.params.items()},
        modules=roles,
        output_dims=dict(d.output_dims),
        rank_collectives=tuple(per_rank),
    )
    return stage, tuple(loss_out) if loss_out else None
