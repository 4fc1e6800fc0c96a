"""Views of one model's counters: the snapshot `Pager.stats()` returns, the
report `Pager.report()` prints, and `Pager.reset()`."""

from __future__ import annotations

import dataclasses

import torch

from ..base.budget import format_bytes
from .report import measure_link_gbps, system_lines
from .stats import Stats, zero_counters


def snapshot(pager) -> Stats:
    """`pager`'s counters with per-block rows and memory figures, as a copy."""
    pager.engine.meter.resolve()
    blocks = [dataclasses.replace(b.stats, resident_bytes=b.device_bytes()) for b in pager.all_blocks()]
    memory = {}
    if pager.activations is not None:
        ledger = pager.activations.ledger
        memory = dict(
            activation_bytes=ledger.live,
            peak_activation_bytes=ledger.peak,
            activation_reserve_bytes=max(0, pager.budget_bytes - pager.room_bytes() - pager.outside_bytes),
            peak_device_bytes=ledger.peak_with_blocks,
        )
    if pager.transport.is_cuda:
        memory.update(
            allocator_peak_bytes=torch.cuda.max_memory_allocated(pager.device),
            allocator_reserved_bytes=torch.cuda.memory_reserved(pager.device),
        )
    weights = [w for b in pager.all_blocks() for w in b.weight_segments]
    kept_pages = pager.transport.kept_pages
    memory.update(helper_held_bytes=kept_pages.held_bytes if kept_pages is not None else 0)
    return dataclasses.replace(
        pager.counters,
        resident_bytes=pager.resident_bytes,
        blocks=blocks,
        carried_bytes=pager.carried_bytes,
        outside_bytes=pager.outside_bytes,
        page_bytes=sum(w.page_bytes for w in weights),
        plain_page_bytes=sum(w.nbytes for w in weights),
        compressed_blocks=sum(w.encoded is not None for w in weights),
        **memory,
    )


def report_of(pager) -> str:
    """`pager.stats()` as a table, with the link's and the disk's rates and the system's lines."""
    s = pager.stats()  # (under the model's lock)
    peak = pager.link_gbps()
    lines = [s.report(), ""]
    if s.h2d_seconds:
        lines.append(
            f"host->device: {s.h2d_gbps:.1f} GB/s while copying, {100 * s.h2d_gbps / peak:.0f}% of the "
            f"{peak:.1f} GB/s measured peak; device->host: {s.d2h_gbps:.1f} GB/s"
        )
    disk = pager.engine.host.disks.get(pager)
    if disk is not None and s.disk_read_seconds:
        peak_disk = disk.peak_gbps()
        lines.append(
            f"disk: {s.disk_read_gbps:.2f} GB/s while reading "
            f"({100 * s.disk_direct_bytes / max(1, s.disk_read_bytes):.0f}% direct, "
            f"{100 * s.disk_cached_bytes / max(1, s.disk_read_bytes):.0f}% from the page cache), "
            f"{100 * s.disk_read_gbps / peak_disk:.0f}% of the {peak_disk:.2f} GB/s measured sequential "
            f"peak; host pages {format_bytes(disk.arena.used_bytes)} of "
            f"{format_bytes(disk.capacity_bytes or disk.arena.reserved_bytes)}, "
            f"{len(disk.kept)} kept; {s.host_hits} hits, {s.host_misses} waits for the disk"
        )
    lines += system_lines(pager)
    return "\n".join(lines)


def link_gbps_of(pager) -> float:
    """`Pager.link_gbps`: measured once per pager."""
    if getattr(pager, "_link_gbps", None) is None:
        with pager.engine.lock:  # (the probe goes through the copy streams the fetches use)
            pager._link_gbps = measure_link_gbps(pager.device, pinned=pager.arena.pin, transport=pager.transport)
    return pager._link_gbps


def reset_counters(pager) -> None:
    """Zero `pager`'s counters; peaks restart from what is resident now."""
    pager.engine.meter.resolve()
    disk = pager.engine.host.disks.get(pager)
    if disk is not None:
        disk.settle()
    zero_counters(pager.counters)
    for b in pager.all_blocks():
        zero_counters(b.stats)
        b.stats.peak_resident_bytes = b.device_bytes()
    pager.counters.peak_resident_bytes = pager.resident_bytes
    if pager.activations is not None:
        pager.activations.ledger.reset_peak()
