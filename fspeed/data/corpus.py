"""Text corpora that need no download: the running interpreter's standard library, or a user file.

The default training job learns from Python's own standard-library source. It is read at run time
from the interpreter that runs fspeed (a venv finds its base interpreter's stdlib), so the corpus
is deterministic for a given Python build and costs nothing to fetch.
"""

from __future__ import annotations

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


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, *, root: str | os.PathLike[str] | None = None) -> str:
    """The standard library's ``.py`` source, concatenated deterministically, at most ``max_bytes``.

    Files come in ``stdlib_files`` order, each after a ``# ==== relative/path.py ====`` header line.
    The corpus is cut on a file boundary: it stops before the first file that would take it past
    ``max_bytes`` (counted in bytes on disk, headers included). Bytes are decoded as UTF-8 with
    ``errors="replace"``. ``root`` overrides the stdlib directory (defaults to ``stdlib_dir()``).
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise TypeError(f"max_bytes must be an int, got {type(max_bytes).__name__} {max_bytes!r}")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
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
    return b"".join(chunks).decode("utf-8", errors="replace")


def text_corpus(path: str | os.PathLike[str]) -> str:
    """The text of a user's UTF-8 file (undecodable bytes become U+FFFD); errors if missing or empty."""
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"corpus file {str(file)!r} does not exist")
    if file.is_dir():
        raise IsADirectoryError(f"corpus path {str(file)!r} is a directory, not a text file")
    if not file.is_file():
        raise ValueError(f"corpus path {str(file)!r} is not a regular file")
    text = file.read_bytes().decode("utf-8", errors="replace")
    if not text:
        raise ValueError(f"corpus file {str(file)!r} is empty; a corpus needs at least one character")
    return text
