"""`fspeed.data.loader`: epochs over any dataset, rank shares, exact resume, the mesh's data axis."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset

import fspeed as fs
from fspeed.data import EpochSampler, TokenWindows, loader


class Squares(Dataset):
    """Sample i is {"x": i, "y": i*i}: a user's map-style dataset."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor(i), "y": torch.tensor(i * i)}


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).tolist())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), per_rank=st.integers(1, 5), ranks=st.integers(1, 4), seed=st.integers(0, 2**40),
       drop_last=st.booleans(), shuffle=st.booleans(), epoch=st.integers(0, 3))
def test_each_epoch_shows_every_sample_once_across_data_ranks(n, per_rank, ranks, seed, drop_last, shuffle, epoch):
    G = per_rank * ranks
    if drop_last and n < G:
        with pytest.raises(ValueError, match="fewer than one global batch"):
            EpochSampler(n, G, seed, drop_last=True)
        return
    samplers = [EpochSampler(n, G, seed, shuffle=shuffle, drop_last=drop_last, rank=r, world_size=ranks)
                for r in range(ranks)]
    spe = samplers[0].steps_per_epoch
    steps = range(epoch * spe, (epoch + 1) * spe)
    seen = torch.cat([s.indices(t) for t in steps for s in samplers])
    counts = collections.Counter(seen.tolist())
    assert seen.numel() == spe * G
    if drop_last:
        assert spe == n // G and max(counts.values()) == 1  # each at most once; only the remainder is dropped
    else:
        assert set(counts) == set(range(n))  # each at least once; the padding repeats the epoch's first ones
        assert sum(counts.values()) - n == spe * G - n
    if n % G == 0:
        assert counts == collections.Counter(range(n))
    # the ranks' shares concatenated are the global batch, which is the epoch's order in slices
    order = samplers[0].epoch_order(epoch)
    assert torch.equal(torch.cat([s.indices(steps[0]) for s in samplers]), samplers[0].global_indices(steps[0]))
    assert torch.equal(samplers[0].global_indices(steps[0])[:min(G, n)], order[:min(G, n)])
    assert torch.equal(order.sort().values, torch.arange(n)) and (shuffle or torch.equal(order, torch.arange(n)))


def test_same_seed_same_order_and_each_epoch_reshuffled():
    a, b = EpochSampler(100, 10, seed=3), EpochSampler(100, 10, seed=3)
    assert all(torch.equal(a.indices(t), b.indices(t)) for t in range(25))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))
    assert not torch.equal(a.epoch_order(0), EpochSampler(100, 10, seed=4).epoch_order(0))


def _batches(ld, count):
    out = []
    for batch in ld:
        out.append(batch)
        if len(out) == count:
            break
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_exact_and_workers_change_nothing(workers):
    data = Squares(23)
    make = dict(micro_batch_size=2, grad_accum=2, shuffle=True, seed=7, drop_last=False, epochs=3)
    whole = list(loader(data, **make))
    assert len(whole) == 3 * 6 and all(b["x"].shape == (4,) for b in whole)
    first = loader(data, num_workers=workers, **make)
    head = _batches(first, 8)  # stops in the middle of the second epoch
    state = first.state_dict()
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (8, 1, 2)
    resumed = loader(data, num_workers=workers, **make)
    resumed.load_state_dict(state)
    rest = list(resumed)
    for got, want in zip(head + rest, whole, strict=True):
        assert torch.equal(got["x"], want["x"]) and torch.equal(got["y"], want["x"] ** 2)
    assert list(resumed) == []  # three epochs done


def test_broken_off_loop_continues_where_it_was():
    ld = loader(Squares(12), micro_batch_size=3, seed=1)
    first = _batches(ld, 2)
    second = _batches(ld, 2)
    expected = [ld.batch(t)["x"] for t in range(4)]
    assert all(torch.equal(b["x"], e) for b, e in zip(first + second, expected, strict=True))


def test_resume_refuses_a_position_from_other_data():
    state = loader(Squares(20), micro_batch_size=2, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_samples: saved 20, now 21"):
        loader(Squares(21), micro_batch_size=2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: saved 0, now 1"):
        loader(Squares(20), micro_batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        loader(Squares(20), micro_batch_size=2).load_state_dict({"step": 3})


def test_token_windows_are_a_dataset_and_read_in_one_gather():
    tokens = torch.randint(0, 50, (203,))
    windows = TokenWindows(tokens, seq_len=10, stride=10)
    assert len(windows) == 20
    assert torch.equal(windows[3]["inputs"], tokens[30:40]) and torch.equal(windows[3]["targets"], tokens[31:41])
    fast = loader(windows, micro_batch_size=4, seed=2)
    slow = loader(windows, micro_batch_size=4, seed=2, collate=torch.utils.data.default_collate)
    for t in range(7):
        a, b = fast.batch(t), slow.batch(t)
        assert torch.equal(a["inputs"], b["inputs"]) and torch.equal(a["targets"], b["targets"])


def test_iterable_dataset_is_shared_by_rank_and_resumes():
    def make(rank):
        ld = loader(Stream(22), micro_batch_size=2, shuffle=False, epochs=2)
        ld.rank, ld.world_size, ld.global_batch_size = rank, 2, 4  # two data ranks, without a mesh
        return ld

    ranks = [list(make(r)) for r in range(2)]
    assert len(ranks[0]) == 2 * 5  # 22 // 4 global batches an epoch, the last 2 samples dropped
    epoch = torch.cat([torch.cat([ranks[0][i], ranks[1][i]]) for i in range(5)])
    assert torch.equal(epoch, torch.arange(20))
    first = make(1)
    head = _batches(first, 7)
    again = make(1)
    again.load_state_dict(first.state_dict())
    assert [b.tolist() for b in head + list(again)] == [b.tolist() for b in ranks[1]]
    with pytest.raises(ValueError, match="shuffle=True with an iterable dataset"):
        loader(Stream(5), micro_batch_size=1, shuffle=True)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        loader(Squares(4), micro_batch_size=0)
    with pytest.raises(TypeError, match="map-style Dataset"):
        loader(object(), micro_batch_size=1)
    with pytest.raises(TypeError, match="mesh must be an fspeed Mesh"):
        loader(Squares(4), micro_batch_size=1, mesh="data=2")


def _mesh_batches(steps):
    mesh = fs.parallel.Mesh(data=2, model=2)
    ld = loader(Squares(10), micro_batch_size=2, mesh=mesh, seed=5, drop_last=False)
    return mesh.coordinate("data"), mesh.coordinate("model"), [b["x"].tolist() for b in _batches(ld, steps)]


def test_tensor_ranks_load_the_same_batches_and_data_ranks_split_them(world4):
    results = world4.run(_mesh_batches, 3)
    by_data = collections.defaultdict(list)
    for data_rank, _, batches in results:
        by_data[data_rank].append(batches)
    assert sorted(by_data) == [0, 1] and all(a == b for a, b in by_data.values())
    one = EpochSampler(10, 4, 5, drop_last=False)
    for t in range(3):
        assert by_data[0][0][t] + by_data[1][0][t] == one.global_indices(t).tolist()


def test_epoch_per_loop_gives_one_epoch_each_for_loop_reshuffled():
    ld = loader(Squares(10), micro_batch_size=3, seed=4, epoch_per_loop=True)
    first, second = [b["x"] for b in ld], [b["x"] for b in ld]
    assert len(first) == len(second) == 3
    assert sorted(torch.cat(first).tolist()) != sorted(torch.cat(second).tolist()) or \
        not torch.equal(torch.cat(first), torch.cat(second))
    assert all(torch.equal(a, ld.batch(t)["x"]) for t, a in enumerate(first + second))
