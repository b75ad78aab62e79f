"""meta.json: what a checkpoint holds besides tensors, with a schema and its own checksum.

    format        "fspeed-checkpoint/3"
    tag, step     the checkpoint's name and the state's step
    precision     the precision policy's name (fp32, bf16, fp16)
    scalars       the state's non-tensor leaves by tree path (counters, loss scaler, lrs)
    client_state  the user's client_state as JSON (tensors replaced by references into a tensor file)
    files         name -> {bytes, sha256} of every tensor file
    layout        (sharded states) what must match for each rank's file to fit: stage, mesh, params
    client_file   (sharded states) the file holding client_state's tensors
    index         (sharded states, format 3) per tensor key its global shape, dtype and saved boxes:
                  {"shape", "dtype", "chunks": [[file, name, start, shape, rank], ...]} (`universal`)
    meta_sha256   sha256 of all of the above, in canonical JSON

Reading checks the checksum, then every field's type, and names the file and the field on any
problem. Format 1 (before the checksum) is still read, without that check; format 2's sharded
checkpoints (one file per rank, no index) load only into their own layout.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

from .errors import CheckpointError

FORMAT = "fspeed-checkpoint/3"
READABLE_FORMATS = ("fspeed-checkpoint/1", "fspeed-checkpoint/2", FORMAT)
META_FILE = "meta.json"
CHECKSUM_FIELD = "meta_sha256"
_SCALAR_TYPES = (bool, int, float, str, type(None))


def _digest(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_meta(directory: Path, meta: dict) -> None:
    """Write `meta` with its checksum to `directory/meta.json`, fsynced."""
    body = {**meta, CHECKSUM_FIELD: _digest(meta)}
    with open(directory / META_FILE, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_meta_file(path: Path) -> dict:
    """The validated meta.json of the checkpoint directory `path` (CheckpointError naming the file)."""
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path} is missing: {path} is not a complete fspeed checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is truncated or corrupted ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{meta_path} cannot be read ({e.strerror or e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path} is corrupted: it holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{meta_path}: unknown format {meta.get('format')!r}; this fspeed reads "
                              f"{', '.join(READABLE_FORMATS)}")
    if meta["format"] != READABLE_FORMATS[0]:
        claimed = meta.pop(CHECKSUM_FIELD, None)
        if claimed is None:
            raise CheckpointError(f"{meta_path} lacks its checksum field {CHECKSUM_FIELD!r}")
        if claimed != _digest(meta):
            raise CheckpointError(f"{meta_path} is corrupted: its content does not match the checksum "
                                  "recorded at save time")
    _check_schema(meta, meta_path)
    return meta


# ------------------------------------------------------------------------------ schema

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, _SCALAR_TYPES)


def _is_file_name(v: Any) -> bool:
    return isinstance(v, str) and bool(v) and "/" not in v and "\\" not in v and v not in (".", "..")


def _is_file_info(v: Any) -> bool:
    return (isinstance(v, dict) and set(v) == {"bytes", "sha256"} and _is_int(v["bytes"]) and v["bytes"] >= 0
            and isinstance(v["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) is not None)


def _is_layout(v: Any) -> bool:
    return (isinstance(v, dict) and set(v) == {"stage", "mesh", "params", "sharded_units"} and _is_int(v["stage"])
            and isinstance(v["mesh"], dict) and all(_is_int(s) for s in v["mesh"].values())
            and isinstance(v["params"], dict) and isinstance(v["sharded_units"], dict))


def _is_chunk(c: Any) -> bool:
    return (isinstance(c, list) and len(c) == 5 and _is_file_name(c[0]) and isinstance(c[1], str)
            and all(isinstance(x, list) and all(_is_int(i) and i >= 0 for i in x) for x in c[2:4])
            and len(c[2]) == len(c[3]) and _is_int(c[4]) and c[4] >= -1)


def _is_index(v: Any) -> bool:
    from .tensor_file import SAFETENSORS_DTYPES

    dtypes = set(SAFETENSORS_DTYPES.values())
    return isinstance(v, dict) and all(
        isinstance(e, dict) and set(e) == {"shape", "dtype", "chunks"} and isinstance(e["shape"], list)
        and all(_is_int(n) and n >= 0 for n in e["shape"]) and e["dtype"] in dtypes
        and isinstance(e["chunks"], list) and all(_is_chunk(c) for c in e["chunks"])
        for e in v.values())


def _dict_of(check: Callable[[Any], bool], keys: Callable[[Any], bool] = lambda k: isinstance(k, str)):
    return lambda v: isinstance(v, dict) and all(keys(k) and check(x) for k, x in v.items())


# field -> (required, check, what it must be)
_SCHEMA: dict[str, tuple[bool, Callable[[Any], bool], str]] = {
    "format": (True, lambda v: v in READABLE_FORMATS, "a known format"),
    "tag": (True, lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "step": (True, lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "precision": (True, lambda v: isinstance(v, str) and bool(v), "a precision name (a string)"),
    "scalars": (True, _dict_of(_is_scalar), "an object of numbers, strings, booleans or nulls"),
    "client_state": (True, lambda v: isinstance(v, dict), "an object"),
    "files": (True, lambda v: _dict_of(_is_file_info, _is_file_name)(v) and bool(v),
              "a non-empty object of file name -> {bytes, sha256}"),
    "layout": (False, _is_layout, "an object with stage, mesh, params, sharded_units"),
    "client_file": (False, _is_file_name, "a file name"),
    "index": (False, _is_index, "an object of tensor key -> {shape, dtype, chunks}"),
}


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_schema(meta: dict, meta_path: Path) -> None:
    unknown = sorted(set(meta) - set(_SCHEMA))
    if unknown:
        raise CheckpointError(f"{meta_path}: unknown field(s) {unknown}; allowed: {', '.join(_SCHEMA)}")
    for name, (required, check, what) in _SCHEMA.items():
        if name not in meta:
            if required:
                raise CheckpointError(f"{meta_path}: field {name!r} is missing")
            continue
        if not check(meta[name]):
            raise CheckpointError(f"{meta_path}: field {name!r} must be {what}, got "
                                  f"{type(meta[name]).__name__} {_shown(meta[name])}")
    if "step" in meta["scalars"] and meta["scalars"]["step"] != meta["step"]:
        raise CheckpointError(f"{meta_path}: field 'step' ({meta['step']}) disagrees with scalars.step "
                              f"({_shown(meta['scalars']['step'])})")
    if ("layout" in meta) != ("client_file" in meta):
        raise CheckpointError(f"{meta_path}: fields 'layout' and 'client_file' go together (a sharded checkpoint)")
    if "index" in meta:
        unlisted = sorted({c[0] for e in meta["index"].values() for c in e["chunks"]} - set(meta["files"]))
        if unlisted:
            raise CheckpointError(f"{meta_path}: field 'index' names file(s) {unlisted[:3]} that are not among its "
                                  "files")
    if "client_file" in meta and meta["client_file"] not in meta["files"]:
        raise CheckpointError(f"{meta_path}: field 'client_file' names {meta['client_file']!r}, which is not "
                              "among its files")


def verify_files(path: Path, meta: dict, names: list[str]) -> None:
    """Check that each named file of `meta` exists under `path` with its recorded size and sha256."""
    from .tensor_file import sha256_of

    for name in names:
        info = meta["files"].get(name)
        file = path / name
        if info is None:
            raise CheckpointError(f"{path / META_FILE} records no file {name!r} (it lists {sorted(meta['files'])})")
        if not file.exists():
            raise CheckpointError(f"{file} is missing")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{file} is truncated or corrupted: {size} bytes, expected {info['bytes']}")
        if sha256_of(file) != info["sha256"]:
            raise CheckpointError(f"{file} is corrupted: its sha256 does not match the one recorded at save time")
