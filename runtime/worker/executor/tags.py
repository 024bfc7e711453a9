"""Data-plane tags: every tensor a step moves between two ranks has its own, known to both ends
from the plan alone, so a receive can be posted before its sender has run."""

FORWARD_DIRECTION, BACKWARD_DIRECTION = 0, 1
MAX_TENSORS_PER_EDGE = 64
MAX_RANKS = 4096


def edge_tag(edge: int, microbatch: int, microbatches: int, direction: int, index: int) -> int:
    """Unique data-plane tag of the ``index``-th tensor of dataflow edge ``edge`` (its position in
    ``Dataflow.edges``) for one microbatch and direction."""
    return ((edge * microbatches + microbatch) * 2 + direction) * MAX_TENSORS_PER_EDGE + index


def tied_tag(num_edges: int, microbatches: int, group: int, sender: int) -> int:
    """Tag of one rank's gradient of one tied parameter; above every edge tag of the job."""
    return edge_tag(num_edges, 0, microbatches, 0, 0) + group * MAX_RANKS + sender
