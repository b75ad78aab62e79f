"""The data-efficiency curriculum: metric values, the cached index, and the admitting sampler."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fspeed.data.difficulty as difficulty
from fspeed.data import CurriculumSampler, CurriculumSchedule, difficulty_at, loader, metric_index


class Sentences(torch.utils.data.Dataset):
    """Sample i: `lengths[i]` tokens then padding (0) up to 12."""

    def __init__(self, lengths, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.cat([torch.randint(1, 9, (n,), generator=g), torch.zeros(12 - n, dtype=torch.long)])
                     for n in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"inputs": self.rows[i]}


def test_metrics_are_the_stated_formulas():
    data = Sentences([3, 12, 7, 1])
    assert difficulty.compute_metric(data, "seqlen", pad_id=0).tolist() == [3, 12, 7, 1]
    rarity = difficulty.compute_metric(data, "vocab_rarity", pad_id=0)
    tokens = torch.cat([r[r != 0] for r in data.rows]).tolist()
    p = {t: tokens.count(t) / len(tokens) for t in set(tokens)}
    for row, value in zip(data.rows, rarity.tolist()):
        assert value == pytest.approx(-sum(math.log(p[t]) for t in row[row != 0].tolist()))
    with pytest.raises(ValueError, match="allowed: seqlen, vocab_rarity"):
        difficulty.compute_metric(data, "perplexity")


def test_the_index_is_built_once_and_rebuilt_for_other_data(tmp_path, monkeypatch):
    data = Sentences([3, 12, 7, 1, 5])
    first = metric_index(data, "vocab_rarity", tmp_path / "idx", pad_id=0)
    assert (tmp_path / "idx" / "vocab_rarity.pt").exists()

    def refuse(*args, **kwargs):
        raise AssertionError("recomputed although cached")

    with monkeypatch.context() as m:
        m.setattr(difficulty, "compute_metric", refuse)
        assert torch.equal(metric_index(data, "vocab_rarity", tmp_path / "idx", pad_id=0), first)
    other = Sentences([3, 12, 7, 1, 5], seed=1)
    assert not torch.equal(metric_index(other, "vocab_rarity", tmp_path / "idx", pad_id=0), first)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=8, max_size=40), ranks=st.sampled_from([1, 2, 4]),
       kind=st.sampled_from(["value", "percentile"]), seed=st.integers(0, 1000))
def test_each_step_draws_only_admitted_samples_and_ranks_split_the_batch(lengths, ranks, kind, seed):
    values = torch.tensor(lengths, dtype=torch.float64)
    lo, hi = (min(lengths), 12) if kind == "value" else (40, 100)
    schedule = CurriculumSchedule(min_difficulty=lo, max_difficulty=hi, schedule_type="fixed_linear",
                                  total_curriculum_step=20, difficulty_step=1)
    if kind == "percentile" and len(lengths) * lo // 100 == 0:
        return
    samplers = [CurriculumSampler(values, schedule, 2 * ranks, seed, difficulty_type=kind, rank=r, world_size=ranks)
                for r in range(ranks)]
    for step in (0, 5, 12, 30):
        d = difficulty_at(schedule, step)
        batch = torch.cat([s.indices(step) for s in samplers])
        assert torch.equal(batch, samplers[0].global_indices(step))
        if kind == "value":
            assert all(lengths[i] <= d for i in batch.tolist())
        else:
            cutoff = sorted(lengths)[len(lengths) * d // 100 - 1]
            assert all(lengths[i] <= cutoff for i in batch.tolist())
        if len(samplers[0].admitted(step)) >= batch.numel():
            assert len(set(batch.tolist())) == batch.numel()  # without replacement
    assert torch.equal(samplers[0].global_indices(30), samplers[0].global_indices(30))


def test_the_loader_reads_through_a_curriculum_sampler_and_resumes():
    data = Sentences([3, 12, 7, 1, 5, 9, 2, 11, 4, 6, 8, 10])
    values = metric_index(data, "seqlen", pad_id=0)
    schedule = CurriculumSchedule(min_difficulty=4, max_difficulty=12, schedule_type="fixed_linear",
                                  total_curriculum_step=10, difficulty_step=2)
    make = lambda: loader(data, micro_batch_size=2, seed=3,  # noqa: E731
                          sampler=CurriculumSampler(values, schedule, 2, seed=3))
    whole = [b["inputs"] for _, b in zip(range(8), make())]
    assert all(int((row != 0).sum()) <= difficulty_at(schedule, t) for t, b in enumerate(whole) for row in b)
    first = make()
    head = [b["inputs"] for _, b in zip(range(3), first)]
    again = make()
    again.load_state_dict(first.state_dict())
    rest = [b["inputs"] for _, b in zip(range(5), again)]
    assert all(torch.equal(a, b) for a, b in zip(head + rest, whole, strict=True))
    with pytest.raises(ValueError, match="the sampler covers 12 samples with global batches of 2"):
        loader(data, micro_batch_size=4, sampler=CurriculumSampler(values, schedule, 2))
