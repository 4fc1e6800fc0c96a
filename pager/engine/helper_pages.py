"""Pages kept in the helper GPUs' memory: `HelperPages`.

[Note: pages kept on helpers]
With `split_fetch`, other GPUs lend their PCIe links to the device ([Note:
split fetch] in engine/split_fetch.py), and their memory sits idle but for
two staging chunks. A model streamed for inference moves the same pages at
every pass: those the device's budget cannot keep. So each helper also
keeps pages, up to its budget (by default the device's): a page fetched a
second time is one the device could not keep, and once it has landed on
the device it is copied over the peer link into the helper with the most
room. From then on its fetch is one copy out of that helper's memory over
the peer link (NVLink, several times a PCIe link's rate), which leaves the
PCIe links to the pages no GPU keeps. Two GPUs with a budget each hold
twice the pages between them, as a layer split would, and what neither
holds is still split over both links.

Which pages:
- Plain pages of weights (and frozen weights) that split; gradients and
  optimizer state change at every step, and compressed pages are decoded
  from the device's own link.
- Kept at the second fetch since they last changed, while a helper has
  room. Nothing kept leaves to make room for another: a pass reads its
  pages in one order, and trading them round would cost in every pass the
  copies it saves (LRU's loss on a cyclic scan).
- A page whose host copy changes (written back from the device, or updated
  on the host by the optimizer) drops its copy at once, before any fetch
  could read it. One that changes twice is being trained: it is not kept
  again, which would cost a copy to the helper at every step. A page
  changed once (`load_state_dict` after `wrap`) is kept again.

Ordering (torch's copy between two devices runs on the current stream of
the source's device, after a wait for the destination device's current
stream, which then waits for the copy):
- Keeping: the page is copied from the device while the device's current
  stream is the join stream, after the fetch's every share has landed
  there, and the helper's current stream is its keep stream. The fetch's
  end is recorded after this copy: compute, and so the free of the device
  memory it reads, wait for it (at the keeping pass only).
- Reading: the copy runs on the helper's keep stream after `start` (the
  device memory is free to write only from then on, as for a helper's
  share), the device's current stream being the join stream, which the
  fetch's end is recorded on.
- A kept copy's memory is allocated on the keep stream, and each write of it
  and each read ends before later work on that stream, so it is freed at
  once when dropped: only allocations on that stream reuse it.
"""

from __future__ import annotations

import logging

import torch

from ..base.budget import format_bytes

log = logging.getLogger("pager")

CHANGES_OF_TRAINED = 2  # a page whose host copy changed this often is being trained: not kept again


class _Keeper:
    """One helper's kept pages: its stream and the room left in its budget."""

    def __init__(self, helper, room_bytes: int):
        self.helper = helper  # split_fetch._Helper
        self.stream = torch.cuda.Stream(helper.device)
        self.room_bytes = room_bytes
        self.budget_bytes = room_bytes


class _Kept:
    __slots__ = ("keeper", "page")

    def __init__(self, keeper: _Keeper, page: torch.Tensor):
        self.keeper, self.page = keeper, page


class HelperPages:
    """Copies of the device's streamed pages in its helpers' memory (see
    [Note: pages kept on helpers]).

    Args:
        split: the `SplitFetch` whose helpers keep pages (and whose join
            stream the device's side of each copy runs on).
        budgets: per helper, the bytes it may hold: its staging, then pages.
    """

    def __init__(self, split, budgets: list[int]):
        self.split = split
        self.keepers = [_Keeper(h, max(0, b - split.staging_bytes)) for h, b in zip(split.helpers, budgets)]
        self.kept: dict = {}  # segment -> _Kept
        self.seen: set = set()  # segments fetched once since they last changed (not kept)
        self.changes: dict = {}  # segment -> how often its host page changed
        self.held_bytes = 0

    def find(self, seg):
        """The helper's copy of `seg`'s page, or None."""
        return self.kept.get(seg)

    def copy_up(self, kept: _Kept, device_flat: torch.Tensor, start) -> torch.cuda.Event:
        """Enqueue the copy of `kept` into `device_flat` over the peer link;
        its end (on the join stream)."""
        split, keeper = self.split, kept.keeper
        # The device's memory is free to write only from `start` on (its last readers).
        keeper.stream.wait_event(start)
        with split.current(split.join_stream, split.device.index), split.current(keeper.stream, keeper.helper.index):
            device_flat.copy_(kept.page, non_blocking=True)
        return self._end()

    def landed(self, seg, device_flat: torch.Tensor, end) -> torch.cuda.Event:
        """`seg`'s page is coming up into `device_flat` (all of it there at
        `end`, on the join stream): keep a copy on a helper if this is its
        second fetch since it changed and one has room. The fetch's end."""
        if self.changes.get(seg, 0) >= CHANGES_OF_TRAINED:
            return end
        if seg not in self.seen:
            self.seen.add(seg)  # (the first: the device may keep it for life)
            return end
        nbytes = device_flat.numel()
        keeper = max(self.keepers, key=_room)
        if keeper.room_bytes < nbytes:
            return end
        page = self._allocate(keeper, nbytes)
        if page is None:
            return end
        self.seen.discard(seg)
        split = self.split
        # After `end` on the join stream: every share has landed.
        with split.current(split.join_stream, split.device.index), split.current(keeper.stream, keeper.helper.index):
            page.copy_(device_flat, non_blocking=True)
        self.kept[seg] = _Kept(keeper, page)
        keeper.room_bytes -= nbytes
        self.held_bytes += nbytes
        return self._end()

    def changed(self, seg) -> None:
        """`seg`'s host page changes now: its copy is stale."""
        self.changes[seg] = self.changes.get(seg, 0) + 1
        self.seen.discard(seg)
        self._drop_copy(seg)

    def drop(self, seg) -> None:
        """Forget `seg` (its model is unwrapped)."""
        self.changes.pop(seg, None)
        self.seen.discard(seg)
        self._drop_copy(seg)

    def clear(self) -> None:
        """Drop every copy and what was learned."""
        for seg in list(self.kept):
            self.drop(seg)
        self.seen.clear()
        self.changes.clear()

    def _drop_copy(self, seg) -> None:
        kept = self.kept.pop(seg, None)
        if kept is not None:
            kept.keeper.room_bytes += kept.page.numel()
            self.held_bytes -= kept.page.numel()

    def _allocate(self, keeper: _Keeper, nbytes: int):
        # On the keep stream: its pool, which only work ordered after the copies reuses.
        try:
            with self.split.current(keeper.stream, keeper.helper.index):
                return torch.empty(nbytes, dtype=torch.uint8, device=keeper.helper.device)
        except torch.cuda.OutOfMemoryError:
            log.warning(
                "pager: %s has no room for a page of %s to keep (its budget for pages %s, %s kept); it "
                "keeps no more. Give it a lower budget in split_fetch={...: budget}.",
                keeper.helper.device,
                format_bytes(nbytes),
                format_bytes(keeper.budget_bytes),
                format_bytes(keeper.budget_bytes - keeper.room_bytes),
            )
            keeper.room_bytes = 0
            return None

    def _end(self) -> torch.cuda.Event:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.split.join_stream)
        return end


def _room(keeper: _Keeper) -> int:
    return keeper.room_bytes
