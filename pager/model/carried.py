"""State a forward carries from one call to the next (a KV cache), measured
so that it counts against the budget.

[Note: carried state]
Generation passes the model a cache object (Hugging Face's `DynamicCache`,
a legacy tuple of (key, value) pairs) that its layers grow in place. It can
be larger than the blocks' room (a 7B-shaped model's cache at batch 64 and
512 tokens is 8.6 GB), so the budget must see it. At the end of each root
forward, the device tensors held inside the objects and containers among
the forward's arguments are counted (by storage, once each); blocks get the
budget less that from then on, like activations ([Note: one budget] in
training/activations.py), and when it grew, idle blocks leave at once until blocks and
state fit the budget together. Plain tensor arguments (token ids, masks,
hidden states) are the caller's and are not counted. The walk follows
containers and objects' attributes a few levels deep and never enters
modules.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..base.block import storage_key

CARRIED_DEPTH = 4  # cache -> its list of layers -> a layer -> its key tensor, and one level to spare
_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, type)


def carried_bytes(values, device_type: str) -> int:
    """Device bytes of tensors inside objects and containers among `values`
    (a forward's positional and keyword arguments): see [Note: carried state].

    Example:
        >>> carried_bytes([torch.zeros(4), ([torch.zeros(2)],)], "cpu")
        8
    """
    seen_storages, seen_objects, total = set(), set(), 0
    stack = [(v, 0) for v in values]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, torch.Tensor):
            if depth == 0 or value.device.type != device_type:
                continue
            key = storage_key(value)
            if key not in seen_storages:
                seen_storages.add(key)
                total += value.untyped_storage().nbytes()
            continue
        if depth >= CARRIED_DEPTH or isinstance(value, (_ATOMS, nn.Module)) or id(value) in seen_objects:
            continue
        seen_objects.add(id(value))
        if isinstance(value, (list, tuple, set, frozenset)):
            stack += [(v, depth + 1) for v in value]
        elif isinstance(value, dict):
            stack += [(v, depth + 1) for v in value.values()]
        elif hasattr(value, "__dict__"):
            stack += [(v, depth + 1) for v in vars(value).values()]
    return total
