"""The one list of each kind of name a setting takes. The compiler, the worker, the CLI and the docs
read these; nothing is imported here, so the CLI's parser can use them and stay light."""

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
"""Pipeline schedules (controller/compiler/schedules.py builds one per name)."""
SPLIT_BACKWARD_SCHEDULES = ("zb_h1", "zbv")
"""The schedules that split each backward into its input- and weight-gradient halves."""
DISPATCH_MODES = ("parallel", "direct", "relay", "sequential")
DEVICE_KINDS = ("cpu", "cuda")
TRANSPORTS = ("gloo", "cuda_ipc", "nccl")
""""auto" aside: each edge's transport follows from placement (controller/cluster/transports.py)."""
STEP_MODES = ("train", "evaluate", "forward")
"""What a step runs of the plan's action list: training runs all of it; evaluation and inference
run the kinds declared ``forward_only`` alone (the same order and buffers, no backward, no update)."""
