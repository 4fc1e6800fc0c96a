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
overwritten), and runs under saved-tensor hooks of its own: a tensor the
forward saves that views those copies is kept as a recipe (the host tensor,
the experts the view covers, its sizes, strides and offset in them, the
host tensor's version), and the backward gets it back copied from the host
tensors (page-locked on CUDA: on the compute stream, before the kernels that
read it). So an expert no token reached is copied for neither pass, a view
of one expert brings that one back, and the device holds one call's copies
at a time. Everything else the forward saves (its activations; the
per-token copies `batched_mm` gathers) goes to the hooks beneath, as if
these were not there: pager's activation policy (kept and counted, sent to
host memory, recomputed: [Note: one budget] in training/activations.py) or
the user's (torch's checkpoint). The hooks are pushed as a frame of
pager's saving stack (base/saving.py), so a forward that an interrupt ends
without its post-hook has them popped with the frames above its block's.

A copy is known by its storage only while it is alive: `SavedExperts` keeps
the call's copies (one run of tokens' at a time) until the next run or the
call's end, so no other tensor can take their addresses meanwhile. The host
tensors are the values (the experts are frozen); one changed between the
forward and the backward is an error, as autograd makes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..base import saving


class Recipe(NamedTuple):
    """How to make a saved view of experts' copies again, from the host."""

    host: torch.Tensor  # the parameter's host tensor (every expert)
    version: int  # its version when the forward saved the view
    experts: list  # the experts the view covers, in order (the copy's first dimension)
    device: torch.device
    size: tuple
    stride: tuple
    offset: int  # in the copy of `experts`
    counters: Any  # the pager's `Counters` (what the backward copies counts there)


class Below(NamedTuple):
    """What the hooks beneath these packed, with their unpack."""

    unpack: Callable
    packed: object


class SavedExperts:
    """Saved-tensor hooks for one call of an experts module with gradients
    through its input.

    Args:
        hosts: the module's parameters' host tensors, in order.
        counters: the pager's `Counters`.

    Example (inside pager; experts/table.py):
        >>> saved = SavedExperts(table.hosts, pager.counters)
        >>> saved.begin()  # the pre-hook
        >>> saved.add(values, experts)  # the call's copies of `experts`, one per parameter
        >>> saved.end()  # the post-hook
    """

    def __init__(self, hosts: list, counters):
        self.hosts, self.counters = hosts, counters
        self._copies: dict = {}  # storage address -> (parameter's index, the experts copied)
        self._alive: list = []  # the copies themselves (see the Note)
        self._below: tuple | None = None  # the hooks beneath (pack, unpack), if any
        self._begun = False

    def begin(self) -> None:
        """Put the hooks on, above those there are, as a frame of pager's saving stack."""
        top = saving.top_hooks()
        self._below = top if isinstance(top, tuple) else None
        self._begun = saving.begin_foreign(self.pack, unpack)

    def end(self) -> None:
        if self._begun:
            saving.end_saving()
            self._begun = False
        self._copies.clear()
        self._alive = []

    def add(self, values: list, experts: list) -> None:
        """The copies of `experts` one run of tokens reads (the last run's are done)."""
        self._copies.clear()
        self._alive = list(values)
        for i, value in enumerate(values):
            self._copies[value.untyped_storage().data_ptr()] = (i, list(experts))

    def pack(self, t: torch.Tensor):
        """A recipe for a view of the copies; anything else, as the hooks beneath pack it."""
        found = self._copies.get(_address(t)) if self._copies else None
        if found is None:
            return t if self._below is None else Below(self._below[1], self._below[0](t))
        i, experts = found
        host = self.hosts[i]
        row = host[0].numel()  # (elements of one expert)
        first, last = _rows_covered(t, row)
        return Recipe(
            host,
            host._version,
            experts[first : last + 1],
            t.device,
            tuple(t.size()),
            tuple(t.stride()),
            int(t.storage_offset()) - first * row,
            self.counters,
        )


def unpack(packed):
    """A saved tensor: itself, the hooks beneath's, or a view of experts' copies made again from the host."""
    if isinstance(packed, Below):
        return packed.unpack(packed.packed)
    if not isinstance(packed, Recipe):
        return packed
    host = packed.host
    if host._version != packed.version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"the paged experts' weights [{list(host.shape)}] changed between the forward and the backward "
            "(checked by pager, as autograd does)."
        )
    copy = rows_of(host, packed.experts, packed.device)  # (page-locked on CUDA: ordered on the compute stream)
    packed.counters.expert_saved_h2d_bytes += copy.numel() * copy.element_size()
    return copy.as_strided(packed.size, packed.stride, packed.offset)


def rows_of(host: torch.Tensor, experts: list, device: torch.device) -> torch.Tensor:
    """Rows `experts` of `host` (in that order) in a tensor of their own on
    `device`: on CUDA a copy per run of consecutive experts from the
    page-locked host tensor, on the compute stream."""
    if device.type == "cpu":
        return host.index_select(0, torch.tensor(experts, dtype=torch.long))
    out = torch.empty((len(experts), *host.shape[1:]), dtype=host.dtype, device=device)
    start = 0
    for i in range(1, len(experts) + 1):
        if i == len(experts) or experts[i] != experts[i - 1] + 1:
            out[start:i].copy_(host[experts[start] : experts[i - 1] + 1], non_blocking=True)
            start = i
    return out


def _address(t: torch.Tensor):
    """`t`'s storage's address, or None (a tensor of no plain storage: a wrapper subclass)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _rows_covered(t: torch.Tensor, row: int) -> tuple[int, int]:
    """The first and last of the copy's experts (rows of `row` elements) that view `t` reads."""
    offset = int(t.storage_offset())
    if t.numel() == 0:
        return offset // row, offset // row - 1
    extent = sum((size - 1) * stride for size, stride in zip(t.size(), t.stride()))
    return offset // row, (offset + extent) // row
