"""Fetches split over the PCIe links of several GPUs: `SplitFetch`.

[Note: split fetch]
A paged model's forward is bound by one PCIe link (about 55 GB/s pinned on
Gen5 x16) while the host's other GPUs leave theirs idle. With
`wrap(..., split_fetch=["cuda:1"])` a page's copy up to the device is cut
into shares: the device's own h2d stream copies the first over its link,
and each helper GPU copies its share over its own link into a staging
buffer in its memory, then on to the device over the peer link (NVLink,
several times a PCIe link's rate). A helper's share goes in chunks
(`CHUNK_BYTES`) on two streams by turns, each chunk copied up and then
across on one stream, so one stream's link copy runs while the other's
chunk crosses, and a stream's own order keeps its staging buffer from
being overwritten before it has crossed: no event per chunk. All links
carry the page at once: with one helper a fetch takes about half the time.
Only the device computes; each helper lends its link and two chunks of
its memory (`staging_bytes`), nothing of the device's budget.

Ordering, by events as everywhere in transport.py:
- A helper's streams wait on `start` before their first copy: recorded on
  the device's h2d stream after the fetch's own waits (the destination's
  last readers, the page's write-back), so a crossing never writes memory
  still in use, as the device's own copy does not.
- torch's copy between two devices orders itself after the current streams
  of both devices, and the destination's current stream after itself. While
  a fetch's chunks cross, the device's current stream is the join stream:
  it runs nothing else, so it gathers every crossing without holding back
  compute or the h2d stream.
- The fetch ends on the join stream once it has also waited for the
  device's own share; compute waits on that end as on a plain copy's. A
  fetch whose last copy was a plain one joins the split copies before it
  in `CudaTransport.mark_h2d`.

A page below `SPLIT_MIN_BYTES` goes over the device's link alone (its copy
is short; the events would cost more than they save), and so does a
compressed page (its pieces are decoded from the device's staging ring).
"""

from __future__ import annotations

import logging

import torch

from ..base.budget import parse_budget

log = logging.getLogger("pager")

SPLIT_MIN_BYTES = 4 << 20  # smaller pages go over the device's own link alone
CHUNK_BYTES = 32 << 20  # a helper's share goes up and across in chunks of this
ALIGN_BYTES = 1 << 16  # shares start at multiples of this


def resolve_helpers(split_fetch, device: torch.device, pin: bool) -> list[torch.device]:
    """The helper GPUs `split_fetch` names, checked; [] for None.

    `split_fetch` is None, "all" (every other GPU that can write to
    `device` over a peer link), a device, a list of devices, or a dict of
    devices to their budgets (`helper_budgets`)."""
    if split_fetch is None:
        return []
    if device.type != "cuda":
        raise ValueError(
            f"pager: split_fetch={split_fetch!r} splits fetches over several GPUs' links; this model "
            f"runs on {device}. Run it on a CUDA device, or leave split_fetch out."
        )
    if not pin:
        raise ValueError(
            "pager: split_fetch= needs page-locked host pages (pin=True): a copy from pageable memory "
            "runs through the host's own staging and gains nothing from a second link."
        )
    own = device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(split_fetch, str) and split_fetch == "all":
        helpers = [
            torch.device("cuda", i)
            for i in range(torch.cuda.device_count())
            if i != own and torch.cuda.can_device_access_peer(i, own)
        ]
        if not helpers:
            log.warning(
                'pager: split_fetch="all": no other GPU of this process can write to cuda:%d over a peer '
                "link (%d visible); fetches go over its own link alone.",
                own,
                torch.cuda.device_count(),
            )
        return helpers
    names = list(split_fetch) if isinstance(split_fetch, (list, tuple, dict)) else [split_fetch]
    helpers = []
    for name in names:
        helper = _device_of(name, split_fetch)
        if helper.index == own:
            raise ValueError(
                f"pager: split_fetch={split_fetch!r} names the model's own device (cuda:{own}); name "
                f"only other GPUs, whose links would otherwise stay idle."
            )
        if helper in helpers:
            raise ValueError(f"pager: split_fetch={split_fetch!r} names {helper} twice; name each GPU once.")
        if not torch.cuda.can_device_access_peer(helper.index, own):
            raise ValueError(
                f"pager: split_fetch: {helper} cannot write to cuda:{own} over a peer link (no NVLink "
                f"or PCIe peer access between them), so its share would cross through host memory "
                f"again; leave it out of split_fetch."
            )
        helpers.append(helper)
    return helpers


def helper_budgets(split_fetch, helpers: list[torch.device], budget_bytes: int) -> list[int]:
    """What each of `helpers` (from `resolve_helpers`) may hold in its memory,
    its staging and the pages it keeps ([Note: pages kept on helpers] in
    engine/helper_pages.py): the budget a dict `split_fetch` gives it (as
    `wrap`'s budget, or 0: its staging alone), else `budget_bytes`, the
    device's."""
    if not isinstance(split_fetch, dict):
        return [budget_bytes] * len(helpers)
    budgets = []
    for value, helper in zip(split_fetch.values(), helpers):  # (resolve_helpers keeps the dict's order)
        if isinstance(value, int) and not isinstance(value, bool) and value == 0:
            budgets.append(0)
            continue
        try:
            budgets.append(parse_budget(value, helper))
        except ValueError as e:
            raise ValueError(
                f"pager: split_fetch={split_fetch!r}: the budget for {helper} is not understood "
                f'({e}). Give each helper a budget as for wrap ("20GiB", bytes, "50%"), or 0 '
                f"for its staging alone."
            ) from None
    return budgets


def _device_of(name, split_fetch) -> torch.device:
    try:
        is_index = isinstance(name, int) and not isinstance(name, bool)
        helper = torch.device("cuda", name) if is_index else torch.device(name)
    except (RuntimeError, TypeError):
        helper = None
    if helper is None or helper.type != "cuda" or helper.index is None:
        raise ValueError(
            f"pager: split_fetch={split_fetch!r}: {name!r} is not a CUDA device with an index; give "
            f'devices such as "cuda:1" or 1, or "all".'
        )
    if helper.index >= torch.cuda.device_count():
        raise ValueError(
            f"pager: split_fetch={split_fetch!r}: {helper} does not exist; this process sees "
            f"{torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES)."
        )
    return helper


class _Helper:
    """One helper GPU: two streams, each with its staging buffer, taken by turns."""

    def __init__(self, helper: torch.device, chunk_bytes: int):
        self.device = helper
        self.index = helper.index
        # Each copies a chunk up over the helper's link, then across to the device.
        self.streams = [torch.cuda.Stream(helper) for _ in range(2)]
        with torch.cuda.device(helper):
            self.staging = [torch.empty(chunk_bytes, dtype=torch.uint8, device=helper) for _ in range(2)]
        self.turn = 0
        self.carried_bytes = 0


class SplitFetch:
    """The copy of one page up to `device`, in shares over the device's own
    link and the helpers' (see [Note: split fetch])."""

    def __init__(self, device: torch.device, helpers: list[torch.device], current):
        self.device = device
        self.min_bytes, self.chunk_bytes = SPLIT_MIN_BYTES, CHUNK_BYTES
        self.helpers = [_Helper(h, self.chunk_bytes) for h in helpers]
        self.join_stream = torch.cuda.Stream(device)
        self.current = current  # (stream, device index) -> a context making it current (`_Current`)
        self.own_share = 1.0 / (1 + len(helpers))  # of each split page, over the device's own link

    @property
    def staging_bytes(self) -> int:
        """Memory each helper holds for its staging (out of no budget of the device's)."""
        return 2 * self.chunk_bytes

    def splits(self, nbytes: int) -> bool:
        return nbytes >= self.min_bytes

    def helper_bytes(self, nbytes: int) -> int:
        """Of a page of `nbytes`, what the helpers' links carry."""
        return nbytes - self._own_bytes(nbytes) if self.splits(nbytes) else 0

    def _own_bytes(self, nbytes: int) -> int:
        return min(nbytes, -(-int(nbytes * self.own_share) // ALIGN_BYTES) * ALIGN_BYTES)

    def copy(self, device_flat: torch.Tensor, host: torch.Tensor, h2d_stream, start):
        """Enqueue the copy of `host` into `device_flat` (both uint8, equal
        sizes): the device's share on `h2d_stream` (current; `start` recorded
        on it after its waits), the rest over the helpers. Returns the event
        on the join stream after every share."""
        nbytes = device_flat.numel()
        own = self._own_bytes(nbytes)
        device_flat[:own].copy_(host[:own], non_blocking=True)
        own_end = torch.cuda.Event()
        own_end.record(h2d_stream)
        rest = nbytes - own
        bounds = [own + rest * k // len(self.helpers) for k in range(len(self.helpers) + 1)]
        # The device's side of each crossing is the join stream (see Note).
        with self.current(self.join_stream, self.device.index):
            for helper, lo, hi in zip(self.helpers, bounds, bounds[1:]):
                if hi > lo:
                    self._carry(helper, device_flat, host, lo, hi, start)
        self.join_stream.wait_event(own_end)  # the device's own share has landed too
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.join_stream)
        return end

    def _carry(self, helper: _Helper, device_flat, host, lo: int, hi: int, start) -> None:
        """Bytes [lo, hi) over `helper`: chunk by chunk, up into a staging
        buffer and across to the device, on its two streams by turns."""
        chunks = range(lo, hi, self.chunk_bytes)
        for k in range(min(2, len(chunks))):
            # The destination is the h2d stream's memory: free to write only from `start` on.
            helper.streams[(helper.turn + k) % 2].wait_event(start)
        for off in chunks:
            n = min(self.chunk_bytes, hi - off)
            i = helper.turn
            helper.turn = 1 - i
            staged = helper.staging[i][:n]
            # One stream: the chunk crosses after it is up, and the next chunk
            # up this buffer waits for this crossing.
            with self.current(helper.streams[i], helper.index):
                staged.copy_(host[off : off + n], non_blocking=True)
                device_flat[off : off + n].copy_(staged, non_blocking=True)
        helper.carried_bytes += hi - lo

    def join(self, mark):
        """An event after `mark` (on the device's h2d or decode stream) and
        after every split copy enqueued so far."""
        self.join_stream.wait_event(mark)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.join_stream)
        return end
