"""The graph rewrite: one island rank's copy of a stage (or loss) graph from the pass's decisions,
with the collectives written in and that rank's shards of the weights in place of the whole ones.

Per column-parallel layer its input goes through Megatron's f (island_copy: identity forward,
all-reduce backward), per row-parallel layer its partial output through g (island_all_reduce);
with sequence parallelism (atoll.controller.compiler.parallel.sequence) those become the
all-gather and reduce-scatter of the sequence slices.
"""

from __future__ import annotations

import copy

import torch
from torch import fx

from atoll.controller.compiler.parallel.graph_ops import ADDMM, LINEAR, aten
from atoll.controller.compiler.parallel.graph_ops import tensor_value as _val
from atoll.controller.compiler.parallel.sequence import SequencePlan
from atoll.controller.compiler.parallel.tensor.propagate import SPLITS, Decisions
from atoll.core import collectives
from atoll.core.graphs import graph_module


def rewrite(gm: fx.GraphModule, d: Decisions, rank: int, ranks: int, sp: SequencePlan | None = None) -> fx.GraphModule:
    """Island rank ``rank`` of ``ranks``: ``gm`` as decided by ``d`` (and, sequence-parallel, ``sp``)."""
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
