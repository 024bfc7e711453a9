"""The speed-ups of torch.export's archives (runtime/core/export_serde.py, graphs.export) change no
byte torch writes and nothing a program computes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atoll.core import graphs
from tests import models

ROOT = Path(__file__).resolve().parent.parent

_PLAIN_TORCH = """
import io, sys, torch
sys.path.insert(0, {root!r})
from tests import models
model, batches, _ = models.transformer()
import torch.fx.config
torch.fx.config.do_not_emit_stack_traces = True  # as atoll's export: its only other difference
ep = torch.export.export(model, (batches[0][0],))
buf = io.BytesIO()
torch.export.save(ep, buf)
sys.stdout.buffer.write(buf.getvalue())
"""


@pytest.mark.cluster  # a plain torch process writes the reference archive
def test_archives_are_what_plain_torch_writes_and_load_to_the_same_program():
    model, batches, _ = models.transformer()
    x = batches[0][0]
    data = graphs.export(model, (x,), "the test model")
    plain = subprocess.run(
        [sys.executable, "-c", _PLAIN_TORCH.format(root=str(ROOT))], capture_output=True, timeout=120, check=True
    ).stdout
    assert data == plain  # no atoll patch in that process: same bytes
    ep = graphs.deserialize(data, "the test model")
    assert all("stack_trace" not in n.meta for n in ep.graph.nodes)
    with torch.no_grad():
        assert torch.equal(ep.module()(x), model(x))
    again = graphs.deserialize(graphs.serialize(ep), "again")  # a second round trip: same graph
    assert str(again.graph) == str(ep.graph)
