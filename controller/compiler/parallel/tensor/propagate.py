"""Sharding propagation: which layer of one graph is cut how, found by following each sharded value
through the ops after it, in graph order.

A linear whose input is replicated becomes column-parallel, one whose input is sharded along its
features row-parallel; an embedding looked up by token ids is split by vocabulary rows; a plain
cross-entropy over vocabulary-sharded logits is marked for the vocabulary-parallel loss. A sharded
value reaching anything the pass does not know raises ``Conflict`` naming the column-parallel
layers it came from; ``decide`` sends those back to replicated and runs the pass again.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from atoll.controller.compiler.parallel.graph_ops import ADDMM, LINEAR, SAME_SHAPE, VIEWS, aten
from atoll.controller.compiler.parallel.graph_ops import tensor_value as _val
from atoll.controller.compiler.split import module_path
from atoll.core.graphs import deserialize
from atoll.core.shards import ParamShard
from atoll.errors import InvalidInput

EMBEDDING = aten.embedding.default
CHUNK = aten.chunk.default
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, CHUNK}
CROSS_ENTROPY = aten.cross_entropy_loss.default
SDPA = aten.scaled_dot_product_attention.default
SLICE = aten.slice.Tensor
UNSQUEEZE = aten.unsqueeze.default
EXPAND = aten.expand.default
CAT = aten.cat.default


class Conflict(Exception):
    """A sharded value the pass cannot follow; ``origins``: the column-parallel layers to give up."""

    def __init__(self, origins, reason: str):
        super().__init__(reason)
        self.origins = frozenset(origins)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int
    origins: frozenset


@dataclass(slots=True)
class Decisions:
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


def load_graph(data: bytes, what: str) -> fx.GraphModule:
    """An exported program's graph module, as the pass reads it."""
    gm = deserialize(data, what).module()
    for node in list(gm.graph.nodes):  # the exported module's input guard is not model code
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            gm.graph.erase_node(node)
    return gm


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


class Pass:
    """One propagation over a graph, in its order; raises Conflict naming the layers to give up."""

    def __init__(self, gm, ranks: int, excluded: set, plan: dict, initial: dict, outputs_ok: bool, reasons=None):
        self.gm, self.ranks, self.excluded, self.plan = gm, ranks, excluded, plan
        self.excluded_reason = reasons or {}
        self.d = Decisions()
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
            raise Conflict(origins | had[1], f"parameter {name} would be cut two ways")
        self.d.params[name] = (shard, frozenset(origins) | (had[1] if had else frozenset()))

    def module_says(self, node) -> str | None:
        return self.plan.get(module_path(node))

    def run(self) -> Decisions:
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
                raise Conflict(s.origins, "its shards would leave the stage")
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
        sharded = [s for a in n.all_input_nodes if isinstance(s := self.placed(a), (Shard, list))]
        if not sharded:
            return None
        return self.propagate(n, sharded)

    def linear(self, n, x, w, b):
        name = self.param(w)
        sx = self.placed(x)
        role = self.module_says(n)
        if name is None or role == "replicate" or n in self.excluded:
            if sx is not None:
                raise Conflict(sx.origins, f"'{module_path(n) or n.name}' takes shards but stays replicated")
            if name is not None:
                why = "stated by the plan" if role == "replicate" else self.excluded_reason.get(n, "")
                self.d.replicated[module_path(n) or n.name] = why
            return None
        out_dim, in_dim = (0, 1) if n.target is LINEAR else (1, 0)
        weight = self.params[name]
        bias = self.param(b) if b is not None else None
        if sx is None:  # column-parallel
            features = weight.shape[out_dim]
            if role in ("rowwise", "rowwise_if_sharded") or features % self.ranks:
                stated = role in ("rowwise", "rowwise_if_sharded")
                why = f"stated {role}" if stated else f"{features} output features, not divisible"
                self.d.replicated[module_path(n) or n.name] = why
                return None
            origins = frozenset({n})
            self.claim(name, ParamShard(out_dim, (features,)), origins)
            if bias is not None:
                self.claim(bias, ParamShard(0, (features,)), origins)
            self.d.column[n] = (name, bias, out_dim)
            return Shard(_val(n).dim() - 1, origins)
        if not isinstance(sx, Shard) or sx.dim != _val(x).dim() - 1:
            raise Conflict(getattr(sx, "origins", ()), f"'{module_path(n)}' takes its input sharded along another dim")
        if role == "colwise":
            raise Conflict(sx.origins, f"'{module_path(n)}' is stated colwise but takes shards")
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
            raise Conflict(s.origins, "the loss is not a plain cross-entropy over 2-d logits")
        self.d.loss.add(n)
        return None

    def propagate(self, n, sharded):
        t = n.target
        if t is operator.getitem:
            src = self.placed(n.args[0])
            return src[n.args[1]] if isinstance(src, list) else None
        s = sharded[0]
        if isinstance(s, list):
            raise Conflict(frozenset().union(*(x.origins for x in s)), f"{t} takes a list of shards")
        origins = frozenset().union(*(x.origins for x in sharded))
        if t is CAT:
            return self.cat(n, origins)
        x = n.args[0]
        sx = self.placed(x)
        if t in VIEWS and sx is not None:
            e = _view_dim(_shape(x), sx.dim, _shape(n), self.ranks, f"'{module_path(n)}'")
            if e is None:
                raise Conflict(origins, f"a reshape to {list(_shape(n))} mixes the sharded dimension")
            local = list(_shape(n))
            local[e] //= self.ranks
            self.d.local_args[n] = (n.args[0], local, *n.args[2:])
            return Shard(e, sx.origins)
        if t is aten.transpose.int and sx is not None:
            rank = _val(x).dim()
            a, b = (n.args[1] % rank, n.args[2] % rank)
            return Shard(b if sx.dim == a else a if sx.dim == b else sx.dim, sx.origins)
        if t is aten.permute.default and sx is not None:
            return Shard([p % _val(x).dim() for p in n.args[1]].index(sx.dim), sx.origins)
        if t in SPLITS and sx is not None:
            return self.split(n, sx)
        if t is SLICE and sx is not None:
            return self.slice(n, sx)
        if t is UNSQUEEZE and sx is not None:
            at = n.args[1] % _val(n).dim()  # the new dimension's place in the output
            return Shard(sx.dim + (at <= sx.dim), sx.origins)
        if t is EXPAND and sx is not None:
            return self.expand(n, sx)
        if t is SDPA:
            return self.attention(n, origins)
        if t in SAME_SHAPE or torch.Tag.pointwise in getattr(t, "tags", ()):
            return self.pointwise(n, origins)
        raise Conflict(origins, f"{getattr(t, '__name__', t)} is not known to tensor parallelism")

    def split(self, n, sx: Shard):
        rank = _val(n.args[0]).dim()
        dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % rank
        pieces = [tuple(v.shape) for v in n.meta["val"]]
        if dim != sx.dim:
            return [sx] * len(pieces)
        sizes = [p[dim] for p in pieces]
        (origin,) = sx.origins if len(sx.origins) == 1 else (None,)
        col = self.d.column.get(origin)
        if col is None or any(size % self.ranks for size in sizes):
            raise Conflict(sx.origins, f"a split into {sizes} along the sharded dimension")
        weight, bias, out_dim = col
        if self.d.params[weight][0].blocks != (sum(sizes),):
            raise Conflict(sx.origins, "a second split of the same features")
        self.claim_blocks(origin, weight, bias, out_dim, tuple(sizes))
        if n.target is not CHUNK:  # a chunk of this rank's features into as many pieces is already local
            self.d.local_args[n] = (n.args[0], [size // self.ranks for size in sizes], *n.args[2:])
        return [Shard(dim, sx.origins)] * len(pieces)

    def slice(self, n, sx: Shard):
        """Rotary's halves of each head (``x[..., :d/2]``): a slice along another dimension keeps
        the shards; along the sharded one, only a slice that keeps it whole does."""
        x = n.args[0]
        dim = (n.args[1] if len(n.args) > 1 else 0) % _val(x).dim()
        if dim != sx.dim or _shape(n)[dim] == _shape(x)[dim]:
            return Shard(sx.dim, sx.origins)
        raise Conflict(sx.origins, f"a slice of the sharded dimension (to {_shape(n)[dim]} of {_shape(x)[dim]})")

    def expand(self, n, sx: Shard):
        """Grouped-query attention's ``repeat_kv``: key/value heads expanded along a new dimension;
        the sizes are global, this rank's heads are 1/T of them."""
        lead = _val(n).dim() - _val(n.args[0]).dim()
        dim = sx.dim + lead
        sizes = list(n.args[1])
        if sizes[dim] != -1:
            sizes[dim] //= self.ranks
        self.d.local_args[n] = (n.args[0], sizes, *n.args[2:])
        return Shard(dim, sx.origins)

    def cat(self, n, origins):
        """Rotary's ``cat((-x2, x1), dim=-1)``: pieces sharded alike, joined along another dimension."""
        pieces = n.args[0]
        rank = _val(n).dim()
        dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % rank
        placed = [self.placed(p) for p in pieces]
        dims = {p.dim for p in placed if isinstance(p, Shard)}
        if len(dims) != 1 or None in placed or not all(isinstance(p, Shard) for p in placed) or dims == {dim}:
            raise Conflict(origins, "a concatenation of pieces not all sharded alike, or along the sharded dimension")
        return Shard(dims.pop(), origins)

    def claim_blocks(self, origin, weight, bias, out_dim, sizes) -> None:
        self.d.params[weight] = (ParamShard(out_dim, sizes), self.d.params[weight][1])
        if bias is not None:
            self.d.params[bias] = (ParamShard(0, sizes), self.d.params[bias][1])

    def attention(self, n, origins):
        q, k, v = (self.placed(a) for a in n.args[:3])
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        by_heads = all(isinstance(s, Shard) and s.dim == 1 for s in (q, k, v))  # from one projection or three
        if not (by_heads and _val(n.args[0]).dim() == 4):
            raise Conflict(origins, "attention whose q, k and v are not sharded alike by heads")
        if mask is not None and (self.placed(mask) is not None or _val(mask).dim() == 4 and _val(mask).shape[1] != 1):
            raise Conflict(origins, "an attention mask per head")
        return Shard(1, origins)

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
            raise Conflict(origins, f"an element-wise {n.target} mixes shards")
        (dim,) = dims
        for a in n.all_input_nodes:  # a replicated operand may only broadcast along the sharded dim
            v = _val(a)
            if self.placed(a) is None and v is not None and dim - (out.dim() - v.dim()) >= 0:
                if v.shape[dim - (out.dim() - v.dim())] != 1:
                    raise Conflict(origins, f"an element-wise {n.target} with a whole (replicated) operand")
        return Shard(dim, origins)

    def check_parameter_uses(self) -> None:
        """A cut parameter may only be read by the layers that cut it."""
        users = self.d.row | set(self.d.column) | self.d.embedding
        for node in self.gm.graph.nodes:
            if node.op == "get_attr" and node.target in self.d.params:
                for u in node.users:
                    if u not in users:
                        raise Conflict(self.d.params[node.target][1], f"{node.target} is also read whole")


def decide(gm, ranks, plan, initial, outputs_ok, excluded: set, reasons: dict) -> Decisions:
    """Run the pass until it meets no conflict, each time giving up the layers the last one named
    (``excluded``, with ``reasons`` for the plan); a conflict naming none new cannot be resolved."""
    while True:
        p = Pass(gm, ranks, excluded, plan, initial, outputs_ok, reasons)
        try:
            return p.run()
        except Conflict as c:
            if not c.origins or c.origins <= excluded:
                raise InvalidInput(f"tensor parallelism cannot shard this graph: {c.reason}") from None
            for o in c.origins:
                reasons[o] = c.reason
            excluded |= c.origins
