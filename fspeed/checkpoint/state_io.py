"""Saving and loading a whole TrainState plus the user's client_state under `dir/tag/`.

Layout of `dir/tag/`:

    tensors.safetensors   every tensor, keyed by tree path and parameter path
                          (`params/blocks.0.attn.wqkv`, `opt_state.1.mu/blocks.0.attn.wqkv`)
    meta.json             format, step, precision, the non-tensor leaves by path, client_state
                          (tensors replaced by references), file sizes and sha256 (see `meta`)

A sharded state (a ZeRO / tensor-slicing plan over several ranks) is saved by every rank
together (`mesh=`): each rank streams the boxes of global tensors it holds to
`rank_00000.safetensors`, ... (a box several ranks hold equally is written once; padding never),
and `meta.json`'s `index` says which box of which tensor is where (`universal`). Any checkpoint
loads into any plan on any mesh, or into one process: each rank reads only the slices it needs.
State that belongs to one rank (1-bit error buffers) is reset, with a warning, in another layout.

A save is refused when a tensor holds inf/NaN (a diverged state never becomes `latest`), and a
failed save (a full disk, a failing rank) raises a CheckpointError naming the path and the cause
while `latest` keeps naming the previous checkpoint (see `directory` for the atomic protocol).
Loading runs no pickle, verifies meta.json and every file's checksum, and fills a template state
by path: shapes and dtypes must match, with one explicit conversion: a bf16/fp16 compute copy is
cast from saved fp32 weights when the checkpoint comes from another precision (logged; the saved
loss scaler then does not replace the template's).
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..flat import Flat
from ..pytree import tree_flatten_with_paths, tree_unflatten
from ..train_state import TrainState
from .async_save import AsyncSave, host_copy
from .directory import (
    LATEST_FILE, check_tag, checkpoint_path, ensure_directory, latest_tag, publish, remove_old_checkpoints, temp_dir,
    tidy, write_latest,
)
from .errors import CheckpointError, os_error_text
from .meta import FORMAT, META_FILE, read_meta_file, verify_files, write_meta
from .tensor_file import nonfinite_keys, open_tensor_file, write_tensor_file
from .universal import (
    CAST_FROM_FP32, ChunkReader, assign_chunks, build_index, chunk_tensors, describe, file_index, fill_from_index,
    saved_sources, state_slots,
)

log = logging.getLogger("fspeed")

TENSORS_FILE = "tensors.safetensors"
_SCALARS = (bool, int, float, str, type(None))


def state_entries(state: TrainState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by key, non-tensor leaves by path) of a TrainState; Flats expand per parameter."""
    paths, leaves, _ = tree_flatten_with_paths(state, is_leaf=lambda x: isinstance(x, Flat))
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, Flat):
            for param_path, view in leaf.items():
                tensors[f"{path}/{param_path}"] = view
        elif isinstance(leaf, torch.Tensor):
            tensors[path] = leaf
        elif isinstance(leaf, _SCALARS):
            scalars[path] = leaf
        else:
            raise TypeError(f"cannot checkpoint state leaf {path!r} of type {type(leaf).__name__}")
    return tensors, scalars


def _split_client_state(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON form of client_state; tensors move to `tensors` under `client_state/<path>`."""
    if isinstance(value, torch.Tensor):
        key = f"client_state/{path}"
        tensors[key] = value.detach().contiguous()
        return {"__tensor__": key}
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise TypeError(f"client_state keys must be strings; {path or 'the root'} has key {k!r}")
        return {k: _split_client_state(v, f"{path}.{k}" if path else k, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split_client_state(v, f"{path}.{i}" if path else str(i), tensors) for i, v in enumerate(value)]
    if isinstance(value, float) and value != value:
        return {"__float__": "nan"}
    if isinstance(value, _SCALARS):
        return value
    raise TypeError(
        f"client_state value at {path or 'the root'!r} is a {type(value).__name__}; allowed: tensors, "
        "dicts with str keys, lists, tuples, str, int, float, bool, None"
    )


def _join_client_state(value: Any, reader, file: Path) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            try:
                return reader.get_tensor(value["__tensor__"]).clone()
            except Exception as e:  # safetensors' own error types
                raise CheckpointError(f"{file}: cannot read client_state tensor {value['__tensor__']!r} ({e})") from None
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _join_client_state(v, reader, file) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_client_state(v, reader, file) for v in value]
    return value


def is_sharded(state: TrainState, mesh, what: str) -> bool:
    """Whether `state` lives on several ranks (then each rank keeps its own file)."""
    if math.prod(size for _, size in state.layout.mesh_sizes) == 1:
        return False
    if mesh is None:
        raise ValueError(f"{what}: this state is sharded (zero stage {state.layout.stage} on mesh "
                         f"{dict(state.layout.mesh_sizes)}); pass mesh= so that every rank takes part")
    return True


def _meta(tag: str, state: TrainState, scalars: dict, client_json: Any, files: dict) -> dict:
    return {"format": FORMAT, "tag": tag, "step": state.step, "precision": state.precision.name,
            "scalars": scalars, "client_state": client_json, "files": files}


def _still_latest(directory: Path) -> str:
    try:
        previous = latest_tag(directory)
    except CheckpointError:
        previous = None
    return f"'latest' still names {previous} (untouched)" if previous else "there is no earlier checkpoint"


def _save_failed(directory: Path, tag: str, cause: str) -> str:
    return f"saving checkpoint {directory / tag} failed: {cause}; {_still_latest(directory)}"


def _nonfinite_cause(keys: list[str]) -> str:
    return (f"{len(keys)} tensor(s) hold inf or NaN (e.g. {', '.join(keys[:3])}): a diverged state is never "
            "published")


def _retain(directory: Path, keep_last: int, tag: str) -> None:
    """Apply keep_last after a successful save; a failure to delete is logged, not raised."""
    if not keep_last:
        return
    try:
        remove_old_checkpoints(directory, keep_last, keep=tag)
    except OSError as e:
        log.warning("keep_last=%d: could not remove old checkpoints in %s (%s)", keep_last, directory,
                    os_error_text(e, directory))


def save_checkpoint(
    directory: str | os.PathLike,
    state: TrainState,
    *,
    tag: Optional[str] = None,
    client_state: Optional[dict] = None,
    save_latest: bool = True,
    mesh=None,
    keep_last: int = 0,
    blocking: bool = True,
) -> Path | AsyncSave:
    """Save `state` (and `client_state`) atomically under `directory/tag`; returns that path.

    `tag` defaults to `global_step{state.step}` as in DeepSpeed. Saving over an existing tag
    replaces it atomically as well. A sharded state (built with a plan on a mesh of several
    ranks) needs `mesh=`: a collective, every rank writes its own file into the same directory
    (a filesystem all ranks share), rank 0 writes the metadata once every file is on disk.
    `keep_last=N` (N >= 1) then deletes all but the N newest `global_step<N>` checkpoints (other
    tags are never deleted). Raises CheckpointError (naming the path and the cause) when the save
    fails or a tensor is not finite; `latest` then still names the previous checkpoint.
    `blocking=False` returns an `AsyncSave` once the state is copied to host memory; a thread
    writes the same files while training goes on, and its `wait()` returns the path or raises
    the save's error (see `async_save`).
    """
    directory = Path(directory)
    tag = check_tag(tag or f"global_step{state.step}")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"keep_last={keep_last!r} must be an integer >= 0 (0 keeps every checkpoint)")
    sharded = is_sharded(state, mesh, "save_checkpoint")
    if blocking:
        return _save(directory, state, tag, client_state, save_latest, mesh if sharded else None, keep_last)
    _split_client_state(client_state or {}, "", {})  # a client_state that cannot be saved fails here, not later
    state, client_state = host_copy(state), host_copy(client_state)
    gather = mesh.background_gather() if sharded else None
    return AsyncSave(lambda: _save(directory, state, tag, client_state, save_latest, mesh if sharded else None,
                                   keep_last, gather), directory / tag)


def _save(directory: Path, state: TrainState, tag: str, client_state: Optional[dict], save_latest: bool,
          mesh, keep_last: int, gather: Optional[Callable[[Any, str], list]] = None) -> Path:
    """The save itself: a sharded state's with `mesh` (its collectives through `gather`, default the mesh's)."""
    if mesh is not None:
        with ExitStack() as rank0_holds:  # rank 0 keeps the temporary directory locked until it is published
            return _save_sharded_files(directory, state, tag, client_state, save_latest, mesh, keep_last,
                                       rank0_holds, gather or mesh.all_gather_objects)
    tensors, scalars = state_entries(state)
    client_json = _split_client_state(client_state or {}, "", tensors)
    bad = nonfinite_keys(tensors)
    if bad:
        raise CheckpointError(_save_failed(directory, tag, _nonfinite_cause(bad)))
    ensure_directory(directory)
    tidy(directory)
    where = directory
    try:
        with temp_dir(directory, tag) as tmp:
            where = tmp
            written = write_tensor_file(tmp / TENSORS_FILE, tensors, FORMAT)
            write_meta(tmp, _meta(tag, state, scalars, client_json, {TENSORS_FILE: written}))
            final = publish(directory, tmp, tag)
            if save_latest:
                write_latest(directory, tag)
    except OSError as e:
        raise CheckpointError(_save_failed(directory, tag, os_error_text(e, where))) from e
    _retain(directory, keep_last, tag)
    return final


def layout_signature(layout) -> dict:
    """What must be equal for a rank's saved file to fit a rank of another run (same shards)."""
    return {
        "stage": layout.stage,
        "mesh": {axis: size for axis, size in layout.mesh_sizes},
        "params": {p.path: [list(p.shape), str(p.spec)] for p in layout.params},
        "sharded_units": {u.name: u.shard_numel for u in layout.units if u.sharded},
    }


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _error_text(error: BaseException, path: Path) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    if isinstance(error, OSError):
        return os_error_text(error, path)
    return f"{type(error).__name__}: {error}"


def _save_sharded_files(directory: Path, state: TrainState, tag: str, client_state: Optional[dict],
                        save_latest: bool, mesh, keep_last: int, rank0_holds: ExitStack,
                        all_gather_objects: Callable[[Any, str], list]) -> Path:
    rank = mesh.rank
    setup = None
    if rank == 0:
        try:
            ensure_directory(directory)
            tidy(directory)
            setup = (True, str(rank0_holds.enter_context(temp_dir(directory, tag))))
        except (CheckpointError, OSError) as e:
            setup = (False, _save_failed(directory, tag, _error_text(e, directory)))
    ok, detail = all_gather_objects(setup, "checkpoint directory")[0]
    if not ok:
        raise CheckpointError(detail, on_every_rank=True)
    tmp = Path(detail)
    slots, scalars = state_slots(state)
    tensors, entries = chunk_tensors(assign_chunks(slots, rank, all_gather_objects))
    client_json = _split_client_state(client_state or {}, "", tensors) if rank == 0 else None
    file = tmp / _rank_file(rank)
    try:  # a failure is told to the other ranks before raising, so nobody waits or publishes
        bad = nonfinite_keys(tensors)
        if bad:
            report = (False, _nonfinite_cause(bad))
        else:
            report = (True, (write_tensor_file(file, tensors, FORMAT), entries, describe(slots, state)))
    except Exception as e:
        report = (False, _error_text(e, file))
    reports = all_gather_objects(report, "checkpoint files")
    failed = [f"rank {r}: {info}" for r, (ok, info) in enumerate(reports) if not ok]
    outcome = None
    if rank == 0:
        try:
            if failed:
                raise CheckpointError(_save_failed(directory, tag, f"{len(failed)} rank(s) failed: "
                                                   + "; ".join(failed)))
            meta = _meta(tag, state, scalars, client_json,
                         {_rank_file(r): info[0] for r, (_, info) in enumerate(reports)})
            meta["layout"] = layout_signature(state.layout)
            meta["client_file"] = _rank_file(0)
            meta["index"] = build_index([(_rank_file(r), info[1], info[2]) for r, (_, info) in enumerate(reports)])
            write_meta(tmp, meta)
            final = publish(directory, tmp, tag)
            if save_latest:
                write_latest(directory, tag)
            outcome = (True, str(final))
        except BaseException as e:  # the temporary directory goes when rank0_holds closes
            outcome = (False, str(e) if isinstance(e, CheckpointError)
                       else _save_failed(directory, tag, _error_text(e, tmp)))
    ok, detail = all_gather_objects(outcome, "checkpoint publish")[0]
    if not ok:
        raise CheckpointError(detail, on_every_rank=True)
    if rank == 0:
        _retain(directory, keep_last, tag)
    return Path(detail)


def _tag_or_latest(directory: Path, tag: Optional[str]) -> str:
    if tag is not None:
        return tag
    found = latest_tag(directory)
    if found is None:
        raise CheckpointError(f"no checkpoint in {directory} (no '{LATEST_FILE}' file)"
                              if directory.is_dir() else f"no checkpoint in {directory}: the directory does not exist")
    return found


def read_meta(directory: str | os.PathLike, tag: Optional[str] = None) -> dict:
    """The validated meta.json of checkpoint `tag` (default: `latest`) in `directory`, found the way
    `load_checkpoint` finds it (the old copy of an interrupted overwrite included)."""
    directory = Path(directory)
    return read_meta_file(checkpoint_path(directory, _tag_or_latest(directory, tag)))


def load_checkpoint(
    directory: str | os.PathLike,
    template: TrainState,
    *,
    tag: Optional[str] = None,
    load_optimizer_states: bool = True,
    mesh=None,
) -> tuple[TrainState, dict]:
    """Load `directory/tag` (default: `latest`) into the buffers of `template`.

    `template` is a state built the same way as the saved one (e.g. by `init_train_state`); it is
    donated. Precision may differ (an explicit, logged conversion): fp32 masters are restored from
    the saved masters, or from the saved params when the checkpoint had none, and a bf16/fp16
    compute copy is cast from them; the loss scaler is restored only when the precision is the
    same. Any other dtype or shape difference is an error naming the file and the tensor. With
    `load_optimizer_states=False` only the weights are loaded and the optimizer state and counters
    stay as in `template`. A sharded template needs `mesh=` (a collective) and a checkpoint saved
    with the same plan and mesh sizes: each rank reads back its own file.
    Leftovers of crashed saves in `directory` are cleaned up first (see `directory.tidy`).
    Returns (state, client_state).
    """
    directory = Path(directory)
    if is_sharded(template, mesh, "load_checkpoint"):
        return _load_sharded(directory, template, tag, load_optimizer_states, mesh)
    tidy(directory)
    tag = _tag_or_latest(directory, tag)
    path = checkpoint_path(directory, tag)
    meta = read_meta_file(path)
    if "index" in meta:
        return _load_universal(path, meta, template, load_optimizer_states, 0, 1)
    if "layout" in meta:
        raise CheckpointError(f"{path} was saved by {len(meta['files'])} ranks (zero stage "
                              f"{meta['layout']['stage']}, mesh {meta['layout']['mesh']}) in format "
                              f"{meta['format']}, which loads only with the same plan and mesh (mesh=...); "
                              "checkpoints saved by this fspeed load into any layout")
    verify_files(path, meta, [TENSORS_FILE])
    reader = open_tensor_file(path / TENSORS_FILE)
    state = _fill(template, meta, reader, path / TENSORS_FILE, load_optimizer_states)
    return state, _join_client_state(meta["client_state"], reader, path / TENSORS_FILE)


def _load_sharded(directory: Path, template: TrainState, tag: Optional[str], load_optimizer_states: bool, mesh):
    rank = mesh.rank
    all_gather_objects = mesh.all_gather_objects
    if rank == 0:
        tidy(directory)
    world = len(all_gather_objects(None, "checkpoint cleanup"))  # the others look only once rank 0 has tidied
    result, client, error = None, None, None
    where = directory / tag if tag else directory
    try:
        tag = _tag_or_latest(directory, tag)
        where = directory / tag
        path = checkpoint_path(directory, tag)
        meta = read_meta_file(path)
        saved = meta.get("layout")
        wanted = layout_signature(template.layout)
        if "index" in meta or saved is None:  # layout-free: a format-3 sharded or a one-process checkpoint
            result, client = _load_universal(path, meta, template, load_optimizer_states, rank, world)
        elif saved != wanted:
            diff = [k for k in wanted if saved.get(k) != wanted[k]]
            raise CheckpointError(
                f"{path} was saved with another layout ({', '.join(diff)} differ: saved zero stage "
                f"{saved['stage']} on mesh {saved['mesh']}, this state has zero stage {wanted['stage']} on mesh "
                f"{wanted['mesh']}) in format {meta['format']}, which loads only into its own layout; resume "
                "with the plan and mesh it was saved with (checkpoints saved by this fspeed load into any layout)")
        else:
            name = _rank_file(rank)
            verify_files(path, meta, [name])
            result = _fill(template, meta, open_tensor_file(path / name), path / name, load_optimizer_states)
            client_file = path / meta["client_file"]
            client = _join_client_state(meta["client_state"], open_tensor_file(client_file), client_file)
    except (CheckpointError, OSError) as e:
        error = _error_text(e, where)
    errors = [f"rank {r}: {err}" for r, err in enumerate(all_gather_objects(error, "checkpoint load")) if err]
    if errors:
        raise CheckpointError(f"loading {where} failed on {len(errors)} rank(s): " + "; ".join(errors),
                              on_every_rank=True)
    return result, client


def _fill(template: TrainState, meta: dict, reader, file: Path, load_optimizer_states: bool) -> TrainState:
    """Copy the saved tensors into `template`'s buffers (and, with optimizer states, its scalars)."""
    path = file.parent
    saved_keys = set(reader.keys())
    tensors, scalars = state_entries(template)
    weights_only = not load_optimizer_states
    converting = meta["precision"] != template.precision.name
    wanted = {k: v for k, v in tensors.items()
              if not weights_only or k.startswith(("params/", "master/"))}
    prefer_master = template.master is None or converting
    sources = saved_sources(wanted, saved_keys, prefer_master, path)
    if converting:
        log.warning("%s was saved with precision %s; converting it to this state's %s: the weights come from its "
                    "fp32 %s%s", path, meta["precision"], template.precision.name,
                    "masters" if any(k.startswith("master/") for k in saved_keys) else "weights",
                    "" if weights_only else ", the loss scaler keeps this state's initial value")
    for key, target in wanted.items():
        saved_key = sources[key]
        try:
            value = reader.get_tensor(saved_key)
        except Exception as e:  # safetensors' own error types
            raise CheckpointError(f"{file}: cannot read tensor {saved_key!r} ({e})") from None
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{file}: tensor {saved_key!r} has shape {list(value.shape)}, the state expects {list(target.shape)}"
            )
        if value.dtype != target.dtype and not (key.startswith("params/") and value.dtype == torch.float32
                                                and target.dtype in CAST_FROM_FP32):
            raise CheckpointError(
                f"{file}: tensor {saved_key!r} is {value.dtype}, the state's {key!r} is {target.dtype}; the only "
                "conversion is fp32 weights cast to a bf16/fp16 compute copy (was it saved with another precision "
                "or optimizer?)"
            )
        with torch.no_grad():
            target.copy_(value)

    return _restore_scalars(template, meta, path, scalars, converting, weights_only)


def _load_universal(path: Path, meta: dict, template: TrainState, load_optimizer_states: bool, rank: int,
                    world: int) -> tuple[TrainState, Any]:
    """Fill `template` (any layout) from a layout-free checkpoint; this rank verifies every
    `world`-th file (each file's checksum is checked once, by one rank) and reads only its slices."""
    names = sorted(meta["files"])
    verify_files(path, meta, names[rank::world])
    client_file = path / meta.get("client_file", TENSORS_FILE)
    index = meta["index"] if "index" in meta else file_index(open_tensor_file(client_file), TENSORS_FILE)
    weights_only = not load_optimizer_states
    converting = meta["precision"] != template.precision.name
    _, scalars = state_entries(template)
    same_layout = meta.get("layout") == layout_signature(template.layout)
    reset, synced = fill_from_index(template, index, ChunkReader(path), same_layout=same_layout,
                                    weights_only=weights_only, converting=converting)
    if converting:
        log.warning("%s was saved with precision %s; converting it to this state's %s: the weights come from its "
                    "fp32 %s%s", path, meta["precision"], template.precision.name,
                    "masters" if any(k.startswith("master/") for k in index) else "weights",
                    "" if weights_only else ", the loss scaler keeps this state's initial value")
    if reset or synced:
        saved = meta.get("layout")
        log.warning("%s: state that belonged to each saving rank (%s) does not carry over to this layout (%s): %s%s",
                    path, f"zero stage {saved['stage']} on mesh {saved['mesh']}" if saved else "one process",
                    template.layout.describe(),
                    f"{_grouped(reset)} restart from their initial values (as DeepSpeed's universal checkpoints "
                    "drop them)" if reset else "",
                    f"{'; ' if reset else ''}{_grouped(synced)} take the lowest saving rank's copy" if synced else "")
    state = _restore_scalars(template, meta, path, scalars, converting, weights_only)
    return state, _join_client_state(meta["client_state"], open_tensor_file(client_file), client_file)


def _grouped(keys: list[str]) -> str:
    """State keys named briefly: `params/*` (12 tensors) rather than every parameter."""
    counts: dict[str, int] = {}
    for key in keys:
        head, slash, _ = key.partition("/")
        counts[head + ("/*" if slash else "")] = counts.get(head + ("/*" if slash else ""), 0) + 1
    return ", ".join(f"{k} ({n} tensors)" if k.endswith("/*") else k for k, n in counts.items())


def _restore_scalars(template: TrainState, meta: dict, path: Path, scalars: dict, converting: bool,
                     weights_only: bool) -> TrainState:
    """`template` with the saved non-tensor leaves (counters, loss scaler) unless only weights load."""
    state = template
    if not weights_only:
        saved_scalars = dict(meta["scalars"])
        if converting:
            # a scaler from another precision (fp32's fixed 1.0) must not replace this one's
            saved_scalars = {k: v for k, v in saved_scalars.items() if not k.startswith("loss_scale.")}
        missing_scalars = sorted(k for k in set(scalars) - set(saved_scalars) if not k.startswith("loss_scale."))
        if missing_scalars:
            raise CheckpointError(f"{path / META_FILE} lacks state fields {missing_scalars[:4]}")
        for key, value in saved_scalars.items():
            if key in scalars and not _same_kind(value, scalars[key]):
                raise CheckpointError(f"{path / META_FILE}: state field {key!r} is {type(value).__name__} {value!r}, "
                                      f"the state expects a {type(scalars[key]).__name__}")
        state = _replace_scalars(template, saved_scalars)
        template.donate()
    return state


def _same_kind(saved: Any, current: Any) -> bool:
    """Whether a saved scalar may replace `current` (same type; an int where a float is kept)."""
    if type(saved) is type(current):
        return True
    return isinstance(current, float) and isinstance(saved, int) and not isinstance(saved, bool)


def _replace_scalars(template: TrainState, saved: dict[str, Any]) -> TrainState:
    """A copy of `template` whose non-tensor leaves take the saved values (matched by path)."""
    paths, leaves, treedef = tree_flatten_with_paths(template, is_leaf=lambda x: isinstance(x, Flat))
    new_leaves = [saved[p] if p in saved and not isinstance(leaf, (Flat, torch.Tensor)) else leaf
                  for p, leaf in zip(paths, leaves)]
    return tree_unflatten(treedef, new_leaves)
