"""DeepSpeed's five sparsity layouts: construction against an independent transcription, errors, display.

The transcription below decides each (head, row, col) by a predicate instead of filling slices,
and draws random blocks itself with the documented RNG protocol (`random.Random(seed)`, head by
head, row by row, `sample(range(n), k)`), so it shares no code with fspeed.sparse.layouts.
Literal layouts pin a few cases computed by hand from DeepSpeed's rules.
"""

import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fspeed.sparse as sp

# --------------------------------------------------------------------------- transcription


def _random_sets(rng, nb, k, unidirectional):
    return [set(rng.sample(range(r + 1 if unidirectional else nb), k)) for r in range(nb)]


def _fixed_member(cfg, nb, h, r, c):
    L, G = cfg.num_local_blocks, cfg.num_global_blocks
    uni = cfg.attention == "unidirectional"
    if r // L == c // L and (not uni or c <= r):
        return True
    first = L - (1 + h % cfg.num_different_global_patterns) * G
    end = nb - nb % L
    starts = list(range(first, end, L))
    if end < nb:
        starts.append(min(end + first, nb - G))
    for s in starts:
        if s <= c < s + G and (not uni or r >= s):
            return True
        if cfg.horizontal_global_attention and s <= r < s + G:
            return True
    return False


def _global_ranges(starts, ends, nb):
    pairs = [(s, s + 1) for s in starts] if ends is None else list(zip(starts, ends))
    return [(s, min(e, nb)) for s, e in pairs if s < nb]


def transcribe(cfg, seq_len, seed):
    nb = seq_len // cfg.block
    rng = random.Random(seed)
    H = cfg.num_heads
    built = cfg.num_heads if cfg.different_layout_per_head else 1
    out = np.zeros((H, nb, nb), dtype=np.int64)
    for h in range(built):
        rand = None
        if isinstance(cfg, sp.VariableConfig):
            rand = _random_sets(rng, nb, cfg.num_random_blocks, False)
        if isinstance(cfg, sp.BigBirdConfig):
            rand = _random_sets(rng, nb, cfg.num_random_blocks, cfg.attention == "unidirectional")
        for r in range(nb):
            for c in range(nb):
                out[h, r, c] = _member(cfg, nb, h, r, c, rand)
    for h in range(built, H):
        out[h] = out[0]
    return torch.from_numpy(out)


def _member(cfg, nb, h, r, c, rand):
    uni = getattr(cfg, "attention", "bidirectional") == "unidirectional"
    if isinstance(cfg, sp.DenseConfig):
        return True
    if isinstance(cfg, sp.FixedConfig):
        return _fixed_member(cfg, nb, h, r, c)
    if isinstance(cfg, sp.VariableConfig):
        if c in rand[r]:
            return True
        sizes, start = list(cfg.local_window_blocks), 0
        while start < nb:  # windows of the listed sizes, then the last size repeated
            size = sizes.pop(0) if sizes else cfg.local_window_blocks[-1]
            if start <= r < start + size and start <= c < start + size and (not uni or c <= r):
                return True
            start += size
        for s, e in _global_ranges(cfg.global_block_indices, cfg.global_block_end_indices, nb):
            if s <= c < e and (not uni or r >= s):
                return True
            if cfg.horizontal_global_attention and s <= r < e:
                return True
        return False
    w = cfg.num_sliding_window_blocks // 2
    if isinstance(cfg, sp.BigBirdConfig):
        hit = c in rand[r] or abs(r - c) <= w or r < cfg.num_global_blocks or c < cfg.num_global_blocks
        return hit and (not uni or c <= r)
    if isinstance(cfg, sp.BSLongformerConfig):
        hit = abs(r - c) <= w or any(s <= r < e or s <= c < e for s, e in
                                     _global_ranges(cfg.global_block_indices, cfg.global_block_end_indices, nb))
        return hit and (not uni or c <= r)
    if isinstance(cfg, sp.LocalSlidingWindowConfig):
        return r - w <= c <= (r if uni else r + w)
    raise AssertionError(type(cfg))


# --------------------------------------------------------------------------- strategies

attention_types = st.sampled_from(["unidirectional", "bidirectional"])


@st.composite
def fixed_configs(draw):
    G = draw(st.integers(1, 3))
    L = G * draw(st.integers(1, 4))
    different = draw(st.booleans())
    att = draw(attention_types)
    return sp.FixedConfig(num_heads=draw(st.integers(1, 4)), block=draw(st.sampled_from([1, 2, 16])),
                          different_layout_per_head=different, num_local_blocks=L, num_global_blocks=G,
                          attention=att, horizontal_global_attention=att == "bidirectional" and draw(st.booleans()),
                          num_different_global_patterns=draw(st.integers(1, L // G)) if different else 1)


@st.composite
def global_indices(draw):
    starts = sorted(draw(st.sets(st.integers(0, 24), max_size=3)))
    ends = [s + draw(st.integers(1, 4)) for s in starts] if draw(st.booleans()) else None
    return starts, ends


@st.composite
def variable_configs(draw):
    att = draw(attention_types)
    starts, ends = draw(global_indices())
    return sp.VariableConfig(num_heads=draw(st.integers(1, 4)), block=draw(st.sampled_from([1, 4, 16])),
                             different_layout_per_head=draw(st.booleans()), num_random_blocks=draw(st.integers(0, 3)),
                             local_window_blocks=draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)),
                             global_block_indices=starts, global_block_end_indices=ends, attention=att,
                             horizontal_global_attention=att == "bidirectional" and draw(st.booleans()))


@st.composite
def bigbird_configs(draw):
    att = draw(attention_types)
    return sp.BigBirdConfig(num_heads=draw(st.integers(1, 4)), block=draw(st.sampled_from([1, 4, 16])),
                            different_layout_per_head=draw(st.booleans()),
                            num_random_blocks=draw(st.integers(0, 1 if att == "unidirectional" else 3)),
                            num_sliding_window_blocks=draw(st.integers(1, 6)),
                            num_global_blocks=draw(st.integers(0, 3)),
                            attention=att)


@st.composite
def bslongformer_configs(draw):
    starts, ends = draw(global_indices())
    return sp.BSLongformerConfig(num_heads=draw(st.integers(1, 4)), block=draw(st.sampled_from([1, 4, 16])),
                                 different_layout_per_head=draw(st.booleans()),
                                 num_sliding_window_blocks=draw(st.integers(1, 6)), global_block_indices=starts,
                                 global_block_end_indices=ends, attention=draw(attention_types))


@st.composite
def other_configs(draw):
    H, block = draw(st.integers(1, 4)), draw(st.sampled_from([1, 8]))
    if draw(st.booleans()):
        return sp.DenseConfig(num_heads=H, block=block, different_layout_per_head=draw(st.booleans()))
    return sp.LocalSlidingWindowConfig(num_heads=H, block=block, num_sliding_window_blocks=draw(st.integers(1, 5)),
                                       attention=draw(attention_types))


def _valid_block_count(cfg):
    least = 1
    if isinstance(cfg, sp.FixedConfig):
        least = cfg.num_global_blocks
    if isinstance(cfg, (sp.VariableConfig, sp.BigBirdConfig)):
        least = max(least, cfg.num_random_blocks)
    if isinstance(cfg, (sp.BigBirdConfig, sp.BSLongformerConfig, sp.LocalSlidingWindowConfig)):
        least = max(least, cfg.num_sliding_window_blocks)
    if isinstance(cfg, sp.BigBirdConfig):
        least = max(least, cfg.num_global_blocks)
    return st.integers(least, 24)


@given(data=st.data(), seed=st.integers(0, 10_000))
@pytest.mark.parametrize("configs", [fixed_configs(), variable_configs(), bigbird_configs(), bslongformer_configs(),
                                     other_configs()],
                         ids=["fixed", "variable", "bigbird", "bslongformer", "dense+local"])
def test_layout_matches_transcription(configs, data, seed):
    cfg = data.draw(configs)
    nb = data.draw(_valid_block_count(cfg))
    got = sp.layout(cfg, nb * cfg.block, seed=seed)
    assert got.dtype == torch.int64 and got.shape == (cfg.num_heads, nb, nb)
    assert torch.equal(got, transcribe(cfg, nb * cfg.block, seed))
    if not cfg.different_layout_per_head:
        assert all(torch.equal(got[h], got[0]) for h in range(cfg.num_heads))


# --------------------------------------------------------------------------- literal anchors


def _grid(rows):
    return torch.tensor([[1 if ch == "#" else 0 for ch in row] for row in rows])


def test_fixed_literal_layouts():
    bi = sp.layout(sp.FixedConfig(num_heads=1, block=1, num_local_blocks=4, num_global_blocks=1), 6)[0]
    # windows [0,4) and [4,6); global columns 3 and the short window's min(4 + 3, 6 - 1) = 5
    assert torch.equal(bi, _grid(["####.#", "####.#", "####.#", "####.#", "...###", "...###"]))
    uni = sp.layout(sp.FixedConfig(num_heads=1, block=1, num_local_blocks=4, num_global_blocks=1,
                                   attention="unidirectional"), 6)[0]
    assert torch.equal(uni, _grid(["#.....", "##....", "###...", "####..", "...##.", "...###"]))
    # two heads, two patterns: head 1's summary columns are each window's first block (0 and 2)
    two = sp.layout(sp.FixedConfig(num_heads=2, block=1, num_local_blocks=2, num_global_blocks=1,
                                   different_layout_per_head=True, num_different_global_patterns=2), 4)
    assert torch.equal(two[0], _grid(["##.#", "##.#", ".###", ".###"]))
    assert torch.equal(two[1], _grid(["###.", "###.", "#.##", "#.##"]))


def test_bigbird_bslongformer_variable_literals():
    bb = sp.layout(sp.BigBirdConfig(num_heads=1, block=1, num_random_blocks=0, num_sliding_window_blocks=3,
                                    num_global_blocks=1), 5)[0]
    assert torch.equal(bb, _grid(["#####", "###..", "####.", "#.###", "#..##"]))
    lf = sp.layout(sp.BSLongformerConfig(num_heads=1, block=1, num_sliding_window_blocks=1, global_block_indices=[2],
                                         attention="unidirectional"), 4)[0]
    assert torch.equal(lf, _grid(["#...", ".#..", "###.", "..##"]))
    var = sp.layout(sp.VariableConfig(num_heads=1, block=1, local_window_blocks=[1, 2], global_block_indices=[9]), 6)[0]
    # windows [0,1), [1,3), then size 2 repeats: [3,5), [5,6); index 9 is past the sequence, skipped
    assert torch.equal(var, _grid(["#.....", ".##...", ".##...", "...##.", "...##.", ".....#"]))


def test_random_blocks_follow_the_seeded_rng_protocol():
    cfg = sp.BigBirdConfig(num_heads=3, block=2, different_layout_per_head=True, num_random_blocks=2,
                           num_sliding_window_blocks=1, num_global_blocks=0)
    rng = random.Random(7)
    expected = torch.zeros(3, 10, 10, dtype=torch.int64)
    for h in range(3):
        for r in range(10):
            expected[h, r, rng.sample(range(10), 2)] = 1
        expected[h] |= torch.eye(10, dtype=torch.int64)
    assert torch.equal(sp.layout(cfg, 20, seed=7), expected)
    assert torch.equal(sp.layout(cfg, 20, seed=random.Random(7)), expected)
    assert not torch.equal(sp.layout(cfg, 20, seed=8), expected)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("make, message", [
    (lambda: sp.layout(sp.FixedConfig(num_heads=1, block=16), 100), "not divisible by block=16"),
    (lambda: sp.layout(sp.FixedConfig(num_heads=1, block=1, num_local_blocks=4, num_global_blocks=4), 2),
     "num_global_blocks=4 is more than the 2 blocks"),
    (lambda: sp.layout(sp.BigBirdConfig(num_heads=1, block=1, num_random_blocks=0, num_global_blocks=5), 4),
     "num_global_blocks=5 is more than"),
    (lambda: sp.layout(sp.BigBirdConfig(num_heads=1, block=1, num_random_blocks=5), 4), "num_random_blocks=5"),
    (lambda: sp.layout(sp.BSLongformerConfig(num_heads=1, block=1, num_sliding_window_blocks=7), 4),
     "num_sliding_window_blocks=7"),
    (lambda: sp.FixedConfig(num_heads=1, num_local_blocks=4, num_global_blocks=3), "divisible by num_global_blocks=3"),
    (lambda: sp.FixedConfig(num_heads=1, attention="unidirectional", horizontal_global_attention=True),
     "needs attention='bidirectional'"),
    (lambda: sp.FixedConfig(num_heads=2, num_different_global_patterns=2), "needs different_layout_per_head=True"),
    (lambda: sp.FixedConfig(num_heads=2, different_layout_per_head=True, num_different_global_patterns=5),
     "at most num_local_blocks // num_global_blocks = 4 // 1 = 4"),
    (lambda: sp.VariableConfig(num_heads=1, global_block_indices=[0, 4], global_block_end_indices=[2]),
     "same length"),
    (lambda: sp.VariableConfig(num_heads=1, global_block_indices=[3], global_block_end_indices=[3]),
     r"\[3, 3\) is empty"),
    (lambda: sp.VariableConfig(num_heads=1, local_window_blocks=[]), "at least one window"),
    (lambda: sp.VariableConfig(num_heads=1, local_window_blocks=[2, 0]), "positive integer, got 0"),
    (lambda: sp.BSLongformerConfig(num_heads=1, attention="sideways"), "attention='sideways' must be one of"),
    (lambda: sp.BigBirdConfig(num_heads=1, num_random_blocks=2, attention="unidirectional"), "at most 1 random block"),
    (lambda: sp.DenseConfig(num_heads=0), "num_heads=0 must be a positive integer"),
    (lambda: sp.SparseAttentionConfig(mode="longformer"), "mode='longformer' must be one of"),
    (lambda: sp.SparseAttentionConfig(mode="fixed", num_local_blocks=3, num_global_blocks=2), "divisible"),
])
def test_bad_combinations_are_clear_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --------------------------------------------------------------------------- the JSON block


def test_sparse_attention_config_defaults_and_translation():
    default = sp.SparseAttentionConfig()
    assert (default.mode, default.block, default.num_random_blocks) == ("fixed", 16, 0)
    assert default.local_window_blocks == (4,) and default.num_sliding_window_blocks == 3
    assert isinstance(default.to_sparsity_config(8), sp.FixedConfig)
    bird = sp.SparseAttentionConfig.from_deepspeed(
        {"mode": "bigbird", "block": 32, "num_random_blocks": 2, "attention": "unidirectional", "num_local_blocks": 99})
    # DeepSpeed's parser reads neither attention nor num_local_blocks for bigbird
    assert bird.attention == "bidirectional" and bird.num_local_blocks == 4
    cfg = bird.to_sparsity_config(4)
    assert cfg == sp.BigBirdConfig(num_heads=4, block=32, num_random_blocks=2)
    var = sp.SparseAttentionConfig.from_deepspeed({"mode": "variable", "local_window_blocks": [2, 3],
                                                   "global_block_end_indices": [1]})
    assert var.to_sparsity_config(2).global_block_end_indices == (1,)
    own = sp.SparseAttentionConfig(mode="bslongformer", attention="unidirectional", block=4, seed=5)
    assert own.to_sparsity_config(2).attention == "unidirectional"
    assert torch.equal(sp.layout(own, 32, num_heads=2), sp.layout(own.to_sparsity_config(2), 32, seed=5))
    with pytest.raises(ValueError, match="needs num_heads"):
        sp.layout(own, 32)
    with pytest.raises(ValueError, match="must be one of"):
        sp.SparseAttentionConfig.from_deepspeed({"mode": "strided"})


# --------------------------------------------------------------------------- display


def test_format_layout_folds_identical_heads():
    lay = sp.layout(sp.BSLongformerConfig(num_heads=3, block=1, num_sliding_window_blocks=1), 3)
    text = sp.format_layout(lay)
    assert text.splitlines()[0] == "heads 0-2: 3x3 blocks, 7 present (77.8%)"
    assert text.splitlines()[1:] == ["###", "##.", "#.#"]
    assert sp.format_layout(lay, heads=[1], on="1", off="0").splitlines()[1] == "111"
    with pytest.raises(ValueError, match="head 3 is out of range"):
        sp.format_layout(lay, heads=[3])


def test_png_round_trip(tmp_path):
    lay = sp.layout(sp.FixedConfig(num_heads=2, block=1, num_local_blocks=2), 4)
    path = sp.save_layout_png(lay, tmp_path / "layout.png", pixels_per_block=3)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (2 * 12 + 4, 12)
    idat = data.index(b"IDAT")
    size = int.from_bytes(data[idat - 4:idat], "big")
    raw = np.frombuffer(zlib.decompress(data[idat + 4: idat + 4 + size]), dtype=np.uint8).reshape(height, width + 1)
    pixels = raw[:, 1:]
    assert (raw[:, 0] == 0).all()  # filter byte "none" on every row
    dark = pixels[::3, :12:3] < 128  # head 0, one pixel per block
    assert np.array_equal(dark, lay[0].numpy() == 1)
