"""How a segment is made: its layout, its host page (the tensors' values,
encoded where that makes the page smaller, or byte ranges of checkpoint
files the disk tier reads later), its empty device storage, and the
tensors bound to it. `Engine.add_segment` calls it and counts the bytes;
the residency transitions stay in engine/engine.py."""

from __future__ import annotations

import torch

from ..base.block import Segment, in_place, layout, layout_for_files
from ..codec.compress import encode


def new_segment(
    engine,
    block,
    kind: str,
    named: list,
    values: bool,
    codec: str | None = None,
    pieces: list | None = None,
    keep_plain: frozenset = frozenset(),
) -> Segment:
    """A new segment of `block` for `named` tensors under `engine`: a page in
    the host tier and an empty device storage of the same layout. With `values`, the
    tensors' current values go into the page (encoded by `codec`, if it
    makes the page smaller: [Note: compressed pages] in codec/compress.py) and
    the tensors become views of the device storage ([Note: identity by
    storage resize] in base/block.py); with `pieces` (a list of
    `engine.disk.Piece` per tensor, in order: a checkpoint's bytes), so do they, and the disk tier reads
    the page when it is first needed; without either, the segment's own
    tensors are new views of it (gradients, optimizer state), its page
    holding nothing yet. `keep_plain`: names of tensors `codec` leaves as they
    are (the inner tensors of quantized weights)."""
    if pieces is not None:
        # (a tensor of several pieces, [Note: checkpoint conversions as byte ranges], is read without alignment)
        slots, nbytes = layout_for_files(named, [parts[0].lead if len(parts) == 1 else None for parts in pieces])
        for slot, parts in zip(slots, pieces):
            at = slot.offset
            for piece in parts:
                piece.page_offset, piece.padded = at, len(parts) == 1 and in_place(piece.lead)
                at += piece.nbytes
        pieces = [piece for parts in pieces for piece in parts]
        host, encoded = None, None
    else:
        slots, nbytes = layout(named)
        host, encoded = (
            _page_of(engine, block, slots, nbytes, named, codec, keep_plain)
            if values
            else (engine.host.hold(block.owner, nbytes), None)
        )
    flat = engine.transport.new_flat(nbytes)
    seg = Segment(
        kind,
        slots,
        nbytes,
        host,
        flat,
        host_valid=values or pieces is not None,
        encoded=encoded,
        shared=engine.host.is_shared(block.owner, host),
    )
    disk = engine.host.disks.get(block.owner)
    if disk is not None:
        disk.attach(block, seg, pieces)
    engine.transport.allocate(flat, nbytes)
    if values or pieces is not None:
        for slot, (_n, t) in zip(slots, named):
            t.data = slot.view_of(flat)
        seg.tensors = [t for _n, t in named]
    else:
        seg.tensors = [s.view_of(flat) for s in slots]
    engine.transport.free(flat)
    return seg


def _page_of(engine, block, slots, nbytes: int, named: list, codec, keep_plain: frozenset):
    """A page holding `named` tensors' values, and how it is encoded (None: plain)."""
    if codec is None:
        host = engine.host.hold(block.owner, nbytes)
        for slot, (_n, t) in zip(slots, named):
            slot.view_of(host).copy_(t.detach())
        return host, None
    plain = torch.zeros(nbytes, dtype=torch.uint8)
    for slot, (_n, t) in zip(slots, named):
        slot.view_of(plain).copy_(t.detach())
    done = encode(codec, slots, plain, engine.device if engine.transport.is_cuda else None, keep_plain)
    if done is None:  # it would not be smaller: plain
        host = engine.host.hold(block.owner, nbytes)
        host[:nbytes].copy_(plain)
        return host, None
    encoded, page = done
    host = engine.host.hold(block.owner, encoded.page_bytes)
    host[: encoded.page_bytes].copy_(page)
    engine.transport.ensure_staging(encoded.staging_bytes)
    return host, encoded
