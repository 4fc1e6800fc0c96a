"""What autograd saves of paged experts, kept on the host: `SavedExperts`.

[Note: a backward through paged experts]
Fine-tuning around a mixture's experts (LoRA on attention, or training the
rest of the model with the experts frozen) needs the gradient through them
to their input: a product's backward reads the weights its forward read.
Those weights were the call's device copies of its routed experts, and
autograd would keep them until the backward: every layer's routed experts on
the device at once, or, were they the cache's own slots, slots that later
calls overwrite before the backward reads them.

So a call with gradients through its input (and frozen experts) gets its
routed experts copied out of the cache in the order of their numbers (the
compact call of [Note: experts paged one by one]: a tensor of its own, never
overwritten), and runs under saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`): a tensor the forward saves
that shares the storage of those copies is kept as a recipe (the host
tensor, the experts' numbers, the view's sizes, strides and offset), and the
backward gets it back copied from the host tensors (page-locked on CUDA: on
the compute stream, before the kernels that read it). So an expert no token
reached is neither copied for the forward nor for the backward, and the
device holds one call's experts at a time. The host tensors are the values
(the experts are frozen: a change outside a forward drops the cached copies,
experts/table.py).

A copy is known by its storage only while it is alive: `SavedExperts` keeps
the call's copies (one run of tokens' at a time) until the next run or the
call's end, so no other tensor can take their addresses meanwhile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Recipe(NamedTuple):
    """How to make a saved view of experts' copies again, from the host."""

    host: torch.Tensor  # the parameter's host tensor (every expert)
    experts: list  # the experts copied, in order (the copy's first dimension)
    device: torch.device
    size: tuple
    stride: tuple
    offset: int


class SavedExperts:
    """Saved-tensor hooks for one call of an experts module with gradients
    through its input.

    Args:
        hosts: the module's parameters' host tensors, in order.

    Example (inside pager; experts/table.py):
        >>> saved = SavedExperts(table.hosts)
        >>> saved.hooks.__enter__()  # the pre-hook
        >>> saved.add(values, experts)  # the call's copies of `experts`, one per parameter
        >>> saved.hooks.__exit__(None, None, None)  # the post-hook
    """

    def __init__(self, hosts: list):
        self.hosts = hosts
        self._copies: dict = {}  # storage address -> (parameter's index, the experts copied)
        self._alive: list = []  # the copies themselves (see the Note)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)

    def add(self, values: list, experts: list) -> None:
        """The copies of `experts` one run of tokens reads (the last run's are done)."""
        self._copies.clear()
        self._alive = list(values)
        for i, value in enumerate(values):
            self._copies[value.untyped_storage().data_ptr()] = (i, list(experts))

    def clear(self) -> None:
        self._copies.clear()
        self._alive = []

    def pack(self, t: torch.Tensor):
        found = self._copies.get(t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else None
        if found is None:
            return t
        i, experts = found
        return Recipe(self.hosts[i], experts, t.device, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))


def unpack(packed):
    """A saved tensor: itself, or a view of experts' copies made again from the host."""
    if not isinstance(packed, Recipe):
        return packed
    host = packed.host
    copy = torch.empty((len(packed.experts), *host.shape[1:]), dtype=host.dtype, device=packed.device)
    for row, expert in enumerate(packed.experts):
        copy[row].copy_(host[expert], non_blocking=True)  # (page-locked on CUDA: ordered on the compute stream)
    return copy.as_strided(packed.size, packed.stride, packed.offset)
