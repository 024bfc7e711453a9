"""One mesh (atoll.core.mesh): named dimensions, worker indices and group names, built once by the
compiler and carried in each worker's plan; a worker takes its layout from that plan alone."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atoll._rpc import atoll_pb2 as pb
from atoll.client.export import export_pipeline
from atoll.controller.compiler.pipeline import PipelineRequest, compile_pipeline
from atoll.controller.compiler.topology import Topology
from atoll.controller.loading import load_request
from atoll.core.config import JobConfig, WorkerSettings
from atoll.core.mesh import DIMENSIONS, Mesh, WorkerMesh
from atoll.errors import InvalidInput, JobFailed
from atoll.worker.loader import PlanLoader


def test_indices_coordinates_and_groups_agree():
    mesh = Mesh.of(data=2, pipeline=3, tensor=2)
    assert mesh.workers == 12 and [n for n, _ in mesh.sizes] == list(DIMENSIONS)
    for w in range(mesh.workers):
        at = mesh.coordinates(w)
        assert mesh.worker(**at) == w
        # Megatron's order: an island's workers are neighbours, then a replica's ranks
        assert w == (at["data"] * 3 + at["pipeline"]) * 2 + at["tensor"]
        for dim in DIMENSIONS:
            members = mesh.members(dim, w)
            assert w in members and len(members) == mesh.size(dim)
            assert {mesh.group(dim, m) for m in members} == {mesh.group(dim, w)}
    for dim in DIMENSIONS:  # one group per combination of the other coordinates, no two alike
        groups = {mesh.group(dim, w) for w in range(mesh.workers)}
        assert len(groups) == mesh.workers // mesh.size(dim)
    topo = Topology(ranks=3, microbatches=3, data_parallel=2, tensor_parallel=2)
    assert topo.mesh == mesh and all(topo.worker(*topo.coordinates(w)) == w for w in range(12))


def test_a_bad_mesh_is_refused_where_it_is_built_and_where_it_is_read():
    with pytest.raises(InvalidInput, match="unknown mesh dimension"):
        Mesh.of(pipeline=2, expert=2)
    with pytest.raises(InvalidInput, match="positive integer"):
        Mesh.of(pipeline=0)
    place = Mesh.of(pipeline=2).place(1).to_pb()
    place.dimensions[1].index = 5
    with pytest.raises(InvalidInput, match="outside"):
        WorkerMesh.from_pb(place)
    with pytest.raises(InvalidInput, match="dimensions"):
        WorkerMesh.from_pb(pb.MeshPlace(worker=0))


def _compiled(**layout):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    p = export_pipeline(model, x, y, F.mse_loss, 2 * layout.get("data_parallel", 1))  # a replica's microbatch
    config = JobConfig(microbatches=2, **layout)
    req = PipelineRequest(model=p.model, aliases=p.aliases, loss=p.loss, input=p.input, target=p.target, config=config)
    return compile_pipeline(req)


def test_the_plan_carries_the_mesh_and_no_job_config():
    assert "config" not in pb.LoadPlanRequest.DESCRIPTOR.fields_by_name  # nothing of the user's config to re-read
    compiled = _compiled(stages=2, data_parallel=2)
    topo = compiled.topology
    places = {}
    for w in range(topo.workers):
        request = load_request(
            "job", compiled, topo.coordinates(w), ["gloo"] * 2, ["gloo"], ("ns", "secret"), compiled.dataflow.to_pb()
        )
        places[w] = WorkerMesh.from_pb(request.mesh)
        assert WorkerSettings.from_pb(request.settings) == WorkerSettings.of(compiled.request.config)
    assert {p.worker for p in places.values()} == set(range(4))
    for w, place in places.items():
        replica, rank, tp = topo.coordinates(w)
        assert place.coordinates == {"data": replica, "pipeline": rank, "tensor": tp}
        assert place.sizes == {"data": 2, "pipeline": 2, "tensor": 1}
    # the two replicas of rank 0 meet in one data group; the two ranks of replica 0 in one pipeline group
    assert places[0].groups["data"] == places[2].groups["data"] != places[1].groups["data"]
    assert places[0].groups["pipeline"] == places[1].groups["pipeline"] != places[2].groups["pipeline"]


def test_a_worker_takes_its_layout_from_the_mesh():
    compiled = _compiled(stages=1)
    request = load_request("job", compiled, (0, 0, 0), [""], [], ("ns", "secret"), compiled.dataflow.to_pb())
    loader = PlanLoader(device=torch.device("cpu"), host="127.0.0.1", controller=None)
    executor = loader.load(request)
    assert (executor.rank, executor.island_rank, executor.island_size, executor.replicas) == (0, 0, 1, None)
    executor.close()
    # the same plan with a mesh that says two replicas: the worker goes to meet the other replica
    # in the data group the mesh names (and, with no controller here, says it cannot)
    request.mesh.CopyFrom(Mesh.of(data=2, pipeline=1).place(1).to_pb())
    with pytest.raises(JobFailed, match="no controller to meet its peers"):
        loader.load(request)
