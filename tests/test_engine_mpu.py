"""Megatron's mpu interface on 4 gloo ranks as DP2 x TP2: a Mesh serves it (its groups hold the
right ranks and reduce over them), `Mesh.from_mpu` builds a mesh over an external mpu's groups, and
`fs.initialize(mpu=...)` trains a Hugging Face Llama sliced over those groups as the functional API
does on fspeed's own mesh."""

import pytest
import torch
import torch.distributed as dist

import fspeed as fs
from tests.hf_models import hf_llama, lm_batch, lm_loss, split
from tests.test_engine import ds_config


class DataFastestMPU:
    """A Megatron-style mpu over 4 ranks whose data-parallel ranks are neighbours (rank = 2 x model +
    data), the transpose of fspeed's own order: data groups [0, 1] and [2, 3], model groups [0, 2]
    and [1, 3]. `lie`: it reports each rank's data rank as its model rank (groups that do not tile)."""

    def __init__(self, lie: bool = False):
        rank = dist.get_rank()
        self.data_rank, self.model_rank = rank % 2, rank // 2
        if lie:
            self.data_rank = self.model_rank
        for ranks in ([0, 1], [2, 3]):
            group = dist.new_group(ranks)
            if rank in ranks:
                self.data_group = group
        for ranks in ([0, 2], [1, 3]):
            group = dist.new_group(ranks)
            if rank in ranks:
                self.model_group = group

    def get_data_parallel_rank(self):
        return self.data_rank

    def get_data_parallel_group(self):
        return self.data_group

    def get_data_parallel_world_size(self):
        return 2

    def get_model_parallel_rank(self):
        return self.model_rank

    def get_model_parallel_group(self):
        return self.model_group

    def get_model_parallel_world_size(self):
        return 2


def mesh_mpu_case():
    """A Mesh(data=2, model=2)'s mpu answers, its groups' ranks and a sum over each; the same read
    back through Mesh.from_mpu(mesh) (a Mesh is an mpu)."""
    mesh = fs.Mesh(data=2, model=2)
    rank = dist.get_rank()

    def answers(m):
        sums = {}
        for axis, group in (("model", m.get_model_parallel_group()), ("data", m.get_data_parallel_group())):
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=group)
            sums[axis] = (dist.get_process_group_ranks(group), float(value))
        return (m.get_model_parallel_rank(), m.get_model_parallel_world_size(), m.get_data_parallel_rank(),
                m.get_data_parallel_world_size(), m.get_pipeline_model_parallel_world_size(),
                m.get_tensor_model_parallel_rank(), sums)

    again = fs.Mesh.from_mpu(mesh)
    return rank, answers(mesh), answers(again), again.sizes, again.coords


def test_a_mesh_serves_the_mpu_interface_on_dp2_x_tp2(world4):
    for rank, own, again, sizes, coords in world4.run(mesh_mpu_case):
        model, data = rank % 2, rank // 2  # fspeed's order: model ranks are neighbours
        tp_ranks, dp_ranks = [2 * data, 2 * data + 1], [model, model + 2]
        assert own == (model, 2, data, 2, 1, model, {"model": (tp_ranks, float(sum(tp_ranks))),
                                                     "data": (dp_ranks, float(sum(dp_ranks)))})
        assert again == own and sizes == {"pipe": 1, "data": 2, "model": 2}
        assert coords == {"pipe": 0, "data": data, "model": model}


def engine_mpu_case(steps: int = 2):
    """fs.initialize(mpu=DataFastestMPU()) on a Llama (sliced by its tp_plan over the mpu's model
    groups) against the functional API with the engine's plan on fspeed's Mesh(data=2, model=2);
    both gathered parameter sets, the losses, and what the engine's mesh answers."""
    from fspeed.config.build import build_optimizer
    from fspeed.config.compose import compose_run_config

    config = ds_config(1)
    mpu = DataFastestMPU()
    engine, *_ = fs.initialize(model=hf_llama(), config=config, mpu=mpu)
    mesh = engine.mesh
    losses = []
    for s in range(steps):
        share = split(lm_batch(8, s), 2, mpu.data_rank)
        for i in range(2):
            engine.backward(engine(split(share, 2, i)))
            engine.step()
        losses.append(engine.metrics["loss"])
    own = fs.Mesh(data=2, model=2)
    run, _ = compose_run_config(config, ["parallel.tensor=2"], dp_world_size=2)
    model = fs.functionalize(hf_llama(), lm_loss, tp_plan="auto")
    optimizer = build_optimizer(run)
    state = fs.init_train_state(model.init(), optimizer, seed=run.train.seed, plan=engine.plan, mesh=own, model=model)
    step = fs.make_train_step(model.loss, optimizer, grad_accum=2, plan=engine.plan, mesh=own)
    reference = []
    for s in range(steps):
        state, metrics = step(state, split(lm_batch(8, s), 2, own.coordinate("data")))
        reference.append(metrics["loss"])
    a, b = fs.gather_params(engine.state, mesh), fs.gather_params(state, own)
    asked = (mesh.get_data_parallel_rank(), mesh.get_model_parallel_rank(), mesh.sizes, engine.train_batch_size(),
             repr(engine.plan))
    return fs.Flat.from_tree(a).buffer, fs.Flat.from_tree(b).buffer, losses, reference, asked


def test_initialize_trains_over_an_external_mpus_groups(world4):
    for rank, (engine_params, functional_params, losses, reference, asked) in enumerate(world4.run(engine_mpu_case)):
        data, model, sizes, batch, plan = asked
        assert (data, model) == (rank % 2, rank // 2)  # the mpu's layout, not fspeed's
        assert sizes == {"pipe": 1, "data": 2, "model": 2} and batch == 2 * 2 * 2 and "tensor_slicing" in plan
        assert torch.equal(engine_params, functional_params) and losses == reference


def bad_mpu_case():
    """What every rank raises for groups that do not tile, and for a config that disagrees."""
    out = []
    try:
        fs.Mesh.from_mpu(DataFastestMPU(lie=True))
    except ValueError as err:
        out.append(str(err))
    try:
        fs.initialize(model=hf_llama(), config={**ds_config(0), "tensor_parallel": {"autotp_size": 4}},
                      mpu=DataFastestMPU())
    except fs.config.ConfigError as err:
        out.append(str(err))
    return out


def test_an_mpu_whose_groups_do_not_tile_is_an_error_on_every_rank(world4):
    results = world4.run(bad_mpu_case)
    assert all(r == results[0] for r in results) and len(results[0]) == 2
    assert "the mpu's groups do not form a pipe x data x model grid: ranks 0 and 1 report the same" in results[0][0]
    assert "parallel.tensor = 4: disagrees with the mpu's model parallel size 2" in results[0][1]


def test_mpu_and_mesh_together_are_refused():
    with pytest.raises(ValueError, match="pass mesh= or mpu=, not both"):
        fs.initialize(model=hf_llama(), config=ds_config(0), mesh=fs.Mesh.single(), mpu=fs.Mesh.single())
    with pytest.raises(TypeError, match=r"has no get_data_parallel_\{rank,group,world_size\}\(\)"):
        fs.Mesh.from_mpu(object())
