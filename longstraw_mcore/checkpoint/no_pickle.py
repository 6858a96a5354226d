"""A checkpoint directory is data, never code: nothing read from one may import or call what it names.

Three readers behind a resume or a `--load` unpickle what they read:
- torch.distributed.checkpoint's `.metadata` (`FileSystemReader.read_metadata`: plain `pickle.load`), in
  every Megatron distributed checkpoint: the model's and the layout-free optimizer state's;
- its byte items (`DefaultLoadPlanner.load_bytes`: `torch.load(weights_only=False)`): Megatron's
  `_extra_state` objects and non-tensor common state (the optimizer's step); and a legacy `common.pt`,
  which Megatron reads first where one exists;
- the per-rank optimizer files of train/checkpoints.py (`optimizer_rank*.pt`).
A crafted file in any of them would run its code on every rank at `--resume`.

`install()` (once per process; `check_dcp` calls it) makes the first two read only data: the metadata through
an unpickler that admits only what torch's metadata is made of (`METADATA_GLOBALS` and torch's dtypes), the
byte items weights-only. `check_dcp(directory)`, called before Megatron reads a directory
(checkpoint/dist_ckpt.py, train/optimizer_state.py), reads the same way first, so that a refused file ends
the load with one line naming it instead of an error from inside torch's collective reader.
`load_torch_file(path)` is `torch.load(weights_only=True)`. "Weights-only" is torch's allow-list: tensors,
containers, numbers and strings, plus the few classes torch and Megatron-Core register as safe (Megatron's
megatron/core/safe_globals.py: numpy arrays, `argparse.Namespace`, its `OptimizerConfig`, `io.BytesIO`, a few
enums); none of them runs code on load.
Anything else raises CheckpointError with one line naming the file and what it asked for.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from pathlib import Path

import torch

from longstraw_mcore.checkpoint.common import CheckpointError

METADATA_GLOBALS = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # (torch's own writer keeps a checkpoint_id given as a path)
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
})
"""The globals a torch_dist `.metadata` file names (torch 2.14, Megatron-Core 0.19.2), besides torch's dtypes:
its dataclasses and enums, torch.Size, the layout decoder torch's own safe unpickler admits, and containers."""


class _Refused(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and
                                                  isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def _refuse(path: Path | str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: refusing to read it ({what}): a checkpoint holds tensors and plain data only "
                           "(a file made to run code? take checkpoints only from sources you trust)")


def _unpickle_metadata(f, path: Path):
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise _refuse(path, f"it asks for {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged file: one line
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: holds a {type(md).__name__}, not torch.distributed.checkpoint's Metadata")
    return md


def read_metadata(directory: str | Path):
    """torch.distributed.checkpoint's Metadata of `directory`, unpickled with `METADATA_GLOBALS` only."""
    path = Path(directory) / ".metadata"
    try:
        with open(path, "rb") as f:
            return _unpickle_metadata(f, path)
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no .metadata (not a Megatron distributed checkpoint, or damaged)") \
            from None


_installed = False


def install() -> None:
    """Make torch.distributed.checkpoint's readers, in this process, unpickle only data (module docstring):
    `FileSystemReader.read_metadata` (Megatron's cached reader calls it) and `DefaultLoadPlanner.load_bytes`
    (Megatron's planner inherits it), each as torch 2.14 writes it but for the unpickler."""
    global _installed
    if _installed:
        return
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = _unpickle_metadata(f, Path(path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refuse(f"item {fqn!r}", _first_line(e)) from None
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    FileSystemReader.read_metadata = read_metadata
    default_planner.DefaultLoadPlanner.load_bytes = load_bytes
    _installed = True


def check_dcp(directory: str | Path) -> None:
    """Raise CheckpointError unless every pickle Megatron will read in `directory` is plain data (module
    docstring). Reads the metadata and the byte items, not the tensors (those torch reads weights-only)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    install()
    directory = Path(directory)
    if (directory / "common.pt").exists():  # (Megatron reads a legacy common file first; never written here)
        load_torch_file(directory / "common.pt")
    md = read_metadata(directory)
    byte_keys = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    items = sorted(((info.relative_path, info.offset, info.length, idx.fqn, info.transform_descriptors)
                    for idx, info in (md.storage_data or {}).items() if idx.fqn in byte_keys))
    handles: dict[str, object] = {}
    try:
        for rel, offset, length, fqn, transforms in items:
            path = directory / rel
            if transforms:
                raise CheckpointError(f"{path}: item {fqn!r} is stored transformed ({list(transforms)}); this "
                                      "project writes none and cannot check one")
            if rel not in handles:
                try:
                    handles[rel] = open(path, "rb")
                except OSError as e:
                    raise CheckpointError(f"{path}: {e.strerror or e}") from None
            f = handles[rel]
            f.seek(offset)
            try:
                torch.load(io.BytesIO(f.read(length)), weights_only=True)
            except pickle.UnpicklingError as e:
                raise _refuse(path, f"item {fqn!r}: {_first_line(e)}") from None
    finally:
        for f in handles.values():
            f.close()


@contextlib.contextmanager
def one_line_errors(directory: str | Path):
    """Around a Megatron load of `directory`: torch's collective reader raises CheckpointException, a
    BaseException carrying every rank's traceback (an `except Exception` lets it through); raise instead a
    CheckpointError with the first failure's own words, naming the directory."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        first = next(iter(e.failures.values()), (e, None))[0]
        words = str(first).splitlines()[0] if str(first) else ""
        if not isinstance(first, CheckpointError):
            words = f"{type(first).__name__}: {words}"
        raise CheckpointError(f"{directory}: {words}") from None


def load_torch_file(path: str | Path):
    """torch.load of a file this project wrote with torch.save (tensors and plain containers), weights-only."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise _refuse(Path(path), _first_line(e)) from None


def _first_line(e: BaseException) -> str:
    """What torch's weights-only refusal found, without its paragraphs of advice ("unsupported GLOBAL
    posix.system whose module posix is blocked")."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    for line in lines:
        low = line.lower()
        if "unsupported" in low and not low.startswith("weights only load failed"):
            return line.removeprefix("Trying to load ").rstrip(".")[:160]
    return (lines or [type(e).__name__])[0][:160]
