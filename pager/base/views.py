"""Views of a block's storage made while it was in use, searched for after
the use (`track_kept_views`) and remembered with their segment
(`guards.remember_alias`). See [Note: paged-out tensors] in base/guards.py.
"""

from __future__ import annotations

import gc

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from . import guards
from .block import storage_key
from .registry import TENSORS
from .wrappers import inner_tensors, is_wrapper

# ------------------------------------------------------------- kept views
# [Note: views kept from a use]
# While a block is in use its tensors have their own class, so a view taken
# then (`self.cache = self.weight.t()` in a forward, `w[:10]` returned as an
# output, `m.weight.detach()` kept by a forward hook or while the pager
# sleeps) is an ordinary tensor on the block's storage: after an eviction it
# would read freed memory. Nothing intercepts its creation (that would cost
# a Python call per operation of every forward), but every view holds a
# reference to the storage, so after a use the storage's reference count
# says how many views exist beyond the block's own tensors and the views
# pager knows of. Those are either autograd's saved views (F.linear saves
# `weight.t()`; they are read only by the block's backward, which fetches it)
# or views a user holds, which must be found and remembered (`remember_alias`:
# guarded while the block is idle, served like any access). So, when the
# count exceeds what this kind of use left before: the places a forward keeps
# things (its outputs, its modules' attributes) are searched, then, if views
# are still unaccounted for, every Python object (gc; ~10-50 ms, hence only
# then). What remains is held by autograd (or other C++ code) and becomes the
# expected excess for this kind of use: a training forward pays for one full
# search per block, the first time, and then only a reference count. The
# search of every object needs the process to have one Python thread (see
# `_python_tensors`). With several, autograd's saved views are counted as
# they are saved ([Note: autograd's saved views, counted] in base/saving.py), and what remains
# unaccounted for is a view kept where pager cannot look (or another thread's
# operation still running on the block), so the block is checked again when
# it is chosen to leave (nothing runs on it then): if views are still
# unaccounted for, it stays (`Pager._evict`).


def untracked_refs(seg) -> int:
    """References to `seg`'s storage beyond its own tensors, known views and
    the views autograd saved under pager's hooks (training/activations.py)."""
    alive = sum(1 for ref, _cls in seg.aliases if ref() is not None) if seg.aliases else 0
    if seg.saved:
        seg.saved = [ref for ref in seg.saved if ref() is not None]
    return torch._C._storage_Use_Count(seg.storage_key) - seg.base_refs - alive - len(seg.saved)


def track_kept_views(segs, places, use, search_all: bool = True, learn: bool = True):
    """Find and remember views of `segs` made during a use of kind `use`
    (see the Note); `places` are where to look first (outputs, modules), then,
    with `search_all`, every Python object. Returns (how many were found, the
    segments with views still unaccounted for); with `learn`, their count
    becomes the expected one for this kind of use (autograd's)."""
    pending = [seg for seg in segs if has_unknown_views(seg, use)]
    if not pending:
        return 0, []
    found = _adopt(pending, _tensors_in(places))
    pending = [seg for seg in pending if has_unknown_views(seg, use)]
    if pending and search_all:
        found += _adopt(pending, _python_tensors())
        pending = [seg for seg in pending if has_unknown_views(seg, use)]
    if learn:
        for seg in pending:
            seg.expected_refs[use] = untracked_refs(seg)
    return found, pending


def has_unknown_views(seg, use) -> bool:
    return untracked_refs(seg) > seg.expected_refs.get(use, 0)


def _adopt(segs, tensors) -> int:
    by_key = {seg.storage_key: seg for seg in segs}
    found = 0
    for t in tensors:
        try:
            key = storage_key(inner_tensors(t)[0][1] if is_wrapper(t) else t)  # (a quantized weight: by its bytes)
            seg = by_key.get(key)
        except (RuntimeError, NotImplementedError, TypeError, IndexError):
            continue  # a tensor with no storage of its own
        if seg is not None and t is not seg.flat and id(t) not in TENSORS:  # (not one of its own)
            found += guards.remember_alias(seg, t)
    return found


def _tensors_in(places):
    """Tensors among `places`: leaves of outputs, and each module's tensor
    attributes (directly or in a list, tuple or dict)."""
    for place in places:
        if isinstance(place, nn.Module):
            for key, value in vars(place).items():
                if key in ("_parameters", "_buffers", "_modules"):
                    continue
                if isinstance(value, torch.Tensor):
                    yield value
                elif isinstance(value, (list, tuple)):
                    yield from (v for v in value if isinstance(v, torch.Tensor))
                elif isinstance(value, dict):
                    yield from (v for v in value.values() if isinstance(v, torch.Tensor))
        else:
            yield from (t for t in tree_leaves(place) if isinstance(t, torch.Tensor))


def _python_tensors():
    """Every tensor object alive in Python. Only with no other Python thread
    running: `gc.get_objects()` also returns objects another thread is still
    building (a tuple it will resize), whose construction then fails."""
    is_tensor: dict = {}
    for obj in gc.get_objects():
        kind = type(obj)
        flag = is_tensor.get(kind)
        if flag is None:
            flag = is_tensor[kind] = issubclass(kind, torch._C.TensorBase)
        if flag:
            yield obj
