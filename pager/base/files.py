"""Checkpoint files: where each tensor's bytes are, checked before any work,
and a streaming, crash-safe writer.

[Note: reading checkpoints in place]
`pager.load` never builds a state dict. For safetensors files (one, or
sharded with a `model.safetensors.index.json`, the format model hubs ship) it
parses only the headers: each tensor is a byte range of a file, and the disk
tier (`engine/disk.py`, `engine/page_io.py`) reads those ranges straight into host pages. For
`torch.save` files, `torch.load(mmap=True, weights_only=True)` gives tensors
backed by the mapped file, read through the page cache when a page is filled.
Every structural fault (a header that is not JSON, an unknown dtype, a range
that does not match its shape, ranges that overlap or run past the end of the
file: a truncated download) is refused here, naming the file, the offset and
the tensor, before the model is touched.

[Note: crash-safe writes]
A checkpoint (`save`) and a spilled page (`engine/page_io.py`) are written to a new
file next to their destination, fsync'd, renamed over the destination and
the folder fsync'd. A process killed at any moment leaves either the old
file or the new one, never a torn one: the last complete checkpoint stays
loadable.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from dataclasses import dataclass
from typing import cast

import torch

# What `save_pretrained` names a model's weights: transformers' and diffusers'. A
# folder may hold a variant beside them (`model.fp16.safetensors`): read when its
# path is given, as from_pretrained reads it only when asked (variant=).
WEIGHTS_NAMES = ("model.safetensors", "diffusion_pytorch_model.safetensors")
INDEX_NAMES = tuple(name + ".index.json" for name in WEIGHTS_NAMES)  # (the index of a model's shards)
TORCH_NAMES = ("pytorch_model.bin", "diffusion_pytorch_model.bin")  # (save_pretrained without safetensors)
HEADER_LIMIT_BYTES = 100 << 20  # safetensors' own limit on the JSON header

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as it claims (corrupt, truncated)."""


@dataclass
class Entry:
    """One tensor of a checkpoint: a byte range of a file, or (torch.save) a
    tensor backed by the mapped file."""

    name: str
    dtype: torch.dtype
    shape: tuple
    path: str | None = None
    offset: int = 0  # of its first byte in the file
    nbytes: int = 0
    tensor: torch.Tensor | None = None


def open_checkpoint(path) -> dict[str, Entry]:
    """The tensors of the checkpoint at `path`: a safetensors file, a folder
    holding one (or a sharded set with its index json, or a `pytorch_model.bin`),
    the index json itself, or a `torch.save` file of a state dict."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _in_folder(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"pager: no checkpoint at {path!r}.")
    if path.endswith(".json"):
        return _sharded(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] == b"PK" or head[:1] == b"\x80":  # a zip (torch.save) or a legacy pickle
        return _torch_file(path)
    return read_header(path)


def _in_folder(folder: str) -> dict[str, Entry]:
    """The checkpoint a folder holds: the model's weights as `save_pretrained`
    names them (one file, the index of its shards, or a `torch.save` file;
    a variant beside them is left, as from_pretrained leaves it without
    variant=), else its one safetensors file or index."""
    names = set(os.listdir(folder))
    for named, read in ((WEIGHTS_NAMES, read_header), (INDEX_NAMES, _sharded), (TORCH_NAMES, _torch_file)):
        present = [n for n in named if n in names]
        if len(present) > 1:
            raise FileNotFoundError(
                f"pager: {folder!r} holds the weights of two models ({', '.join(present)}); give the path of "
                f"the one to read."
            )
        if present:
            return read(os.path.join(folder, present[0]))
    found = sorted(n for n in names if n.endswith(".safetensors.index.json"))
    found = found or sorted(n for n in names if n.endswith(".safetensors"))
    if len(found) == 1:
        return (_sharded if found[0].endswith(".json") else read_header)(os.path.join(folder, found[0]))
    if found:
        raise FileNotFoundError(
            f"pager: {folder!r} holds {len(found)} checkpoints ({', '.join(found)}) and none of them is named "
            f"as save_pretrained names a model's weights ({', '.join(WEIGHTS_NAMES + INDEX_NAMES)}); give "
            f"the path of the one to read (or of the index of its shards)."
        )
    raise FileNotFoundError(
        f"pager: {folder!r} holds no checkpoint (no .safetensors file, no shards' index, none of "
        f"{', '.join(TORCH_NAMES)}); give the path of a checkpoint file, or a folder that save_pretrained wrote."
    )


def read_header(path: str) -> dict[str, Entry]:
    """The entries of one safetensors file, checked against its size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(
                f"pager: {path!r} is {size} bytes, too short for a safetensors header "
                f"(8 bytes of length at offset 0); the file is truncated or not safetensors."
            )
        (header_bytes,) = struct.unpack("<Q", raw)
        if header_bytes > HEADER_LIMIT_BYTES or 8 + header_bytes > size:
            raise CheckpointError(
                f"pager: {path!r}: the header length at offset 0 says {header_bytes} bytes, but the file has "
                f"{size}; the file is truncated, corrupt, or not safetensors."
            )
        text = f.read(header_bytes)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"pager: {path!r}: the JSON header (offsets 8 to {8 + header_bytes}) does not parse "
            f"({e}); the file is corrupt."
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"pager: {path!r}: the header at offset 8 is not a JSON object; the file is corrupt.")
    header.pop("__metadata__", None)
    base = 8 + header_bytes
    entries, spans = {}, []
    for name, info in header.items():
        entries[name] = _entry(path, name, info, base, size)
        spans.append((entries[name].offset, entries[name].offset + entries[name].nbytes, name))
    spans.sort()
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise CheckpointError(
                f"pager: {path!r}: tensors {n0!r} and {n1!r} overlap at offset {s1}; the header is corrupt."
            )
    return entries


def _entry(path: str, name: str, info, base: int, size: int) -> Entry:
    try:
        dtype = DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        what = (
            f"dtype {info.get('dtype')!r} is not known"
            if isinstance(info, dict) and "dtype" in info and info["dtype"] not in DTYPES
            else f"its entry is malformed ({e!r})"
        )
        raise CheckpointError(
            f"pager: {path!r}: tensor {name!r}: {what}; the header is corrupt or from a newer format."
        ) from None
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if end - start != nbytes or start < 0 or min(shape, default=0) < 0:
        raise CheckpointError(
            f"pager: {path!r}: tensor {name!r} spans offsets {base + start} to {base + end} "
            f"({end - start} bytes), but {NAMES[dtype]} {list(shape)} needs {nbytes}; the header is corrupt."
        )
    if base + end > size:
        raise CheckpointError(
            f"pager: {path!r}: tensor {name!r} ends at offset {base + end}, past the end of the file "
            f"({size} bytes); the file is truncated (an interrupted download or copy)."
        )
    return Entry(name, dtype, shape, path, base + start, nbytes)


def _sharded(index_path: str) -> dict[str, Entry]:
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f'pager: {index_path!r} is not a safetensors index (a JSON object with a "weight_map"): {e!r}.'
        ) from None
    folder = os.path.dirname(index_path)
    entries, headers = {}, {}
    for name, file in weight_map.items():
        full = os.path.join(folder, file)
        if full not in headers:
            if not os.path.exists(full):
                raise FileNotFoundError(
                    f"pager: {index_path!r} puts {name!r} in {file!r}, which is not in "
                    f"{folder!r}; the checkpoint is incomplete."
                )
            headers[full] = read_header(full)
        if name not in headers[full]:
            raise CheckpointError(
                f"pager: {index_path!r} puts {name!r} in {file!r}, whose header has no such "
                f"tensor; the index and the shards do not match."
            )
        entries[name] = headers[full][name]
    return entries


def _torch_file(path: str) -> dict[str, Entry]:
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises many kinds for a damaged zip or pickle
        raise CheckpointError(
            f"pager: {path!r} does not load as a torch.save state dict ({type(e).__name__}: "
            f"{e}); the file is corrupt or truncated."
        ) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"pager: {path!r} holds a {type(state).__name__}, not a state dict of tensors (name -> tensor)."
        )
    return {n: Entry(n, t.dtype, tuple(t.shape), path, tensor=t) for n, t in state.items()}


def read_entry(e: Entry) -> torch.Tensor:
    """The tensor `e` holds, read whole into (plain) host memory."""
    if e.tensor is not None:
        return e.tensor.detach().clone()
    out = torch.empty(e.shape, dtype=e.dtype)
    if not e.nbytes:
        return out
    with open(cast(str, e.path), "rb") as f:  # (an entry without a tensor is a range of a file)
        f.seek(e.offset)
        # (numpy's stubs give ndarray a __buffer__ only from Python 3.12)
        got = f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
    if got != e.nbytes:
        raise CheckpointError(
            f"pager: {e.path!r}: tensor {e.name!r} ends past the end of the file (read {got} "
            f"of {e.nbytes} bytes at offset {e.offset}); the file is truncated."
        )
    return out


# ---------------------------------------------------------------- writing
def header_for(named: list[tuple[str, torch.dtype, tuple]], metadata: dict | None = None) -> tuple[bytes, list]:
    """A safetensors header for tensors `named` (name, dtype, shape), in this
    order, and each one's data offset relative to the start of the data."""
    header: dict = {}
    offsets, at = [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dtype, shape in named:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        offsets.append(at)
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, offsets


def replace_atomically(tmp: str, path: str) -> None:
    """`tmp` (written, closed) becomes `path`: fsync, rename, fsync the folder
    ([Note: crash-safe writes])."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_folder(os.path.dirname(os.path.abspath(path)))


def fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def most_common_float(entries: dict) -> torch.dtype:
    """The dtype most of a checkpoint's floating tensors have (`open_checkpoint`'s entries); float32 where none."""
    counts = Counter(e.dtype for e in entries.values() if e.dtype.is_floating_point)
    return counts.most_common(1)[0][0] if counts else torch.float32
