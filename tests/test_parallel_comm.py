"""fspeed.parallel.comm and mesh: the single-process mesh and Megatron's mpu interface, DeepSpeed's
bandwidth formulas and comm-log table, asynchronous collectives on the timeline."""

import pytest
import torch

import fspeed as fs
from fspeed.parallel.comm import CommLog, bus_bandwidth


def test_single_process_mesh_and_mpu_interface():
    mesh = fs.Mesh()
    assert mesh.sizes == {"pipe": 1, "data": 1, "model": 1}
    assert mesh.get_data_parallel_world_size() == 1 and mesh.get_model_parallel_rank() == 0
    assert mesh.get_model_parallel_group() is None
    x = torch.arange(4.0)
    assert torch.equal(mesh.comm("data").all_reduce_(x.clone()), x)
    with pytest.raises(ValueError, match="but the world size is 1"):
        fs.Mesh(data=2)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        fs.Mesh(data=-1, model=-1)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        mesh.comm("tensor")


def test_bus_bandwidth_formulas_and_summary():
    n, size, t = 4, 1_000_000, 0.002
    algbw, busbw = bus_bandwidth("all_reduce", size, t, n)
    assert algbw == pytest.approx(2 * size / t * 8 / 1e9) and busbw == pytest.approx(size / t * 2 * 3 / 4 * 8 / 1e9)
    algbw, busbw = bus_bandwidth("all_gather", size, t, n)
    assert algbw == pytest.approx(size * n / t * 8 / 1e9) and busbw == pytest.approx(algbw * 3 / 4)
    log = CommLog()
    for latency in (0.001, 0.002, 0.003, 0.1):
        log.record("all_reduce", "data", 4096, latency, 2)
    log.record("all_gather", "data", 1 << 20, 0.01, 2)
    assert log.total_bytes() == 4 * 4096 + (1 << 20)
    table = log.summary()
    assert "Comm. Op" in table and "all_reduce" in table and "4.00 KB" in table and "1.00 MB" in table


def test_a_pipe_axis_needs_a_pipeline_in_the_plan():
    from fspeed.parallel.plan import ParamEntry
    with pytest.raises(ValueError, match=r"pipe=2 but no transform .* fs.pipeline\(micro_batches=...\)"):
        fs.zero(stage=1).place([ParamEntry("w", (4,), (None,))], {"pipe": 2, "data": 1, "model": 1})


def test_single_mesh_ignores_the_process_group_and_pending_ops_record_the_timeline():
    mesh = fs.Mesh.single(fs.CommLog())
    assert mesh.sizes == {"pipe": 1, "data": 1, "model": 1} and mesh.world_size == 1
    pending = mesh.comm("data").start_all_reduce(torch.ones(3))
    assert pending.wait() is None and not mesh.log.events  # a world of one communicates nothing
    log = CommLog()
    log.record("reduce", "data", 64, 0.5, 2, issued=10.0, blocked=0.1)
    (event,) = log.events
    assert event.op == "reduce" and event.issued == 10.0 and event.blocked == 0.1 and event.waited > 10.0
    log.reset()
    assert not log.events and log.total_bytes() == 0


def comm_pending_case():
    """Every asynchronous collective on 2 ranks, waited for later: results and the log's timeline."""
    import time

    mesh = fs.Mesh(data=-1, log=fs.CommLog())
    comm, rank = mesh.comm("data"), mesh.rank
    summed, owned = torch.full((4,), float(rank + 1)), torch.full((6,), float(rank + 1))
    full, out = torch.arange(8.0) * (rank + 1), torch.empty(4)
    onto_0 = torch.arange(5.0) * (rank + 1)  # (gloo, 2 ranks: a send and an add on the owner)
    pending = [comm.start_all_reduce(summed), comm.start_reduce(owned, owner=1), comm.start_reduce_scatter(full, out),
               comm.start_reduce(onto_0, owner=0)]
    time.sleep(0.05)
    for p in pending:
        p.wait()
    return (summed.tolist(), owned.tolist() if rank == 1 else onto_0.tolist(), out.tolist(),
            [e for e in mesh.log.events if e.nbytes != 20])


def test_asynchronous_collectives_on_2_ranks(world2):
    for rank, (summed, owned, out, events) in enumerate(world2.run(comm_pending_case)):
        assert summed == [3.0] * 4
        assert owned == ([3.0] * 6 if rank == 1 else [0.0, 3.0, 6.0, 9.0, 12.0])  # reduced onto its owner
        assert out == [3.0 * x for x in range(4 * rank, 4 * rank + 4)]
        assert [e.op for e in events] == ["all_reduce", "reduce", "reduce_scatter"]
        assert all(e.waited - e.issued >= 0.05 > e.blocked for e in events)  # they ran while this rank slept


def gather_in_flight_case():
    """An all-gather started in buckets: waiting for a range completes exactly the buckets that
    write it (ZeRO-1/2's per-unit wait in the next forward); the rest completes on wait()."""
    mesh = fs.Mesh(data=-1)
    comm, rank = mesh.comm("data"), mesh.rank
    part, out = torch.arange(10.0) + 100 * rank, torch.full((20,), -1.0)
    gather = comm.start_all_gather(part, out, bucket_elems=3)  # buckets [0,3) [3,6) [6,9) [9,10) of each part
    gather.wait_range(11, 13)  # rank 1's elements 1-2: the first bucket, which also writes out[0:3]
    first = [c is None for c in gather.chunks]
    after_range = out.clone()
    gather.wait()
    return first, after_range.tolist(), out.tolist(), gather.done


def test_an_all_gather_in_flight_completes_by_range(world2):
    expected = [float(x) for x in range(10)] + [100.0 + x for x in range(10)]
    for first, after_range, out, done in world2.run(gather_in_flight_case):
        assert first == [True, False, False, False]
        assert after_range[0:3] == expected[0:3] and after_range[10:13] == expected[10:13]
        assert after_range[3:10] == [-1.0] * 7  # untouched until waited
        assert out == expected and done


def gather_by_broadcast_case():
    """The in-place gather ZeRO-1/2 start after the optimizer: broadcasts of pieces from their
    owners in a given order; waiting for a range completes the pieces that write it and no other."""
    mesh = fs.Mesh(data=-1, log=fs.CommLog())
    comm, rank = mesh.comm("data"), mesh.rank
    out = torch.full((20,), -1.0)
    out[10 * rank:10 * rank + 10] = torch.arange(10.0) + 100 * rank  # each rank's own part, in place
    pieces = [(10, 14), (0, 4), (14, 18), (4, 8), (18, 20), (8, 10)]  # in the order they will be read
    gather = comm.start_gather_by_broadcast(out, pieces)
    gather.wait_range(3, 5)
    first = [c is None for c in gather.chunks]
    gather.wait_range(12, 13)
    second = [c is None for c in gather.chunks]
    gather.wait()
    return first, second, out.tolist(), gather.done, [e.op for e in mesh.log.events]


def test_a_gather_by_broadcast_completes_by_range(world2):
    expected = [float(x) for x in range(10)] + [100.0 + x for x in range(10)]
    for first, second, out, done, ops in world2.run(gather_by_broadcast_case):
        assert first == [False, True, False, True, False, False]
        assert second == [True, True, False, True, False, False]
        assert out == expected and done
        assert ops == ["broadcast"] * 6


def meshes_case():
    """Build meshes again and again (as a loop of runs or engines does): the descriptors a rank holds
    stay as they were after the first, and the meshes share their groups."""
    import os

    def open_files():
        return len(os.listdir("/proc/self/fd"))

    first = fs.Mesh(data=-1, log=fs.CommLog())
    before = open_files()
    for _ in range(20):
        mesh = fs.Mesh(data=-1)
        mesh.comm("data").all_reduce_(torch.ones(2))
    return before, open_files(), mesh.comm("data").group is first.comm("data").group


def test_meshes_share_their_process_groups_instead_of_leaking_one_per_mesh(world2):
    for before, after, shared in world2.run(meshes_case):
        assert after == before and shared  # a group per mesh held 5 more descriptors each


@pytest.mark.parametrize("cuda, local_rank, expected_backend, expected_device",
                         [(False, "0", "gloo", None), (True, "1", "cpu:gloo,cuda:nccl", 1),
                          (True, "3", "cpu:gloo,cuda:nccl", None)])  # rank 3 of 2 GPUs: a CPU run, no device set
def test_init_distributed_uses_gloo_for_host_tensors_and_nccl_for_cuda_ones(monkeypatch, cuda, local_rank,
                                                                              expected_backend, expected_device):
    import fspeed.parallel.mesh as mesh_module

    calls = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, timeout: calls.setdefault("backend", backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("device", device.index))
    mesh_module.init_distributed()
    assert calls["backend"] == expected_backend and calls.get("device") == expected_device
    calls.clear()
    mesh_module.init_distributed("gloo")  # an explicit backend is taken as given
    assert calls == {"backend": "gloo"}


def test_no_functional_collectives_in_fspeed():
    """torch's functional collectives hang gloo now and then with another collective in flight (a
    ZeRO-3 prefetch beside the reduce-scatters: 2 ranks, twice in 480 runs of a test's case): every
    collective is a c10d one (`fspeed.parallel.comm`)."""
    import pathlib
    root = pathlib.Path(fs.__file__).parent
    users = [str(p.relative_to(root)) for p in root.rglob("*.py") if "_functional_collectives" in p.read_text()]
    assert users == []
