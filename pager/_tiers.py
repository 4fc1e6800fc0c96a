"""Tiers: where a segment's bytes live when they are not on the device.

[Note: tiers]
A tier holds pages (the bytes of a segment, laid out as on the device) and
moves them one tier up or down on the copy streams of a transport. The
residency engine (`_engine.py`) knows tiers only through this interface:

    hold(owner, nbytes)             a page for one segment of `owner`'s
    up(device_flat, page, after, encoded)
                                    copy a page to the tier above (here the
                                    device), ordered after the events `after`,
                                    decoding it if it is compressed (`encoded`);
                                    returns (start, end) timing marks
    down(page, device_flat, after)  the write-back, the other way
    release(owner)                  give back every page `owner` holds

Today there is one tier, pinned host memory, directly under the device. A
disk tier goes under it with the same interface: its `up` fills a host page
from a file, and the engine chains the two (disk -> host -> device). Pages
are held per owner (one per wrapped model) so that models sharing an engine
free their own pages when they are unwrapped.
"""

from __future__ import annotations

from ._host import HostArena


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

    def arena_of(self, owner) -> HostArena:
        """`owner`'s arena (made on first use)."""
        arena = self._arenas.get(owner)
        if arena is None:
            arena = self._arenas[owner] = HostArena(pin=self.pin)
        return arena

    def reserve(self, owner, sizes: list[int]) -> None:
        """Plan `owner`'s arena for pages of `sizes`, to be held in this order."""
        self.arena_of(owner).reserve(sizes)

    def hold(self, owner, nbytes: int):
        """A page of `nbytes` for one of `owner`'s segments."""
        return self.arena_of(owner).allocate(nbytes)

    def up(self, device_flat, page, after=(), encoded=None):
        if encoded is not None:  # a compressed page: decoded on the way ([Note: compressed pages])
            return self.transport.h2d_encoded(device_flat, page, encoded, after=after)
        return self.transport.h2d(device_flat, page, after=after)

    def down(self, page, device_flat, after=()):
        return self.transport.d2h(page, device_flat, after=after)

    def release(self, owner) -> None:
        """Give back `owner`'s pages (none may be used after this)."""
        arena = self._arenas.pop(owner, None)
        if arena is not None:
            arena.close()
