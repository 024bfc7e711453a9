"""The speed-ups of torch.export's archives (runtime/core/export_serde.py, graphs.export) change no
byte torch writes with the same options (no stack traces, no checksums) and nothing a program
computes."""

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.fx.config

from atoll.core import graphs
from tests import models

ROOT = Path(__file__).resolve().parent.parent

_PLAIN_TORCH = """
import io, sys, torch
sys.path.insert(0, {root!r})
from tests import models
model, batches, _ = models.transformer()
import torch.fx.config
torch.fx.config.do_not_emit_stack_traces = True  # as atoll's export: its only other differences
torch.serialization.set_crc32_options(False)  # and no checksums (graphs.serialize)
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
    if hasattr(torch.fx.config, "do_not_emit_stack_traces"):  # torch 2.11 records them always
        assert all("stack_trace" not in n.meta for n in ep.graph.nodes)
    with torch.no_grad():
        assert torch.equal(ep.module()(x), model(x))
    again = graphs.deserialize(graphs.serialize(ep), "again")  # a second round trip: same graph
    assert str(again.graph) == str(ep.graph)


@pytest.mark.parametrize("make", [models.transformer, models.skip_net, models.tied_lm, models.fused_gate_up])
def test_the_planned_schema_converter_builds_what_torchs_own_builds(make):
    """runtime/core/schema_loader.py against torch's ``_dict_to_dataclass``, on the JSON of whole
    archives: equal dataclasses (unions compare by tag and value, the rest field by field), the
    same tags, and the program loads to the same graph with either."""
    from torch._export.serde import schema
    from torch._export.serde import serialize as serde

    from atoll.core import export_serde

    model, batches, _ = make()
    data = graphs.export(model, (batches[0][0],), "the test model")
    export_serde.apply()
    torchs = export_serde.torch_dict_to_dataclass
    assert torchs is not None and serde._dict_to_dataclass is not torchs  # this torch has what it needs
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        program = json.loads(archive.read("archive/models/model.json"))
    ours, theirs = serde._dict_to_dataclass(schema.ExportedProgram, program), torchs(schema.ExportedProgram, program)
    assert ours == theirs and repr(ours) == repr(theirs)
    tags = lambda p: [(n.target, [a.arg.type for a in n.inputs]) for n in p.graph_module.graph.nodes]  # noqa: E731
    assert tags(ours) == tags(theirs)
    planned, converter = str(graphs.deserialize(data, "planned").graph), serde._dict_to_dataclass
    serde._dict_to_dataclass = torchs
    try:
        assert str(graphs.deserialize(data, "torch's").graph) == planned
    finally:
        serde._dict_to_dataclass = converter
