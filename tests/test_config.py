"""The job configuration crosses client -> controller -> worker as one typed structure."""

import dataclasses

import pytest

from atoll._rpc import atoll_pb2 as pb
from atoll.core.config import JobConfig
from atoll.errors import InvalidInput


def test_every_setting_survives_the_wire():
    config = JobConfig(
        stages=3,
        microbatches=8,
        schedule="interleaved_1f1b",
        virtual_stages=2,
        optimizer="adamw",
        optimizer_args={"lr": 0.001, "betas": [0.9, 0.95], "amsgrad": True},
        split_at=("blocks.2", "blocks.4"),
        rematerialize=True,
        data_plane_timeout_s=12.5,
        device="cuda",
        transport="nccl",
        name="run-1",
    )
    assert JobConfig.from_pb(pb.JobConfig.FromString(config.to_pb().SerializeToString())) == config
    auto = JobConfig(
        stages=2,
        microbatches=4,
        schedule="auto",
        auto_microbatches=(2, 8),
        auto_virtual_stages=(2,),
        layout_steps={"2x1": 0.5, "4x2": 0.25},
    )
    assert JobConfig.from_pb(pb.JobConfig.FromString(auto.to_pb().SerializeToString())) == auto


def test_unset_fields_take_their_defaults_and_required_ones_are_named():
    assert JobConfig.from_pb(pb.JobConfig(stages=2, microbatches=4)) == JobConfig(stages=2, microbatches=4)
    with pytest.raises(InvalidInput, match="microbatches"):
        JobConfig.from_pb(pb.JobConfig(stages=2))


def test_the_dataclass_and_the_message_have_the_same_fields():
    """Adding a setting means one field in each; conversion follows the names."""
    assert [f.name for f in dataclasses.fields(JobConfig)] == [f.name for f in pb.JobConfig.DESCRIPTOR.fields]
