"""A checkpoint saved in another layout than the model's, read in place:
transformers' own conversions (keys renamed, experts stacked and fused)
applied to where the bytes are, not to the bytes.

[Note: checkpoint conversions as byte ranges]
transformers 5 builds a mixture-of-experts layer's experts as fused 3-D
parameters (`mlp.experts.gate_up_proj`: every expert's gate and up
projections; `mlp.experts.down_proj`), while checkpoints (its own
`save_pretrained` too) hold one 2-D tensor per expert and projection, under
older names (`block_sparse_moe.experts.3.w1.weight`). On load, transformers
renames the keys and runs each converter's operations (stack the experts,
concatenate gate and up) on the tensors. pager reads pages straight from
the files ([Note: reading checkpoints in place] in base/files.py), so it
runs the same renamings and the same converters (transformers' objects,
`get_model_conversion_mapping`), on stand-ins that carry where each of
their bytes is (`_Ranges`: a meta tensor with its bytes' file ranges in
row-major order) instead of the bytes. Stacking along the first dimension
and concatenating along any keep a tensor's bytes a sequence of whole
ranges of its sources: a fused parameter becomes a few pieces of its page
(two an expert for `gate_up_proj`), read from the files like any other
tensor, never built in host memory (but where pages are read whole into
it anyway: `compress=`, tables by `rows=`). An operation that would need the bytes
themselves (a transpose, a permutation for rotary embeddings, a split) is
refused before anything changes, naming the tensor and the operation: load
such a model with transformers and `pager.wrap` it.
"""

from __future__ import annotations

import copy
import math

import torch

from ..base.files import Entry
from ..engine.page_io import Piece


class Unconvertible(ValueError):
    """A conversion whose result is not a sequence of its sources' bytes."""


class _Ranges(torch.Tensor):
    """A stand-in (on the meta device) for a tensor whose bytes are, in
    row-major order, `runs`: (entry, byte offset in it, bytes)."""

    runs: list

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, runs: list):
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        t.runs = runs
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.stack:
            return _stack(*args, **kwargs)
        if func in (torch.cat, torch.concat, torch.concatenate):
            return _cat(*args, **kwargs)
        if func is torch.Tensor.contiguous or getattr(func, "__name__", "") in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return args[0] if func is torch.Tensor.contiguous else out
        raise Unconvertible(getattr(func, "__name__", repr(func)))


# What reads a stand-in's shape and type: answered as for any meta tensor.
_METADATA = {"__get__", "size", "dim", "numel", "element_size", "stride", "is_contiguous", "__len__", "__repr__"}


def _stack(tensors, dim: int = 0, *, out=None):
    tensors = list(tensors)
    if out is not None or dim != 0 or not tensors or any(not isinstance(t, _Ranges) for t in tensors):
        raise Unconvertible(f"stack(dim={dim})")
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        raise Unconvertible("stack of tensors of different shapes or dtypes")
    return _Ranges((len(tensors), *first.shape), first.dtype, _merged([r for t in tensors for r in t.runs]))


def _cat(tensors, dim: int = 0, *, out=None):
    tensors = list(tensors)
    if out is not None or not tensors or any(not isinstance(t, _Ranges) for t in tensors):
        raise Unconvertible(f"cat(dim={dim})")
    first = tensors[0]
    dim = dim % first.dim()
    if any(
        t.dim() != first.dim() or t.dtype != first.dtype or t.shape[:dim] != first.shape[:dim] for t in tensors
    ) or any(t.shape[dim + 1 :] != first.shape[dim + 1 :] for t in tensors):
        raise Unconvertible(f"cat(dim={dim}) of tensors that do not line up")
    outer = math.prod(first.shape[:dim])
    inner = [math.prod(t.shape[dim:]) * t.element_size() for t in tensors]  # bytes of each per outer index
    runs = []
    for i in range(outer):
        for t, n in zip(tensors, inner):
            runs += _slice(t.runs, i * n, n)
    shape = (*first.shape[:dim], sum(t.shape[dim] for t in tensors), *first.shape[dim + 1 :])
    return _Ranges(shape, first.dtype, _merged(runs))


def _slice(runs: list, start: int, nbytes: int) -> list:
    """The runs of bytes [start, start + nbytes) of a tensor made of `runs`."""
    out, at = [], 0
    for entry, offset, n in runs:
        lo, hi = max(start, at), min(start + nbytes, at + n)
        if lo < hi:
            out.append((entry, offset + lo - at, hi - lo))
        at += n
        if at >= start + nbytes:
            break
    return out


def _merged(runs: list) -> list:
    """`runs` with neighbours that continue one another in one entry joined."""
    out: list = []
    for entry, offset, n in runs:
        if out and out[-1][0] is entry and out[-1][1] + out[-1][2] == offset:
            out[-1] = (entry, out[-1][1], out[-1][2] + n)
        else:
            out.append((entry, offset, n))
    return out


class Converted:
    """A model tensor made of ranges of several checkpoint tensors."""

    def __init__(self, dtype: torch.dtype, shape: tuple, pieces: list[Piece], sources: list[str]):
        self.dtype, self.shape, self.pieces, self.sources = dtype, shape, pieces, sources


def convert(model, entries: dict[str, Entry], names: dict) -> tuple[dict[str, Entry], dict[str, Converted]]:
    """The checkpoint's `entries` as `model` (a transformers model; `names`:
    its state's names -> tensors) names them after transformers' renamings,
    and the tensors its converters make, as pieces of the files ([Note:
    checkpoint conversions as byte ranges]). Any other model: `entries`
    as they are, nothing converted."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:
        return entries, {}
    if not isinstance(model, PreTrainedModel):
        return entries, {}
    transforms = get_model_conversion_mapping(model) or []
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    plain: dict[str, Entry] = {}
    pending: dict = {}  # target key -> (its converter's copy, the source keys)
    for key in sorted(entries, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:  # (as transformers: a key the model has keeps its name)
            renamed, pattern = rename_source_key(key, [], [], prefix, names)
        if pattern is None or renamed not in names:
            plain[renamed if renamed in names else key] = entries[key]
            continue
        if renamed not in pending:
            pending[renamed] = (copy.deepcopy(by_pattern[pattern]), [])
        converter, sources = pending[renamed]
        e = entries[key]
        nbytes = math.prod(e.shape) * e.dtype.itemsize
        converter.add_tensor(renamed, key, pattern, lambda e=e, n=nbytes: _Ranges(e.shape, e.dtype, [(e, 0, n)]))
        sources.append(key)
    made = {name: _run(model, name, converter, sources) for name, (converter, sources) in pending.items()}
    return plain, made


def _run(model, name: str, converter, sources: list[str]) -> Converted:
    """What `converter` makes of `sources` for the model's tensor `name`."""
    ops = ", ".join(type(op).__name__ for op in converter.operations)
    try:
        made = converter.convert(name, model=model, config=model.config)
    except Unconvertible as e:
        raise ValueError(
            f"pager: the checkpoint holds {name!r} as {len(sources)} tensors ({sources[0]!r}, ...) that "
            f"transformers converts with {ops}; pager reads pages in place from the files and can stack and "
            f"concatenate them, not {e}. Load the model with transformers (from_pretrained) and pager.wrap it."
        ) from None
    t = made.get(name) if len(made) != 1 else next(iter(made.values()))
    if not isinstance(t, _Ranges):
        raise ValueError(
            f"pager: transformers' conversion of {sources[0]!r} ... ({ops}) makes {sorted(made)}, not {name!r} "
            "alone; load the model with transformers (from_pretrained) and pager.wrap it."
        )
    return Converted(t.dtype, tuple(t.shape), [_piece(name, *run) for run in t.runs], sources)


def _piece(name: str, e: Entry, offset: int, nbytes: int) -> Piece:
    label = f"{name} ({e.name})"
    if e.tensor is not None:
        flat = e.tensor.detach().reshape(-1).view(torch.uint8)
        return Piece(0, nbytes, e.path, tensor=flat[offset : offset + nbytes], name=label)
    return Piece(0, nbytes, e.path, e.offset + offset, name=label, itemsize=e.dtype.itemsize)
