"""The checkpoint directory: tags, `latest`, atomic publishing, recovery, cleanup and retention.

    dir/latest                       the name of the newest complete checkpoint
    dir/<tag>/                       one complete checkpoint (meta.json and tensor files)
    dir/.<tag>.tmp-<random>/         a save in progress (renamed to <tag> when complete)
    dir/.<tag>.old-<random>/<tag>/   the old copy of a tag being overwritten, for an instant

A save writes into a temporary directory, renames it into place and then replaces `latest`
atomically, so a crash at any moment leaves `latest` naming a complete checkpoint. A crash can
leave temporary entries behind: `tidy` removes them (and puts back an old copy whose overwrite
was interrupted), logging each, at the next save or load. A save holds an advisory lock (flock)
on each temporary entry while it uses it, and `tidy` leaves locked entries alone: an evaluation
job loading from the directory never removes the files of a save in progress. The kernel drops
the locks of a process that dies, so a crashed save's leftovers are free to go. Directories and
files are created with the process's umask, like every other file (a team's checkpoints stay
readable).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from .errors import CheckpointError, os_error_text, os_reason
from .meta import META_FILE

log = logging.getLogger("fspeed")

LATEST_FILE = "latest"
_STALE = re.compile(r"^\.(?P<tag>.+)\.(?P<kind>tmp|old)-[0-9a-z_]+$")
_STALE_FILE = re.compile(r"^\.(latest\.tmp|preflight)-.+$")
_DEFAULT_TAG = re.compile(r"^global_step(\d+)$")


def check_tag(tag: str) -> str:
    """`tag` if it is a plain directory name that does not start with '.'; ValueError otherwise."""
    if not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag or "\\" in tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a non-empty name without '/' that does not start with '.'")
    return tag


def ensure_directory(directory: Path) -> None:
    """Create `directory` (and its parents) if needed; CheckpointError naming it if that fails."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} is a regular file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        where = "" if e.filename in (None, str(directory)) else f" ({e.filename!r})"
        raise CheckpointError(f"cannot create the checkpoint directory {str(directory)!r}: {os_reason(e)}{where}") from None


def unique_name(directory: Path, prefix: str) -> Path:
    """A path `directory/<prefix><random>` that does not exist yet."""
    while True:
        path = directory / f"{prefix}{secrets.token_hex(4)}"
        if not os.path.lexists(path):
            return path


def _new_dir(directory: Path, prefix: str) -> Path:
    """A new directory `directory/<prefix><random>` (mode from the umask, unlike mkdtemp's 0700)."""
    while True:
        path = unique_name(directory, prefix)
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def lock(path: Path) -> Optional[int]:
    """Hold an exclusive advisory lock on `path` (a file or directory): its descriptor, to `unlock`;
    None where the filesystem has no locks (then `tidy` of another process cannot see it in use)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def unlock(fd: Optional[int]) -> None:
    if fd is not None:
        os.close(fd)


def _in_use(path: str) -> bool:
    """Whether a live save holds `path`'s lock (also True, logged, where locks cannot be tested)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError as e:
        log.warning("cannot tell whether %s belongs to a save in progress (%s); left in place", path,
                    e.strerror or e)
        return True
    finally:
        os.close(fd)


def _try_lock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # a filesystem without locks: the entry is merely not protected from `tidy`


@contextmanager
def temp_dir(directory: Path, tag: str) -> Iterator[Path]:
    """A new locked `.<tag>.tmp-<random>` directory for a save; removed on exit unless published."""
    path = _new_dir(directory, f".{tag}.tmp-")
    fd = lock(path)
    try:
        yield path
    finally:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
        unlock(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(directory: Path, tmp: Path, tag: str) -> Path:
    """Rename the complete `tmp` to `directory/tag`, replacing an existing tag atomically."""
    fsync_dir(tmp)
    final = directory / tag
    if not final.exists():
        os.rename(tmp, final)
        fsync_dir(directory)
        return final
    old = _new_dir(directory, f".{tag}.old-")
    fd = lock(old)
    try:
        os.rename(final, old / tag)
        os.rename(tmp, final)
        fsync_dir(directory)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        unlock(fd)
    return final


def write_latest(directory: Path, tag: str) -> None:
    """Point `directory/latest` at `tag`, atomically."""
    tmp = unique_name(directory, ".latest.tmp-")
    with open(tmp, "x") as f:
        _try_lock(f.fileno())
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, directory / LATEST_FILE)
    fsync_dir(directory)


def latest_tag(directory: str | os.PathLike) -> Optional[str]:
    """The tag `directory/latest` points to, or None when there is no checkpoint."""
    path = Path(directory) / LATEST_FILE
    if not path.exists():
        return None
    try:
        tag = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is corrupted: it is not text; it should hold the latest checkpoint's tag") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {os_error_text(e, path)}") from None
    if not tag:
        raise CheckpointError(f"{path} is empty; it should name the latest checkpoint tag")
    try:
        return check_tag(tag)
    except ValueError:
        raise CheckpointError(f"{path} is corrupted: {tag[:80]!r} is not a checkpoint tag") from None


def checkpoint_path(directory: Path, tag: str) -> Path:
    """Where the checkpoint `tag` lives: `directory/tag`, or the old copy of an interrupted overwrite."""
    path = directory / tag
    if path.is_dir():
        return path
    for candidate in sorted(directory.glob(f".{glob_escape(tag)}.old-*/{glob_escape(tag)}")):
        if (candidate / META_FILE).exists():
            return candidate
    raise CheckpointError(f"checkpoint {path} does not exist")


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def tidy(directory: Path) -> None:
    """Finish what crashed saves left: put back the old copy of an interrupted overwrite, remove
    temporary directories and files. Best effort (a read-only directory is left as it is); logs each."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        try:
            stale = _STALE.match(entry.name)
            if (stale or _STALE_FILE.match(entry.name)) and _in_use(entry.path):
                continue  # a save in progress (this or another process) holds it
            if stale and entry.is_dir(follow_symlinks=False):
                tag = stale["tag"]
                old_copy = Path(entry.path) / tag
                if stale["kind"] == "old" and not (directory / tag).exists() and (old_copy / META_FILE).exists():
                    os.rename(old_copy, directory / tag)
                    log.warning("checkpoint %s: restored its previous copy from %s (a save overwriting it was "
                                "interrupted)", directory / tag, entry.name)
                shutil.rmtree(entry.path)
                log.warning("checkpoint directory %s: removed %s, left by an interrupted save", directory, entry.name)
            elif _STALE_FILE.match(entry.name) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                log.warning("checkpoint directory %s: removed %s, left by an interrupted save", directory, entry.name)
        except OSError as e:
            log.warning("checkpoint directory %s: could not clean up %s (%s)", directory, entry.name, e.strerror or e)


def remove_old_checkpoints(directory: Path, keep_last: int, keep: str) -> list[str]:
    """Delete `global_step<N>` checkpoints but the `keep_last` newest (by N) and `keep`; other tags
    are never touched. Returns the removed tags (each logged)."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    steps = sorted((int(m[1]), e.name) for e in os.scandir(directory)
                   if (m := _DEFAULT_TAG.match(e.name)) and e.is_dir(follow_symlinks=False))
    removed = []
    for _, tag in steps[:-keep_last]:
        if tag == keep:
            continue
        # move it aside first: a crash mid-delete leaves a temporary directory, never half a checkpoint
        aside = unique_name(directory, f".{tag}.old-")
        os.rename(directory / tag, aside)
        fd = lock(aside)
        shutil.rmtree(aside, ignore_errors=True)
        unlock(fd)
        removed.append(tag)
        log.info("keep_last=%d: removed the checkpoint %s", keep_last, directory / tag)
    return removed
