"""The one list of each kind of name a setting takes. The compiler, the worker, the CLI and the docs
read these; nothing is imported here, so the CLI's parser can use them and stay light."""

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev")
"""Pipeline schedules (controller/compiler/schedules.py builds one per name)."""
SPLIT_BACKWARD_SCHEDULES = ("zb_h1", "zb_h2", "zbv", "dualpipev")
"""The schedules that split backwards into their input- and weight-gradient halves."""
V_SCHEDULES = ("zbv", "dualpipev")
"""The schedules that place two chunks per rank in a V (rank r: stages r and 2 * ranks - 1 - r)."""
AUTO_CANDIDATES = {1: ("1f1b", "zb_h1", "zb_h2", "gpipe"), 2: ("zbv", "dualpipev", "interleaved_1f1b")}
"""schedule="auto" picks among the schedules that run the job's ``virtual_stages`` chunks per
worker; of two predicted equally fast, the one listed first (1F1B and ZB-H1 stash fewer
microbatches than ZB-H2 and GPipe)."""
STEP_OVERHEAD_COST = "step_overhead_s"
"""In ``JobConfig.schedule_costs``, beside the per-action seconds: what a step costs beyond its
simulated actions (the control path, measured at calibration), added to the candidate's step."""
STEP_BACK_TO_BACK_OVERHEAD_COST = "step_back_to_back_overhead_s"
"""Beside it: what a step sent together with others costs beyond its simulation back to back
(measured at calibration, atoll.client.calibrate.back_to_back), added to the candidate's step back
to back. Without it, that step carries the whole ``STEP_OVERHEAD_COST``."""
SCHEDULE_COST_SEPARATOR = "/"
"""In ``JobConfig.schedule_costs``, "gpipe/0F": a cost measured under that schedule, used for it
before the unnamed "0F" (atoll.client.calibrate)."""
SCHEDULE_CHOICES = (*SCHEDULES, "auto")
"""What a job's ``schedule`` setting takes."""
DISPATCH_MODES = ("parallel", "direct", "relay", "sequential")
DEVICE_KINDS = ("cpu", "cuda")
TRANSPORTS = ("socket", "gloo", "cuda_ipc", "nccl")
""""auto" aside: each edge's transport follows from placement (controller/cluster/transports.py)."""
STEP_MODES = ("train", "evaluate", "forward")
"""What a step runs of the plan's action list: training runs all of it; evaluation and inference
run the kinds declared ``forward_only`` alone (the same order and buffers, no backward, no update)."""
