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

The modules, in the order the pass runs them (stage.py drives them for one stage):
propagate.py decides what is cut how, loss.py pairs sharded logits with the loss, rewrite.py writes
each rank's graph, inventory.py lists what was cut and the collectives each rank's program runs.
"""

from atoll.controller.compiler.parallel.tensor.inventory import COLLECTIVE_OPS, ROLES, ShardedStage
from atoll.controller.compiler.parallel.tensor.stage import shard_stage

__all__ = ["COLLECTIVE_OPS", "ROLES", "ShardedStage", "shard_stage"]
