"""Tiers: where a segment's bytes live when they are not on the device.

[Note: tiers]
A tier holds pages (the bytes of a segment, laid out as on the device) and
moves them one tier up or down on the copy streams of a transport. The
residency engine (`engine/engine.py`) knows tiers only through this interface:

    hold(owner, nbytes)             a page for one segment of `owner`'s
    up(block, seg, after)           copy `seg`'s page to the tier above (the
                                    device), ordered after the events `after`,
                                    decoding it if it is compressed; returns
                                    (start, end) timing marks
    down(block, seg, after)         the write-back, the other way (into a
                                    new page of the owner's own where the
                                    page is compressed or shared)
    release(owner)                  give back every page `owner` holds

Pinned host memory sits directly under the device; with `split_fetch`,
helper GPUs' memory keeps copies of some pages between the two ([Note:
pages kept on helpers] in engine/helper_pages.py). A model loaded with a
host budget (`pager.load`) has a disk tier under its host pages
([Note: the disk tier] in engine/disk.py): `up` first has the disk tier read the
page into host memory (or wait for its read ahead), `down` has it place the
page, and the disk tier spills changed pages when host memory needs room.
Pages are held per owner (one per wrapped model) so that models sharing an
engine free their own pages when they are unwrapped.
"""

from __future__ import annotations

from ..base.budget import format_bytes
from ..base.common import WEIGHTS
from .host import HostArena


class HostTier:
    """Pinned host pages, sub-allocated from a few large arenas (one per owner).

    Args:
        transport: the device's transport (its copy streams move the pages).
        pin: page-lock the arenas (needed for asynchronous copies to a GPU).
    """

    def __init__(self, transport, pin: bool):
        self.transport = transport
        self.pin = pin
        self._arenas: dict = {}  # owner -> HostArena
        self.disks: dict = {}  # owner -> DiskTier, for owners whose pages are a cache of the disk

    def arena_of(self, owner) -> HostArena:
        """`owner`'s arena (made on first use)."""
        arena = self._arenas.get(owner)
        if arena is None:
            arena = self._arenas[owner] = HostArena(pin=self.pin)
        return arena

    def reserve(self, owner, sizes: list[int]) -> None:
        """Plan `owner`'s arena for pages of `sizes`, to be held in this order."""
        self.arena_of(owner).reserve(sizes)

    def share(self, owner, path: str) -> None:
        """`owner`'s planned pages (its weights) come from the shared file `path`."""
        self.arena_of(owner).share(path)

    def is_shared(self, owner, page) -> bool:
        return page is not None and self.arena_of(owner).is_shared(page)

    def hold(self, owner, nbytes: int):
        """A page of `nbytes` for one of `owner`'s segments (None under a
        disk tier: placed when it is first written)."""
        if owner in self.disks:
            return None
        return self.arena_of(owner).allocate(nbytes)

    def up(self, block, seg, after=()):
        kept_pages = self.transport.kept_pages
        if kept_pages is not None and kept_pages.find(seg) is not None:
            # A helper GPU keeps a copy ([Note: pages kept on helpers] in engine/helper_pages.py): no host page read.
            return self.transport.h2d(seg.flat, seg.host, after=after, seg=seg)
        disk = self.disks.get(block.owner)
        if disk is not None:
            disk.page_in(seg)
        if seg.encoded is not None:  # a compressed page: decoded on the way ([Note: compressed pages])
            marks = self.transport.h2d_encoded(seg.flat, seg.host, seg.encoded, after=after)
        else:
            marks = self.transport.h2d(seg.flat, seg.host, after=after, seg=seg if seg.kind in WEIGHTS else None)
        if disk is not None:
            disk.used(seg, marks[1] if self.transport.is_cuda else None)
        return marks

    def down(self, block, seg, after=()):
        if self.transport.kept_pages is not None and seg.kind in WEIGHTS:
            self.transport.kept_pages.changed(seg)  # (a helper's copy of the page is stale from now on)
        if seg.encoded is not None:
            self._store_plain(block, seg)
        elif seg.shared:
            self._store_private(block, seg)
        disk = self.disks.get(block.owner)
        if disk is not None:
            disk.page_for_write(seg)
        marks = self.transport.d2h(seg.host, seg.flat, after=after)
        if disk is not None:
            disk.written(seg, marks[1] if self.transport.is_cuda else None)
        return marks

    def _store_plain(self, block, seg) -> None:
        """`seg`'s page is compressed and its values changed: they go to a
        new plain page, where they stay ([Note: compressed pages] in codec/compress.py)."""
        block.owner.warn_once(
            f"plain:{block.name}",
            "pager: the weights of block %r changed (an optimizer step, load_state_dict, "
            "running statistics); its compressed page is replaced by a plain one (%s more host memory), "
            "and it fetches uncompressed from now on.",
            block.name,
            format_bytes(seg.nbytes),
        )
        seg.host = self.hold(block.owner, seg.nbytes)
        seg.encoded = None

    def _store_private(self, block, seg) -> None:
        """`seg`'s page is in the node's shared copy and its values changed
        here: they go to a page of this rank's own (copy on write), so the
        other ranks keep reading the copy they share."""
        block.owner.warn_once(
            "private-pages",
            "pager: weights of block %r changed (an optimizer step, load_state_dict, running "
            "statistics): its page leaves the host copy the node's ranks share, and this rank keeps its own "
            "from now on (so will other blocks that change). Sharing saves host memory for inference.",
            block.name,
        )
        seg.host = self.hold(block.owner, seg.nbytes)
        seg.shared = False

    def ready(self, block, kinds) -> bool:
        """A fetch of `kinds` of `block` (and its deps' weights) would not
        wait on the disk."""
        disk = self.disks.get(block.owner)
        if disk is None:
            return True
        segs = [s for k, s in block.segments.items() if k in kinds]
        segs += [w for d in block.deps for w in d.weight_segments]
        kept_pages = self.transport.kept_pages  # (a page a helper keeps is not read from disk)
        return all(
            s.resident or disk.ready(s) or (kept_pages is not None and kept_pages.find(s) is not None) for s in segs
        )

    def release(self, owner) -> None:
        """Give back `owner`'s pages (none may be used after this)."""
        disk = self.disks.pop(owner, None)
        if disk is not None:
            disk.close()
        arena = self._arenas.pop(owner, None)
        if arena is not None:
            arena.close()
