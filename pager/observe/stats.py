"""Counters a user can read: totals and per block."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..base.budget import format_bytes


@dataclass
class BlockStats:
    """What one block did since the last `reset()`."""

    name: str
    nbytes: int = 0
    fetches: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetches: int = 0
    on_demand: int = 0  # accesses to its tensors outside its use that fetched it
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_seconds: float = 0.0
    d2h_seconds: float = 0.0
    stall_seconds: float = 0.0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0

    @property
    def h2d_gbps(self) -> float:
        """Achieved host-to-device GB/s while this block's pages were copied in."""
        return self.h2d_bytes / self.h2d_seconds / 1e9 if self.h2d_seconds else 0.0


@dataclass
class Stats:
    """Totals since the last `reset()`; `blocks` holds the per-block rows.

    `hits` count uses that found the block resident or already in flight,
    `misses` uses that had to fetch it on demand. `stall_seconds` is the time
    compute waited for fetches (on CUDA: from events, so it is what the GPU
    waited, not the host; on the CPU device: the synchronous copy time).
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetches: int = 0
    stall_seconds: float = 0.0
    h2d_seconds: float = 0.0  # time the copy streams were busy, each way
    split_fetch_bytes: int = 0  # of h2d_bytes, what other GPUs' links carried (split_fetch=)
    helper_page_bytes: int = 0  # of h2d_bytes, what came from copies other GPUs keep (split_fetch=)
    d2h_seconds: float = 0.0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    budget_bytes: int = 0
    steps: int = 0
    order_changes: int = 0
    deferred_steps: int = 0  # optimizer updates of a block deferred to its next use
    host_steps: int = 0  # optimizer updates of a block run on the host ([Note: the optimizer step on the host])
    host_step_seconds: float = 0.0  # the host's time running them
    host_step_wait_seconds: float = 0.0  # time fetches waited for them
    host_master_passes: int = (
        0  # float32 masters those updates updated in one pass ([Note: a master's update in one pass])
    )
    owner_wait_seconds: float = 0.0  # block_owners=True: time fetches waited for the blocks' owners' updates
    row_hits: int = 0  # row tables: rows a lookup or an update found in the device cache
    row_misses: int = 0  # ... and rows it did not (read ahead, or read from the host table)
    row_ahead_hits: int = 0  # ... of those, rows taken from rows read ahead (`expect_rows`)
    row_h2d_bytes: int = 0  # row bytes read from host tables (weights and state rows)
    row_d2h_bytes: int = 0  # row bytes written to host tables (changed rows leaving the cache, or not cached)
    row_flushes: int = (
        0  # reads of a row table's host tables (state_dict, a checkpoint) that wrote the cache's changes first
    )
    expert_hits: int = 0  # experts paged one by one: routed experts a call found in the device cache
    expert_misses: int = 0  # ... and those it copied in from host memory
    expert_h2d_bytes: int = 0  # ... their bytes, and those of experts copied ahead
    expert_ahead: int = 0  # experts copied ahead of their call, predicted ([Note: experts fetched ahead])
    expert_ahead_used: int = 0  # ... of those, experts a call then used
    expert_host: int = 0  # routed experts the cache lacked that the host computed ([Note: cold experts on the host])
    expert_saved_h2d_bytes: int = 0  # experts copied again from the host for a backward ([Note: a backward ...])
    expert_grad_d2h_bytes: int = 0  # trained experts: their gradients' bytes a backward sent to the host
    experts_stepped: int = 0  # ... and the experts `opt.step()` updated ([Note: experts trained one by one])
    reductions: int = 0  # data parallel: blocks whose gradients were averaged over the process group
    reduced_bytes: int = 0  # ... and their bytes (each all-reduce's input)
    on_demand: int = 0  # accesses to a paged-out block's tensors (outside its use) that fetched it
    resident_forwards: int = 0  # forwards run with every block resident and no block hooks
    resident_uses: int = 0  # their block uses (as many as the last hooked step had), not in `hits`
    # activations="offload" ([Note: activations off the device] in training/offload.py):
    activations_sent_bytes: int = 0  # saved activations copied to host memory during forwards
    activations_brought_bytes: int = 0  # copied back for backwards
    activations_ahead_bytes: int = 0  # of those, copied back before autograd asked for them
    activations_reused_bytes: int = 0  # not copied back: still on the device for their copy out, used there
    activations_policy: str = "keep"  # "auto" until it has chosen ([Note: activations, the automatic choice])
    activations_kept_blocks: int = 0  # "auto": blocks whose activations the last training pass kept on the device
    # activations="recompute" ([Note: activations recomputed] in training/recompute.py):
    recomputes: int = 0  # blocks' forwards run again in a backward
    activations_recomputed_bytes: int = 0  # what they saved again for the backward
    # Device memory by kind. Activations under the budget ([Note: one budget]
    # in training/activations.py; 0 with activations="keep", where the budget bounds blocks only):
    activation_bytes: int = 0  # activations pager holds on the device now
    peak_activation_bytes: int = 0  # the most at once
    activation_reserve_bytes: int = 0  # the share of the budget they take from blocks now
    peak_device_bytes: int = 0  # the most that blocks and activations held together
    # State the last forward carried on the device (a KV cache), held out of
    # the blocks' room ([Note: carried state] in model/carried.py):
    carried_bytes: int = 0
    peak_carried_bytes: int = 0
    # Under budget_covers="process": what the process holds on the device
    # outside pager at a step's peak, as last seen, held out of the blocks' room
    # ([Note: a budget that covers the process] in model/outside.py):
    outside_bytes: int = 0
    # With split_fetch: what the helper GPUs keep of the engine's pages now
    # ([Note: pages kept on helpers] in engine/helper_pages.py), out of no budget of the device's:
    helper_held_bytes: int = 0
    # The caching allocator's own figures (CUDA; 0 on the CPU device), which
    # also hold what pager does not: a block's temporaries while it runs, the
    # loss, gradients between blocks, the user's tensors, rounding:
    allocator_peak_bytes: int = 0  # torch.cuda.max_memory_allocated (since the user's last reset of it)
    allocator_reserved_bytes: int = 0  # torch.cuda.memory_reserved now (less the peak: fragmentation and cache)
    # Weights pages as stored now, and as they would be plain (`compress=`;
    # [Note: compressed pages] in codec/compress.py):
    page_bytes: int = 0
    plain_page_bytes: int = 0
    compressed_blocks: int = 0
    # The disk tier of a model loaded with a host budget ([Note: the disk tier] in engine/disk.py):
    disk_read_bytes: int = 0  # read from checkpoint and spill files into host pages
    disk_direct_bytes: int = 0  # ... of them, read with O_DIRECT (past the page cache)
    disk_cached_bytes: int = 0  # ... of them, found in the page cache (files read or written lately)
    disk_read_seconds: float = 0.0  # time with at least one read in flight
    disk_write_bytes: int = 0  # pages spilled (changed pages that left host memory)
    disk_write_seconds: float = 0.0
    spills: int = 0
    host_hits: int = 0  # fetches whose page was in host memory (or read ahead in time)
    host_misses: int = 0  # fetches that waited for the disk
    host_wait_seconds: float = 0.0  # how long they waited
    blocks: list[BlockStats] = field(default_factory=list)

    @property
    def disk_read_gbps(self) -> float:
        """Achieved GB/s of the disk tier's reads while any was in flight."""
        return self.disk_read_bytes / self.disk_read_seconds / 1e9 if self.disk_read_seconds else 0.0

    @property
    def h2d_gbps(self) -> float:
        """Achieved host-to-device GB/s while copying."""
        return self.h2d_bytes / self.h2d_seconds / 1e9 if self.h2d_seconds else 0.0

    @property
    def d2h_gbps(self) -> float:
        return self.d2h_bytes / self.d2h_seconds / 1e9 if self.d2h_seconds else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of block uses that found the block on the device (unhooked uses count)."""
        uses = self.hits + self.misses + self.resident_uses
        return (self.hits + self.resident_uses) / uses if uses else 1.0

    def __str__(self) -> str:
        return (
            f"pager: {self.steps} steps, {self.hits} hits / {self.misses} misses "
            f"({100 * self.hit_rate:.1f}% hit), {self.prefetches} prefetches, {self.evictions} evictions; "
            f"moved {format_bytes(self.h2d_bytes)} to device"
            + (
                f" ({format_bytes(self.split_fetch_bytes)} of it over other GPUs' links)"
                if self.split_fetch_bytes
                else ""
            )
            + (
                f" ({format_bytes(self.helper_page_bytes)} from copies in other GPUs' memory, which keeps "
                f"{format_bytes(self.helper_held_bytes)})"
                if self.helper_page_bytes
                else ""
            )
            + f", {format_bytes(self.d2h_bytes)} back; "
            f"stalled {self.stall_seconds * 1e3:.1f} ms; resident {format_bytes(self.resident_bytes)} "
            f"(peak {format_bytes(self.peak_resident_bytes)}) of a {format_bytes(self.budget_bytes)} budget"
            + (f"; {self.deferred_steps} block updates deferred to their next use" if self.deferred_steps else "")
            + (
                f"; {self.host_steps} block updates on the host ({self.host_step_seconds * 1e3:.1f} ms"
                + (f", {self.host_master_passes} masters in one pass" if self.host_master_passes else "")
                + f"; fetches waited {self.host_step_wait_seconds * 1e3:.1f} ms for them)"
                if self.host_steps
                else ""
            )
            + (f"; {self.on_demand} accesses to paged-out tensors fetched their block" if self.on_demand else "")
            + (
                f"; {self.resident_forwards} forwards ran with every block resident, unhooked"
                if self.resident_forwards
                else ""
            )
            + (
                f"; blocks and activations peaked at {format_bytes(self.peak_device_bytes)} together "
                f"(activations {format_bytes(self.peak_activation_bytes)} at most, "
                f"{format_bytes(self.activation_reserve_bytes)} of the budget set aside for them)"
                if self.peak_activation_bytes or self.activation_reserve_bytes
                else ""
            )
            + (
                f"; a forward carried {format_bytes(self.carried_bytes)} of state (a KV cache; at most "
                f"{format_bytes(self.peak_carried_bytes)}), held out of the blocks' room"
                if self.peak_carried_bytes
                else ""
            )
            + (
                f"; the process held {format_bytes(self.outside_bytes)} on the device outside pager, held out of "
                f"the blocks' room"
                if self.outside_bytes
                else ""
            )
            + (
                f"; {self.compressed_blocks} blocks' weights compressed: pages of {format_bytes(self.page_bytes)} "
                f"for {format_bytes(self.plain_page_bytes)} ({self.page_bytes / self.plain_page_bytes:.2f}x)"
                if self.compressed_blocks
                else ""
            )
            + (
                f"; row tables: {self.row_hits} rows from the device cache, {self.row_misses} not "
                f"({self.row_ahead_hits} of them read ahead; {format_bytes(self.row_h2d_bytes)} read, "
                f"{format_bytes(self.row_d2h_bytes)} written back"
                + (f", {self.row_flushes} times for a read of the tables" if self.row_flushes else "")
                + ")"
                if self.row_hits or self.row_misses
                else ""
            )
            + (
                f"; experts: {self.expert_hits} routed experts from the device cache, {self.expert_misses} copied "
                f"in ({format_bytes(self.expert_h2d_bytes)}, "
                f"{self.expert_hits / max(1, self.expert_hits + self.expert_misses):.1%} hit; "
                f"{self.expert_ahead} copied ahead, {self.expert_ahead_used} of them used"
                + (f"; {self.expert_host} computed on the host" if self.expert_host else "")
                + (
                    f"; {format_bytes(self.expert_saved_h2d_bytes)} copied again for backwards"
                    if self.expert_saved_h2d_bytes
                    else ""
                )
                + (
                    f"; trained: {format_bytes(self.expert_grad_d2h_bytes)} of gradients to the host, "
                    f"{self.experts_stepped} experts stepped"
                    if self.experts_stepped or self.expert_grad_d2h_bytes
                    else ""
                )
                + ")"
                if self.expert_hits or self.expert_misses or self.expert_host
                else ""
            )
            + (
                f"; disk: {format_bytes(self.disk_read_bytes)} read at {self.disk_read_gbps:.2f} GB/s, "
                f"{format_bytes(self.disk_write_bytes)} spilled in {self.spills} pages; host pages: "
                f"{self.host_hits} hits / {self.host_misses} waits for the disk ({self.host_wait_seconds * 1e3:.1f} ms)"
                if self.disk_read_bytes or self.host_hits or self.host_misses
                else ""
            )
            + (
                f"; the allocator peaked at {format_bytes(self.allocator_peak_bytes)} "
                f"({format_bytes(self.allocator_reserved_bytes)} reserved)"
                if self.allocator_peak_bytes
                else ""
            )
        )

    def report(self) -> str:
        """A table: the totals, then one row per block."""
        cols = ("fetches", "hits", "misses", "evictions", "prefetches")
        head = f"{'block':<32} {'size':>11} " + " ".join(f"{c:>10}" for c in cols)
        head += f" {'h2d':>11} {'d2h':>11} {'GB/s in':>8} {'stall ms':>9} {'peak':>11}"
        rows = [str(self), head, "-" * len(head)]
        for b in self.blocks:
            rows.append(
                f"{b.name[-32:]:<32} {format_bytes(b.nbytes):>11} "
                + " ".join(f"{getattr(b, c):>10}" for c in cols)
                + f" {format_bytes(b.h2d_bytes):>11} {format_bytes(b.d2h_bytes):>11} {b.h2d_gbps:>8.1f}"
                f" {b.stall_seconds * 1e3:>9.2f} {format_bytes(b.peak_resident_bytes):>11}"
            )
        return "\n".join(rows)


@dataclass
class PoolStats:
    """A pool's totals since its last `reset()`, and each model's `Stats`."""

    budget_bytes: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0  # the most the pool's blocks held at once
    carried_bytes: int = 0  # state the models' last forwards carried (KV caches), held out of the room
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    waits: int = 0  # uses that waited for room held by other requests
    waited_seconds: float = 0.0
    timeouts: int = 0  # uses that waited `wait_seconds` and failed
    models: dict = field(default_factory=dict)  # name -> Stats

    def __str__(self) -> str:
        return (
            f"pool: {len(self.models)} model(s), resident {format_bytes(self.resident_bytes)} (peak "
            f"{format_bytes(self.peak_resident_bytes)}) of a {format_bytes(self.budget_bytes)} budget"
            + (f", carried state {format_bytes(self.carried_bytes)}" if self.carried_bytes else "")
            + f"; moved {format_bytes(self.h2d_bytes)} to device, {format_bytes(self.d2h_bytes)} back; "
            f"{self.waits} waits for room ({self.waited_seconds * 1e3:.1f} ms), {self.timeouts} timed out"
        )


def zero_counters(obj) -> None:
    """Reset the counting fields of a Stats or BlockStats in place."""
    for f in fields(obj):
        if f.name in (
            "name",
            "nbytes",
            "blocks",
            "resident_bytes",
            "budget_bytes",
            "peak_resident_bytes",
            "activations_policy",
            "activations_kept_blocks",
            "activation_bytes",
            "activation_reserve_bytes",
            "carried_bytes",
        ):
            continue  # state, not counters (peaks restart in `Pager.reset`)
        setattr(obj, f.name, type(getattr(obj, f.name))())
