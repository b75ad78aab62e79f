"""The data package: corpus, tokenizers, token windows and the counter-based, rank-sliced sampler."""

from __future__ import annotations

import json
import sysconfig

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fspeed.data import (
    BatchSampler,
    ByteTokenizer,
    CharTokenizer,
    CorpusDecodeError,
    CorpusError,
    Loader,
    TokenWindows,
    UnknownCharacterError,
    corpus_file_bytes,
    eval_starts,
    make_tokenizer,
    split_train_val,
    stdlib_corpus,
    stdlib_corpus_bytes,
    stdlib_dir,
    text_corpus,
    tokenizer_from_dict,
)

# Any str, lone surrogates included (hypothesis leaves them out by default).
any_text = st.text(alphabet=st.characters(codec=None, categories=["L", "N", "P", "S", "Z", "C"]))
seeds = st.integers(min_value=-(2**70), max_value=2**70)
steps = st.integers(min_value=0, max_value=2**40)


# ----------------------------------------------------------------------------------------- corpus


@pytest.fixture(scope="module")
def corpus() -> str:
    return stdlib_corpus()


def test_stdlib_corpus_is_large_python_source_within_the_cap(corpus):
    assert len(corpus.encode("utf-8")) > 1_000_000
    assert "def " in corpus and "import " in corpus
    assert corpus.startswith("# ==== ")
    assert len(corpus.encode("utf-8")) <= 4_000_000  # the cap counts bytes on disk


def test_stdlib_corpus_is_deterministic_and_cut_on_a_file_boundary(corpus):
    small = stdlib_corpus(300_000)
    assert small == stdlib_corpus(300_000)
    assert len(small.encode("utf-8")) <= 300_000
    assert corpus.startswith(small)
    assert corpus[len(small) :].startswith("# ==== ")
    assert small.endswith("\n")


def test_stdlib_corpus_orders_top_level_then_packages_and_skips_tests(tmp_path):
    (tmp_path / "b.py").write_text("B = 2")
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    for directory, name in [("pkg", "c.py"), ("test", "t.py"), ("site-packages", "s.py"), ("aa", "z.py")]:
        (tmp_path / directory).mkdir()
        (tmp_path / directory / name).write_text(f"# {directory}/{name}\n")
    text = stdlib_corpus(10_000, root=tmp_path)
    assert text == (
        "# ==== a.py ====\nA = 1\n"
        "# ==== b.py ====\nB = 2\n"
        "# ==== aa/z.py ====\n# aa/z.py\n"
        "# ==== pkg/c.py ====\n# pkg/c.py\n"
    )
    first_two = len("# ==== a.py ====\nA = 1\n# ==== b.py ====\nB = 2\n")
    assert stdlib_corpus(first_two, root=tmp_path) == text[:first_two]
    assert stdlib_corpus(first_two + 5, root=tmp_path) == text[:first_two]


def test_stdlib_corpus_names_the_file_of_invalid_utf8_unless_replaced(tmp_path):
    (tmp_path / "a.py").write_bytes(b"x = '\xff'\n")
    with pytest.raises(CorpusDecodeError, match=r"0xff at byte offset 22 \(in the file 'a.py'\)"):
        stdlib_corpus(root=tmp_path)
    assert stdlib_corpus(root=tmp_path, errors="replace") == "# ==== a.py ====\nx = '\ufffd'\n"
    assert stdlib_corpus_bytes(root=tmp_path) == b"# ==== a.py ====\nx = '\xff'\n"


@pytest.mark.parametrize(
    ("max_bytes", "error", "match"),
    [(0, ValueError, "positive"), (-5, ValueError, "positive"), (2.5, TypeError, "int"),
     (True, TypeError, "int"), (10, ValueError, "smaller than the first corpus file")],
)
def test_stdlib_corpus_rejects_bad_max_bytes(max_bytes, error, match):
    with pytest.raises(error, match=match):
        stdlib_corpus(max_bytes)


def test_stdlib_corpus_errors_when_the_stdlib_is_missing(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no .py files"):
        stdlib_corpus(root=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stdlib_corpus(root=tmp_path / "nowhere")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "gone")})
    with pytest.raises(FileNotFoundError, match="cannot locate Python's standard library"):
        stdlib_dir()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {})
    with pytest.raises(FileNotFoundError, match="no 'stdlib' entry"):
        stdlib_corpus()


def test_text_corpus_reads_a_file_and_rejects_missing_or_empty(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("héllo\n")
    assert text_corpus(path) == text_corpus(str(path)) == "héllo\n"
    with pytest.raises(CorpusError, match="missing.txt': does not exist"):
        text_corpus(tmp_path / "missing.txt")
    with pytest.raises(CorpusError, match="is a directory"):
        text_corpus(tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(CorpusError, match="is empty"):
        text_corpus(tmp_path / "empty.txt")


def test_a_binary_corpus_is_an_error_naming_the_first_bad_byte_unless_replaced(tmp_path):
    """Undecodable bytes are an error naming the first bad byte and its offset, unless the corpus
    asks for replacement."""
    path = tmp_path / "corpus.bin"
    path.write_bytes("héllo\n".encode() + b"\xfe" + b"more")
    with pytest.raises(CorpusDecodeError, match="0xfe at byte offset 7") as info:
        text_corpus(path)
    assert info.value.offset == 7 and info.value.path == str(path)
    assert text_corpus(path, errors="replace") == "héllo\n\ufffdmore"
    raw, more = corpus_file_bytes(path, max_bytes=2)  # a limit cutting 'é' in half is not a decode error
    assert (raw, more) == (b"h\xc3", True) and text_corpus(path, max_bytes=2) == "h"
    assert ByteTokenizer().encode_bytes(path.read_bytes())[7].item() == 0xFE  # the byte tokenizer reads bytes


# -------------------------------------------------------------------------------------- tokenizers


@given(st.text())
def test_byte_tokenizer_round_trips_and_encodes_utf8(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids.numpy()) == text
    assert tokenizer.decode(ids.tolist()) == text


@given(any_text.filter(bool))
def test_char_tokenizer_round_trips_any_text(text):
    tokenizer = CharTokenizer.from_text(text)
    assert tokenizer.chars == "".join(sorted(set(text)))
    assert tokenizer.vocab_size == len(set(text))
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.long and ids.shape == (len(text),)
    assert ids.tolist() == [tokenizer.chars.index(c) for c in text]
    assert tokenizer.decode(ids) == text


def test_char_tokenizer_on_non_ascii_text():
    text = "héllo wörld — ∑ 😀 日本語\n\t"
    tokenizer = make_tokenizer("char", text)
    assert tokenizer.vocab_size == len(set(text))
    assert tokenizer.decode(tokenizer.encode("wörld 😀")) == "wörld 😀"
    assert tokenizer.encode("").shape == (0,)
    assert tokenizer.decode(torch.empty(0, dtype=torch.long)) == ""


def test_char_tokenizer_encodes_the_stdlib_corpus(corpus):
    tokenizer = CharTokenizer.from_text(corpus)
    ids = tokenizer.encode(corpus)
    assert ids.numel() == len(corpus)
    assert 90 < tokenizer.vocab_size < 1000
    assert tokenizer.decode(ids[:5000]) == corpus[:5000]
    counts = np.bincount(ids.numpy(), minlength=tokenizer.vocab_size)
    assert (counts > 0).all()


@given(any_text.filter(bool), any_text, st.data())
def test_char_tokenizer_names_the_first_unknown_character(known, extra, data):
    tokenizer = CharTokenizer.from_text(known)
    unknown = [c for c in extra if c not in tokenizer.chars]
    text = data.draw(st.text(alphabet=st.sampled_from(tokenizer.chars))) + extra
    if not unknown:
        assert tokenizer.decode(tokenizer.encode(text)) == text
        return
    position = text.index(unknown[0])
    with pytest.raises(UnknownCharacterError) as info:
        tokenizer.encode(text)
    assert info.value.position == position and info.value.char == unknown[0]
    assert repr(unknown[0]) in str(info.value) and f"position {position}" in str(info.value)


def json_round_trip(tokenizer):
    return tokenizer_from_dict(json.loads(json.dumps(tokenizer.to_dict())))


@given(any_text.filter(bool))
def test_char_tokenizer_description_survives_json(text):
    tokenizer = CharTokenizer.from_text(text)
    restored = json_round_trip(tokenizer)
    assert type(restored) is CharTokenizer and restored == tokenizer
    assert torch.equal(restored.encode(text), tokenizer.encode(text))
    assert CharTokenizer.from_dict(tokenizer.to_dict()) == tokenizer


def test_byte_tokenizer_description_survives_json():
    restored = json_round_trip(ByteTokenizer())
    assert type(restored) is ByteTokenizer and restored.vocab_size == 256
    assert ByteTokenizer.from_dict({"kind": "byte"}) == ByteTokenizer()


def test_byte_tokenizer_decodes_invalid_utf8_with_replacement():
    assert ByteTokenizer().decode([104, 0xFF, 105]) == "h\ufffdi"


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: make_tokenizer("word", "abc"), ValueError, "unknown tokenizer kind 'word'.*'char', 'byte'"),
        (lambda: make_tokenizer("char"), ValueError, "needs the corpus text"),
        (lambda: tokenizer_from_dict({"kind": "bpe"}), ValueError, "unknown tokenizer kind 'bpe'"),
        (lambda: tokenizer_from_dict(["char"]), TypeError, "mapping"),
        (lambda: CharTokenizer.from_dict({"kind": "byte"}), ValueError, "kind='char'"),
        (lambda: CharTokenizer.from_dict({"kind": "char"}), ValueError, "'chars'"),
        (lambda: CharTokenizer.from_text(""), ValueError, "empty"),
        (lambda: CharTokenizer("ba"), ValueError, "sorted"),
        (lambda: CharTokenizer("aab"), ValueError, "unique"),
        (lambda: CharTokenizer(""), ValueError, "at least one"),
        (lambda: CharTokenizer(["a"]), TypeError, "str"),
        (lambda: ByteTokenizer().encode(b"abc"), TypeError, "str"),
        (lambda: CharTokenizer("ab").decode([0, 2]), ValueError, "token id 2 at position 1.*\\[0, 2\\)"),
        (lambda: ByteTokenizer().decode([-1]), ValueError, "token id -1"),
        (lambda: ByteTokenizer().decode(torch.zeros(2, 2, dtype=torch.long)), ValueError, "1-D"),
        (lambda: ByteTokenizer().decode(torch.zeros(2)), TypeError, "integer"),
        (lambda: ByteTokenizer().decode([0.5]), TypeError, "integers"),
    ],
)
def test_tokenizers_reject_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------- windows


@given(st.integers(2, 300), st.integers(1, 40), st.data())
def test_windows_are_shifted_pairs_that_stay_inside_the_stream(num_tokens, seq_len, data):
    if num_tokens < seq_len + 1:
        with pytest.raises(ValueError, match="too short"):
            TokenWindows(torch.arange(num_tokens), seq_len)
        return
    tokens = torch.arange(num_tokens) * 7 + 3  # distinct values, so a window is identified by them
    windows = TokenWindows(tokens, seq_len)
    assert len(windows) == num_tokens - seq_len
    drawn = data.draw(st.lists(st.integers(0, len(windows) - 1), max_size=16))
    starts = torch.tensor(drawn, dtype=torch.long)
    batch = windows.get(starts)
    assert batch["inputs"].shape == batch["targets"].shape == (starts.numel(), seq_len)
    assert batch["inputs"].dtype == batch["targets"].dtype == torch.long
    for row, start in enumerate(starts.tolist()):
        assert torch.equal(batch["inputs"][row], tokens[start : start + seq_len])
        assert torch.equal(batch["targets"][row], tokens[start + 1 : start + seq_len + 1])
    last = windows.get(torch.tensor([len(windows) - 1]))
    assert last["targets"][0, -1] == tokens[-1]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda w: w.get(torch.tensor([6])), ValueError, "window start 6 is out of range.*\\[0, 6\\)"),
        (lambda w: w.get(torch.tensor([-1, 2])), ValueError, "window start -1"),
        (lambda w: w.get(torch.tensor([1.0])), TypeError, "integers"),
        (lambda w: w.get([1, 2]), TypeError, "torch.Tensor"),
        (lambda w: TokenWindows(torch.arange(10), 0), ValueError, "seq_len must be >= 1"),
        (lambda w: TokenWindows(torch.arange(10).reshape(2, 5), 2), ValueError, "1-D"),
        (lambda w: TokenWindows(torch.rand(10), 2), TypeError, "integers"),
        (lambda w: TokenWindows(torch.arange(4), 4), ValueError, "4 tokens, too short.*seq_len \\+ 1 = 5"),
    ],
)
def test_windows_reject_bad_arguments(call, error, match):
    windows = TokenWindows(torch.arange(10), 4)
    with pytest.raises(error, match=match):
        call(windows)


@given(st.integers(4, 1000), st.floats(0.01, 0.99))
def test_split_is_a_contiguous_head_and_tail(num_tokens, val_fraction):
    tokens = torch.arange(num_tokens)
    num_val = round(num_tokens * val_fraction)
    if min(num_val, num_tokens - num_val) < 2:
        with pytest.raises(ValueError, match="each side needs at least min_tokens=2"):
            split_train_val(tokens, val_fraction)
        return
    train, val = split_train_val(tokens, val_fraction)
    assert val.numel() == num_val
    assert torch.equal(torch.cat([train, val]), tokens)


@pytest.mark.parametrize("val_fraction", [0.0, 1.0, -0.1, float("nan"), float("inf")])
def test_split_rejects_fractions_outside_the_open_unit_interval(val_fraction):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        split_train_val(torch.arange(100), val_fraction)


def test_split_checks_each_side_against_min_tokens():
    train, val = split_train_val(torch.arange(100), 0.1, min_tokens=10)
    assert (train.numel(), val.numel()) == (90, 10)
    with pytest.raises(ValueError, match="90 training and 10 validation tokens.*min_tokens=11"):
        split_train_val(torch.arange(100), 0.1, min_tokens=11)


# ---------------------------------------------------------------------------------------- sampler


@given(seeds, steps, st.integers(1, 4), st.integers(1, 8), st.integers(1, 10_000))
def test_rank_shares_concatenate_to_the_single_rank_batch(seed, step, world_size, per_rank, num_windows):
    global_batch = world_size * per_rank
    single = BatchSampler(num_windows, global_batch, seed).starts(step)
    shares = [
        BatchSampler(num_windows, global_batch, seed, rank, world_size).starts(step) for rank in range(world_size)
    ]
    assert all(share.shape == (per_rank,) and share.dtype == torch.long for share in shares)
    assert torch.equal(torch.cat(shares), single)
    assert 0 <= int(single.min()) and int(single.max()) < num_windows


@given(seeds, steps)
def test_sampler_is_a_pure_function_of_seed_and_step(seed, step):
    sampler = BatchSampler(1_000_000, 16, seed)
    first = sampler.starts(step)
    sampler.starts(step + 1)  # no hidden state advances between calls
    assert torch.equal(sampler.starts(step), first)
    assert torch.equal(BatchSampler(1_000_000, 16, seed).starts(step), first)
    assert not torch.equal(sampler.starts(step + 1), first)
    assert not torch.equal(BatchSampler(1_000_000, 16, seed + 1).starts(step), first)


def test_sampler_covers_windows_uniformly():
    counts = torch.zeros(10, dtype=torch.long)
    sampler = BatchSampler(10, 100, seed=0)
    for step in range(100):
        counts += torch.bincount(sampler.starts(step), minlength=10)
    assert counts.sum() == 10_000
    assert int(counts.min()) > 850 and int(counts.max()) < 1150  # ~7 standard deviations


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(world_size=0), ValueError, "world_size must be >= 1, got 0"),
        (dict(rank=2, world_size=2), ValueError, "rank must be in \\[0, world_size=2\\), got rank=2"),
        (dict(rank=-1, world_size=2), ValueError, "got rank=-1"),
        (dict(global_batch_size=6, world_size=4), ValueError, "global_batch_size=6 is not divisible by world_size=4"),
        (dict(global_batch_size=0), ValueError, "global_batch_size must be >= 1"),
        (dict(num_windows=0), ValueError, "num_windows must be >= 1"),
        (dict(seed=1.5), TypeError, "seed must be an int"),
        (dict(rank=True), TypeError, "rank must be an int, got bool"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, error, match):
    arguments = dict(num_windows=100, global_batch_size=8, seed=0) | kwargs
    with pytest.raises(error, match=match):
        BatchSampler(**arguments)


def test_sampler_rejects_negative_steps_and_normalises_ints():
    sampler = BatchSampler(np.int64(100), 8, np.int32(3))
    assert type(sampler.num_windows) is int and type(sampler.seed) is int
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        sampler.starts(-1)


# ----------------------------------------------------------------------------------------- loader


def make_loader(num_tokens=500, seq_len=8, global_batch=8, seed=0, rank=0, world_size=1) -> Loader:
    windows = TokenWindows(torch.arange(num_tokens), seq_len)
    return Loader(windows, BatchSampler(len(windows), global_batch, seed, rank, world_size))


def test_loader_batch_is_the_sampled_windows():
    loader = make_loader()
    batch = loader.batch(3)
    starts = loader.sampler.starts(3)
    assert torch.equal(batch["inputs"][:, 0], starts)
    assert torch.equal(batch["targets"], batch["inputs"] + 1)


def test_iteration_resumes_exactly_from_any_step():
    loader = make_loader()
    run = [batch for _, batch in zip(range(10), loader)]
    resumed = [batch for _, batch in zip(range(4), make_loader().iterate(start_step=6))]
    for expected, actual in zip(run[6:], resumed, strict=True):
        assert torch.equal(expected["inputs"], actual["inputs"])
        assert torch.equal(expected["targets"], actual["targets"])
    assert all(torch.equal(run[step]["inputs"], loader.batch(step)["inputs"]) for step in range(10))


@given(st.integers(1, 4), st.integers(0, 50), st.integers(0, 2**32))
def test_rank_loaders_together_give_the_single_process_batch(world_size, step, seed):
    single = make_loader(global_batch=4 * world_size, seed=seed)
    ranks = [
        make_loader(global_batch=4 * world_size, seed=seed, rank=r, world_size=world_size) for r in range(world_size)
    ]
    for key in ("inputs", "targets"):
        assert torch.equal(torch.cat([loader.batch(step)[key] for loader in ranks]), single.batch(step)[key])
    single_eval = single.eval_batches(3)
    rank_evals = [loader.eval_batches(3) for loader in ranks]
    for index, expected in enumerate(single_eval):
        assert torch.equal(torch.cat([evals[index]["inputs"] for evals in rank_evals]), expected["inputs"])


def test_eval_batches_are_fixed_distinct_and_independent_of_training():
    loader = make_loader(seed=5)
    first, again = loader.eval_batches(4), loader.eval_batches(4)
    assert all(torch.equal(a["inputs"], b["inputs"]) for a, b in zip(first, again, strict=True))
    starts = torch.cat([batch["inputs"][:, 0] for batch in first])
    assert starts.unique().numel() == 32  # 32 <= 492 windows: drawn without replacement
    assert not torch.equal(first[0]["inputs"], loader.batch(0)["inputs"])
    other_seed = loader.eval_batches(4, seed=6)
    assert not torch.equal(first[0]["inputs"], other_seed[0]["inputs"])


@given(st.integers(1, 50), st.integers(1, 8), st.integers(1, 8), seeds)
def test_eval_starts_shape_range_and_determinism(num_windows, batch_size, num_batches, seed):
    starts = eval_starts(num_windows, batch_size, num_batches, seed)
    assert starts.shape == (num_batches, batch_size) and starts.dtype == torch.long
    assert 0 <= int(starts.min()) and int(starts.max()) < num_windows
    assert torch.equal(starts, eval_starts(num_windows, batch_size, num_batches, seed))
    if batch_size * num_batches <= num_windows:
        assert starts.unique().numel() == starts.numel()


def test_loader_rejects_mismatched_parts():
    windows = TokenWindows(torch.arange(100), 9)
    with pytest.raises(ValueError, match="sampler.num_windows=90 does not match the 91 windows"):
        Loader(windows, BatchSampler(90, 4, 0))
    with pytest.raises(TypeError, match="TokenWindows"):
        Loader(torch.arange(100), BatchSampler(91, 4, 0))
    with pytest.raises(ValueError, match="start_step must be >= 0"):
        next(make_loader().iterate(-1))
    with pytest.raises(ValueError, match="num_batches must be >= 1"):
        make_loader().eval_batches(0)
