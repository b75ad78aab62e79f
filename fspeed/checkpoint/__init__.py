"""Checkpoints: a whole TrainState plus the user's client_state under `dir/tag/`, with `dir/latest`.

Nothing is lost: a save is atomic (a crash at any moment leaves `latest` naming a complete
checkpoint), a failed save raises a CheckpointError naming the path and the cause and leaves the
previous checkpoint as `latest`, a state holding inf/NaN is never saved, and everything read back
is verified (meta.json's schema and checksum, every file's checksum, tensor shapes and dtypes)
with errors that name the file.

Modules: `state_io` (save/load a TrainState, sharded or not, into any layout: `universal`,
`slices`), `async_save` (a save written by a background thread while training goes on), `export` (full weights as safetensors), `exported` (a state's or a model's weights from
them), `deepspeed_import` (a DeepSpeed ZeRO 0-3 checkpoint into a state, without DeepSpeed),
`directory` (tags, `latest`, atomic publishing, cleanup of crashed saves, retention), `meta`
(meta.json), `tensor_file` (safetensors files), `preflight_checks` (can this run write
checkpoints, and is there room).
"""

from .async_save import AsyncSave
from .directory import LATEST_FILE, latest_tag
from .errors import CheckpointError
from .deepspeed_import import import_deepspeed
from .export import export_weights
from .exported import VOCAB_KEY, init_from_weights, load_exported
from .meta import FORMAT, META_FILE
from .preflight_checks import checkpoint_bytes, preflight, probe_directory
from .state_io import (
    TENSORS_FILE, layout_signature, load_checkpoint, read_meta, save_checkpoint, state_entries,
)

__all__ = [
    "AsyncSave", "FORMAT", "LATEST_FILE", "META_FILE", "TENSORS_FILE", "VOCAB_KEY", "CheckpointError", "checkpoint_bytes",
    "export_weights", "import_deepspeed", "init_from_weights", "latest_tag", "load_exported",
    "layout_signature", "load_checkpoint", "preflight", "probe_directory", "read_meta", "save_checkpoint",
    "state_entries",
]
