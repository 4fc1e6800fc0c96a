"""What the engine asks of the models it serves: the `Owner` protocol
([Note: the residency engine] in engine/engine.py)."""

from __future__ import annotations

from typing import Protocol


class Owner(Protocol):
    """What the engine asks of a block's owner; `Pager` implements it.

    The engine keeps `resident_bytes` and `total_bytes` (the owner's share of
    its own) up to date, and reads the rest.
    """

    resident_bytes: int
    total_bytes: int
    counters: object  # a `Stats`: copy bytes and seconds, evictions, peaks
    tracer: object  # a `Tracer`: spans of fetches, waits and write-backs
    scheduler: object  # a `Scheduler`: `distance_to(block)`, `kept`
    least_room: int  # the least room its blocks run in
    min_budget_bytes: int  # the least budget it runs in alone
    name: str  # how messages and the pool name it
    carried_bytes: int  # device bytes of state its forwards carry (a KV cache), held out of the room
    row_bytes: int  # device bytes of its row tables' caches, held out of the room
    outside_bytes: int  # device bytes the process holds outside pager, held out of the room (budget_covers="process")
    step_bytes: int  # device bytes an optimizer update holds beside the pages while it runs, held out of the room

    def fixed_bytes(self) -> int:
        """Device bytes of its blocks that stay for life (its remainder, blocks it uses)."""

    def evictions_blocked(self) -> bool:
        """Nothing of this owner may leave now (a forward runs without hooks)."""

    def busy(self) -> bool:
        """A forward (or backward) of this owner is in flight."""

    def blocking_threads(self) -> set:
        """Threads whose forwards keep this owner's blocks from leaving
        (`evictions_blocked`) until they end."""

    def activation_reserve_bytes(self):
        """Device bytes its activations take from the budget, or None if it
        does not page activations (the budget is then its blocks')."""

    def host_pages_ready(self, block) -> None:
        """Before `block`'s pages are copied up: work on them in host memory
        (an optimizer update on the host) is done."""

    def grads_arriving(self, block, seg) -> None:
        """A grads page is about to be fetched: set `seg.host_valid` to whether
        its page holds a gradient still wanted (else nothing is copied)."""

    def may_leave(self, block) -> bool:
        """`block` was chosen to leave: False if it must stay after all."""

    def leave_after(self, block, ready):
        """The event its pages' write-back and the reuse of their memory wait
        for: `ready` (compute is done with them), or later (an all-reduce of
        its gradients in flight: [Note: a block is the bucket] in training/distributed.py)."""

    def pages_leaving(self, block) -> None:
        """Before the write-back is ordered: put values that live elsewhere
        (gradients autograd put beside the page) into the pages."""

    def page_leaving(self, block, seg, ready, dirty: bool) -> bool:
        """Whether `seg`'s device bytes must be written back (`dirty`: they
        changed since the fetch); `ready` orders reads after compute."""

    def left(self, block) -> None:
        """`block` has left the device."""

    def blocks_moved(self) -> None:
        """The engine's resident bytes changed."""

    def warn_once(self, key: str, msg: str, *args) -> None:
        """Log a warning once per owner."""
