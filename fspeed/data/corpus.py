"""Text corpora that need no download: the running interpreter's standard library, or a user file.

The default training job learns from Python's own standard-library source. It is read at run time
from the interpreter that runs fspeed (a venv finds its base interpreter's stdlib), so the corpus
is deterministic for a given Python build and costs nothing to fetch.

A corpus is read as bytes (what the byte tokenizer trains on, as they are) and decoded as strict
UTF-8 for text: a binary file is an error naming the first bad byte's offset, unless invalid
bytes are asked to become U+FFFD (``errors="replace"``).
"""

from __future__ import annotations

import codecs
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

DEFAULT_MAX_BYTES = 4_000_000

# Directories skipped when the corpus has to reach below the top level: third-party code,
# and test suites (they hold deliberately malformed and oddly encoded files).
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_dir() -> Path:
    """The directory of this interpreter's standard library, or FileNotFoundError saying why not."""
    location = sysconfig.get_paths().get("stdlib")
    if not location:
        raise FileNotFoundError(
            "cannot locate Python's standard library: sysconfig.get_paths() has no 'stdlib' entry; "
            "pass a text file with text_corpus(path) instead"
        )
    root = Path(location)
    if not root.is_dir():
        raise FileNotFoundError(
            f"cannot locate Python's standard library: sysconfig says {str(root)!r}, which is not a "
            "directory (a frozen or zipped Python?); pass a text file with text_corpus(path) instead"
        )
    return root


def stdlib_files(root: Path) -> Iterator[Path]:
    """The corpus files under ``root`` in corpus order.

    First the top-level modules sorted by name, then (only when a caller reads that far) the
    modules of packages sorted by relative POSIX path, skipping third-party and test directories.
    """
    top_level = sorted(
        (entry.name for entry in os.scandir(root) if entry.name.endswith(".py") and entry.is_file()),
    )
    for name in top_level:
        yield root / name
    nested: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        relative_dir = Path(directory).relative_to(root)
        if relative_dir == Path("."):
            continue
        nested.extend((relative_dir / f).as_posix() for f in files if f.endswith(".py"))
    for relative in sorted(nested):
        yield root / relative


def _file_chunk(root: Path, path: Path) -> bytes:
    """One file's bytes preceded by a header naming it, ending in a newline."""
    content = path.read_bytes()
    if not content.endswith(b"\n"):
        content += b"\n"
    header = f"# ==== {path.relative_to(root).as_posix()} ====\n".encode()
    return header + content


class CorpusError(ValueError):
    """A corpus that cannot be used: missing, not a regular file, empty, or (for text) not UTF-8.

    `path` is the corpus as the user named it, `reason` what is wrong with it.
    """

    def __init__(self, path: str, reason: str, hint: str | None = None):
        self.path, self.reason = path, reason
        super().__init__(f"corpus {path!r}: {reason}" + (f"; {hint}" if hint else ""))


class CorpusDecodeError(CorpusError):
    """A corpus that is not valid UTF-8; `offset` is the first bad byte's (in the bytes read)."""

    def __init__(self, path: str, offset: int, byte: int, where: str = ""):
        self.offset = offset
        super().__init__(path, f"is not valid UTF-8: the first bad byte is 0x{byte:02x} at byte offset {offset}{where} "
                               "(a binary file?)", "read it as bytes (the byte tokenizer) or decode invalid bytes as "
                               "U+FFFD (errors='replace')")


def _check_max_bytes(max_bytes: int | None, *, allow_none: bool) -> None:
    if max_bytes is None and allow_none:
        return
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise TypeError(f"max_bytes must be an int, got {type(max_bytes).__name__} {max_bytes!r}")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")


_ERRORS = ("strict", "replace")


def decode_corpus(raw: bytes, path: str, *, errors: str = "strict", truncated: bool = False) -> str:
    """``raw`` decoded as UTF-8. ``errors="strict"`` raises CorpusDecodeError naming the first bad
    byte's offset; ``"replace"`` decodes bad bytes as U+FFFD. When ``truncated`` (the bytes were
    cut at a limit), a character cut in half at the end is dropped rather than called invalid."""
    if errors not in _ERRORS:
        raise ValueError(f"errors={errors!r}; allowed: {', '.join(map(repr, _ERRORS))}")
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    try:
        return decoder.decode(raw, final=not truncated)
    except UnicodeDecodeError as e:
        raise CorpusDecodeError(path, e.start, raw[e.start]) from None


def stdlib_corpus_bytes(max_bytes: int = DEFAULT_MAX_BYTES, *, root: str | os.PathLike[str] | None = None) -> bytes:
    """The standard library's ``.py`` source as bytes, concatenated deterministically, at most ``max_bytes``.

    Files come in ``stdlib_files`` order, each after a ``# ==== relative/path.py ====`` header line.
    The corpus is cut on a file boundary: it stops before the first file that would take it past
    ``max_bytes`` (counted in bytes on disk, headers included). ``root`` overrides the stdlib
    directory (defaults to ``stdlib_dir()``).
    """
    _check_max_bytes(max_bytes, allow_none=False)
    base = stdlib_dir() if root is None else Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"standard-library directory {str(base)!r} does not exist")

    chunks: list[bytes] = []
    total = 0
    first_skipped: tuple[Path, int] | None = None
    for path in stdlib_files(base):
        chunk = _file_chunk(base, path)
        if total + len(chunk) > max_bytes:
            first_skipped = (path, len(chunk))
            break
        chunks.append(chunk)
        total += len(chunk)

    if not chunks:
        if first_skipped is None:
            raise FileNotFoundError(f"no .py files found in the standard-library directory {str(base)!r}")
        path, size = first_skipped
        raise ValueError(
            f"max_bytes={max_bytes} is smaller than the first corpus file {path.name!r} "
            f"({size} bytes with its header); use max_bytes >= {size}"
        )
    return b"".join(chunks)


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, *, root: str | os.PathLike[str] | None = None,
                  errors: str = "strict") -> str:
    """``stdlib_corpus_bytes`` decoded as UTF-8 (``errors`` as in ``decode_corpus``; a bad byte's
    error names the file holding it)."""
    raw = stdlib_corpus_bytes(max_bytes, root=root)
    try:
        return decode_corpus(raw, "stdlib", errors=errors)
    except CorpusDecodeError as e:
        start = raw.rfind(b"\n# ==== ", 0, e.offset) + 1
        header = raw[start:raw.index(b"\n", start)].decode("utf-8", "replace")
        raise CorpusDecodeError("stdlib", e.offset, raw[e.offset], f" (in the file {header[7:-5]!r})") from None


def corpus_file_bytes(path: str | os.PathLike[str], max_bytes: int | None = None) -> tuple[bytes, bool]:
    """(the first ``max_bytes`` bytes of a user's corpus file, whether it holds more); CorpusError
    if the path is missing, not a regular file, unreadable or empty."""
    _check_max_bytes(max_bytes, allow_none=True)
    file = Path(path)
    name = str(path)
    if not file.exists():
        raise CorpusError(name, "does not exist")
    if file.is_dir():
        raise CorpusError(name, "is a directory, not a text file")
    if not file.is_file():
        raise CorpusError(name, "is not a regular file")
    try:
        with open(file, "rb") as f:
            raw = f.read(max_bytes if max_bytes is not None else -1)
            more = max_bytes is not None and bool(f.read(1))
    except OSError as e:
        raise CorpusError(name, f"cannot be read: {e.strerror or e}") from None
    if not raw:
        raise CorpusError(name, "is empty; a corpus needs at least one character")
    return raw, more


def text_corpus(path: str | os.PathLike[str], *, max_bytes: int | None = None, errors: str = "strict") -> str:
    """The text of a user's UTF-8 file (at most ``max_bytes`` of it); CorpusError if it is missing,
    empty or (with ``errors="strict"``) not valid UTF-8, naming the first bad byte's offset."""
    raw, truncated = corpus_file_bytes(path, max_bytes)
    return decode_corpus(raw, str(path), errors=errors, truncated=truncated)
