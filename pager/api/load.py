"""`pager.load` (a model on the meta device, paged straight from its checkpoint
files) and `pager.save` (a wrapped model's weights to one safetensors file,
block by block, crash-safe)."""

from __future__ import annotations

import os
from typing import cast

import torch
import torch.nn as nn

from ..base import guards, wrappers
from ..base.budget import parse_budget, resolve_device
from ..base.files import NAMES, Entry, header_for, open_checkpoint, read_entry, replace_atomically
from ..engine.disk import DiskTier, check_host_budget
from ..engine.engine import Engine
from ..engine.page_io import Piece
from ..experts.find import choose as choose_experts
from ..model import discover
from ..rows.find import choose as choose_row_tables
from ..training import distributed
from . import conversion
from .buffers import recreate_meta_buffers, undo_buffers
from .fit import default_blocks

MAX_NAMED = 8  # tensors named in one error message


def load(model: nn.Module, checkpoint, budget=None, *, host_budget=None, spill=None, **options) -> nn.Module:
    """Page `model` straight from its checkpoint files, without building it in
    host memory first; return the same object, wrapped as by `pager.wrap`.

    Build the model on the meta device (`with torch.device("meta"): ...`);
    its tensors take their values from `checkpoint` when they are first used
    ([Note: reading checkpoints in place] in base/files.py). Tensors that are not
    on the meta device and not in the checkpoint (buffers the model computes,
    such as rotary frequencies) keep their values; such buffers left on the
    meta device are computed again by building their module on the CPU from
    its `config` ([Note: buffers a checkpoint does not hold] in api/buffers.py). Names that do not match,
    missing or unexpected tensors, and dtype or shape mismatches are refused
    before anything changes, naming the tensors; tied weights stay tied (the
    checkpoint may hold either name).

    Args:
        model: the model, usually on the meta device.
        checkpoint: a safetensors file; a folder with one, or with shards and
            their `model.safetensors.index.json`; that index; or a
            `torch.save` file of a state dict.
        budget: device bytes, as for `pager.wrap`.
        host_budget: pinned host bytes for pages ("24GiB", an int): a cache
            of the disk ([Note: the disk tier] in engine/disk.py), so the model may
            be larger than host RAM. None: every page is read into host memory
            once (in the background, in block order: the first forward starts
            before the whole model has been read).
        spill: a folder for pages that changed (training: weights, gradients,
            optimizer state) and must leave host memory; each is written to a
            new file, fsync'd and renamed (a crash never leaves a torn page).
            Needed for training under `host_budget`; the files are removed
            at `unwrap`.
        **options: the other options of `pager.wrap` (blocks, prefetch,
            optimizer, activations, rows, compress, ...). Tables that
            `rows=` names and experts paged one by one (`experts=`) are
            read whole into host memory (their host tables), the rest paged
            from the files. With `compress=`, every
            page is read once and encoded as it is read (a block at a time
            in plain host memory; no host_budget= then).

    Example:
        >>> with torch.device("meta"):
        ...     model = MyModel(config)
        >>> model = pager.load(model, "ckpt/", budget="10GiB", host_budget="24GiB")
        >>> with torch.no_grad():
        ...     y = model(x.cuda())
    """
    from .wrap import _wrap

    _refuse_quantized(
        model,
        "pager.load reads plain tensors from the checkpoint's files",
        "load the unquantized model with pager.load, or quantize in host memory and pager.wrap it",
    )
    if options.get("compress") and (host_budget is not None or spill is not None):
        raise ValueError(
            "pager: load(..., compress=) reads each page once into host memory, encoded as it is "
            "read; it takes no host_budget= or spill= (pages of the disk tier are the files' bytes). "
            "Leave compress= out to page from the files under a host budget."
        )
    spill = _spill_folder(spill)
    entries = open_checkpoint(checkpoint)
    made = recreate_meta_buffers(model)  # ([Note: buffers a checkpoint does not hold] in api/buffers.py)
    try:
        sources = _match(model, entries)
        capacity = _host_capacity(host_budget, model, options, own_budget=not isinstance(budget, Engine))
        tables = _read_whole(model, options, budget, sources)
    except BaseException:
        undo_buffers(made)
        raise
    read = {id(w) for w, _meta in tables}
    sources = [(t, p) for t, p in sources if id(t) not in read]
    if options.get("compress"):
        return _load_encoded(model, budget, sources, tables, made, options)
    placed = _materialize_meta(model)
    try:

        def setup(pager):  # (before its blocks are built)
            pager.sources = {id(t): piece for t, piece in sources}
            pages_bytes = sum(p.nbytes for _t, parts in sources for p in parts)
            if capacity is None:
                pager.arena.check_room(pages_bytes, "the model's pages")
            disk = pager.engine.host.disks[pager] = DiskTier(pager, capacity, spill, pin=pager.engine.host.pin)
            if capacity is None:
                disk.arena.expect(pages_bytes)  # (the pages the wrap fetches take no larger region)

        model = _wrap(model, budget, setup=setup, **options)
    except BaseException:
        for t, meta in placed + tables:  # nothing of the model is left half-changed
            torch.utils.swap_tensors(t, meta)
        undo_buffers(made)
        raise
    from .wrap import of

    pager = of(model)
    disk = pager.engine.host.disks[pager]
    if disk.capacity_bytes is None:  # every page comes in, in the order of use
        disk.read_all(pager.blocks)
    return model


def _read_whole(model: nn.Module, options: dict, budget, sources: list) -> list:
    """The tensors kept in host memory whole, read from the checkpoint: the
    weights of the tables `rows=` names (a row table's host table is its
    value: [Note: row tables] in rows/table.py) and the parameters of the
    experts paged one by one ([Note: experts paged one by one] in
    experts/table.py), as (tensor, its meta twin) pairs; the rest of the
    model stays on meta."""
    rows = options.get("rows")
    device = resolve_device(options.get("device"))
    tensors = [m.weight for _n, m in choose_row_tables(model, rows, parse_budget(budget, device))] if rows else []
    tensors += [p for _n, m in _experts_of(model, options) for p in m._parameters.values()]
    piece_of = {id(t): p for t, p in sources}
    read = []
    try:
        for w in tensors:
            w = cast(torch.Tensor, w)
            if not w.is_meta:
                continue
            value = nn.Parameter(_read(piece_of[id(w)], w), requires_grad=w.requires_grad)
            torch.utils.swap_tensors(w, value)
            read.append((w, value))  # (value now holds the meta tensor)
    except BaseException:
        for w, meta in read:
            torch.utils.swap_tensors(w, meta)
        raise
    return read


def _experts_of(model: nn.Module, options: dict) -> list:
    """(name, module) of the experts wrap will page one by one, as it chooses them."""
    group = distributed.resolve_group(options.get("process_group"))
    return choose_experts(model, options.get("experts", "auto"), training_group=group is not None)


def _read(pieces: list[Piece], like: torch.Tensor) -> torch.Tensor:
    """The value the checkpoint's `pieces` (in order) give a tensor shaped like `like`, read into host memory."""
    parts = [
        read_entry(Entry(p.name, torch.uint8, (p.nbytes,), p.path, p.file_offset, p.nbytes, p.tensor)) for p in pieces
    ]
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    return flat.view(like.dtype).reshape(like.shape)


def _load_encoded(model: nn.Module, budget, sources: list, tables: list, made: list, options: dict) -> nn.Module:
    """`load` with compress=: each meta tensor becomes a view of its bytes in
    the checkpoint file, mapped (the page cache holds them, not this
    process), and `wrap` encodes each block's page from them, a block at a
    time ([Note: compressed pages] in codec/compress.py); the views are
    dropped as the tensors become views of device storage."""
    from .wrap import _wrap

    mapped: list = []
    maps: dict = {}
    try:
        for t, pieces in sources:
            if not t.is_meta:
                continue
            value = _mapped(pieces, t, maps)
            value = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
            torch.utils.swap_tensors(t, value)
            mapped.append((t, value))  # (value now holds the meta tensor)
        # (no table by rows unasked: a row table would keep the mapped, read-only, bytes as its host table)
        return _wrap(model, budget, rows_from_values=False, **options)
    except BaseException:
        for t, meta in mapped + tables:  # nothing of the model is left half-changed
            torch.utils.swap_tensors(t, meta)
        undo_buffers(made)
        raise


def _mapped(pieces: list[Piece], like: torch.Tensor, maps: dict) -> torch.Tensor:
    """The bytes of `pieces` as a tensor shaped like `like`: mapped read-only
    from its file where it is one range of one (else joined in host memory)."""
    if len(pieces) > 1:
        return (
            torch.cat([_mapped([p], torch.empty(p.nbytes, dtype=torch.uint8, device="meta"), maps) for p in pieces])
            .view(like.dtype)
            .reshape(like.shape)
        )
    piece = pieces[0]
    if piece.tensor is not None:
        return piece.tensor.view(like.dtype).reshape(like.shape) if piece.tensor.dtype != like.dtype else piece.tensor
    import mmap
    import warnings

    path = cast(str, piece.path)  # (a piece without a tensor is a range of a file)
    if path not in maps:
        with open(path, "rb") as f:
            maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if not piece.nbytes:
        return torch.empty(like.shape, dtype=like.dtype)
    with warnings.catch_warnings():  # (torch warns that the buffer is not writable: nothing writes it)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(maps[path], dtype=torch.uint8, count=piece.nbytes, offset=piece.file_offset)
    return flat.view(like.dtype).reshape(like.shape)


def _spill_folder(spill):
    if spill is None:
        return None
    spill = os.path.abspath(os.fspath(spill))
    os.makedirs(spill, exist_ok=True)
    if not os.access(spill, os.W_OK):
        raise PermissionError(f"pager: spill={spill!r} is not writable; give a folder this process can write to.")
    return spill


def _host_capacity(host_budget, model: nn.Module, options: dict, own_budget: bool) -> int | None:
    """Host bytes for pages (None: as many as the model has), checked
    against its largest block (as `wrap` will choose them: [Note: nothing
    resident by force] in api/fit.py) and host RAM."""
    if host_budget is None:
        return None
    nbytes = parse_host_budget(host_budget)
    check_host_budget(nbytes, largest_page_bytes(model, options, own_budget))
    return nbytes


def parse_host_budget(host_budget) -> int:
    """`host_budget=` in bytes ("24GiB" or an int; a share is refused)."""
    if isinstance(host_budget, str) and host_budget.strip().endswith("%"):
        raise ValueError(f'pager: host_budget={host_budget!r}: give bytes ("24GiB" or an int), not a share.')
    try:
        return parse_budget(host_budget, torch.device("cpu"))
    except ValueError as e:
        raise ValueError(str(e).replace("budget=", "host_budget=", 1)) from None


def largest_page_bytes(model: nn.Module, options: dict, own_budget: bool) -> int:
    """The bytes of `model`'s largest page (its largest block, or the
    remainder) as `wrap` will choose its blocks from `options`; a host
    budget holds at least two. `own_budget`: the model is not given an
    engine as its budget."""
    return max(page_bytes(model, options, own_budget), default=0)


def page_bytes(model: nn.Module, options: dict, own_budget: bool) -> list[int]:
    """The bytes of each of `model`'s weights pages (its blocks', and the
    remainder's), as `wrap` will choose its blocks from `options`."""
    blocks = options.get("blocks")
    alone = distributed.resolve_group(options.get("process_group")) is None  # (as wrap resolves it)
    experts = _experts_of(model, options)  # (read whole, not paged from the files: outside the host budget)
    if own_budget and alone and options.get("blocks") is None and options.get("rows") is None:  # (wrap's defaults)
        blocks = default_blocks(model, 0, experts, rows_allowed=False, say=False)[1]
    sizing = discover.size_up(model, blocks, [m for _n, m in experts])
    return [*sizing.own, sizing.remainder]


def state_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every entry of `model.state_dict()`, tied names
    included, without calling it (a wrapped model's would copy every block)."""
    out = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        out += [(dot + n, p) for n, p in module._parameters.items() if p is not None]
        out += [
            (dot + n, b)
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        ]
    return out


def _match(model: nn.Module, entries: dict[str, Entry]) -> list[tuple[torch.Tensor, list[Piece]]]:
    """Each tensor of `model` and where its bytes are (the pieces of its page,
    in order: more than one where transformers' conversion fuses several
    checkpoint tensors into it, [Note: checkpoint conversions as byte ranges]
    in api/conversion.py); every mismatch raised at once."""
    groups: dict[int, list] = {}
    tensors: dict[int, torch.Tensor] = {}
    named = state_tensors(model)
    for name, t in named:
        groups.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    entries, made = conversion.convert(model, entries, dict(named))
    missing, wrong, out = [], [], []
    for key, names in groups.items():
        t = tensors[key]
        found = [n for n in names if n in entries or n in made]
        if not found:
            if t.is_meta:
                missing.append(" = ".join(names))
            continue
        e = made.get(found[0]) or entries[found[0]]
        if e.dtype != t.dtype or tuple(e.shape) != tuple(t.shape):
            wrong.append(
                f"{found[0]!r}: checkpoint {NAMES.get(e.dtype, e.dtype)} {list(e.shape)}, "
                f"model {NAMES.get(t.dtype, t.dtype)} {list(t.shape)}"
            )
            continue
        out.append((t, e.pieces if isinstance(e, conversion.Converted) else [_piece(e)]))
    known = {n for names in groups.values() for n in names}
    extra = [n for n in [*entries, *made] if n not in known]
    problems = []
    for what, items in (
        ("missing from the checkpoint", missing),
        ("in the checkpoint but not in the model", extra),
        ("of another dtype or shape", wrong),
    ):
        if items:
            more = f" and {len(items) - MAX_NAMED} more" if len(items) > MAX_NAMED else ""
            problems.append(f"{len(items)} tensor(s) {what}: {', '.join(map(str, items[:MAX_NAMED]))}{more}")
    if problems:
        raise ValueError(
            "pager: the checkpoint does not match the model; "
            + "; ".join(problems)
            + ". Build the model with the checkpoint's configuration (or rename its tensors)."
        )
    for t in list(model.parameters()) + list(model.buffers()):  # values that stay as they are
        if not t.is_meta and id(t) not in {id(s) for s, _p in out}:
            nbytes = t.numel() * t.element_size()
            out.append((t, [Piece(0, nbytes, tensor=t.detach().clone(), name=_name_of(model, t))]))
    return out


def _piece(e: Entry) -> Piece:
    if e.tensor is not None:
        return Piece(0, e.tensor.numel() * e.tensor.element_size(), e.path, tensor=e.tensor, name=e.name)
    return Piece(0, e.nbytes, e.path, e.offset, name=e.name, itemsize=e.dtype.itemsize)


def _name_of(model: nn.Module, t: torch.Tensor) -> str:
    for n, x in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if x is t:
            return n
    return "?"


def _materialize_meta(model: nn.Module) -> list:
    """Give each meta tensor a CPU stand-in with no memory behind it (an
    expanded scalar of its shape and dtype), keeping the tensor object
    (`swap_tensors`); wrap then makes it a view of its block's device
    storage. Returns (tensor, its meta twin) pairs to undo it."""
    placed, seen = [], set()
    for t in list(model.parameters()) + list(model.buffers()):
        if not t.is_meta or id(t) in seen:
            continue
        seen.add(id(t))
        stand_in = torch.zeros((), dtype=t.dtype).expand(t.shape)
        if isinstance(t, nn.Parameter):
            stand_in = nn.Parameter(stand_in, requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, stand_in)
        placed.append((t, stand_in))  # (stand_in now holds the meta tensor)
    return placed


def save(model: nn.Module, path) -> str:
    """Write the weights of wrapped `model` to one safetensors file at `path`,
    a block at a time (host memory for one block, whatever the model's size),
    crash-safe ([Note: crash-safe writes] in base/files.py): a process killed
    while saving leaves the previous file at `path` intact. Tied weights are
    written once, under their first name. `pager.load` reads it back, as
    does any safetensors reader.

    Args:
        model: a model wrapped by `pager.wrap` or `pager.load`.
        path: the file to write.

    Example:
        >>> pager.save(model, "ckpt/model.safetensors")
    """
    from .wrap import of

    pager = of(model)
    _refuse_quantized(
        model,
        "pager.save writes plain tensors (one safetensors file)",
        "save its state dict instead (host copies, a block at a time): "
        "torch.save(model.state_dict(), path), read back with load_state_dict",
    )
    path = os.path.abspath(os.fspath(path))
    named, seen = [], set()
    for name, t in state_tensors(model):
        if id(t) not in seen:
            seen.add(id(t))
            named.append((name, t))
    where = {
        id(t): (seg, i)
        for block in pager.all_blocks()
        for seg in block.weight_segments
        for i, t in enumerate(seg.tensors)
    }
    by_seg: dict = {}
    for name, t in named:
        by_seg.setdefault(where.get(id(t), (None, 0))[0], []).append((name, t))
    order = [(n, t) for items in by_seg.values() for n, t in items]
    header, _offsets = header_for([(n, t.dtype, tuple(t.shape)) for n, t in order], {"format": "pt"})
    tmp = path + ".tmp"
    with pager.lock:
        pager.apply_deferred()  # the weights as the steps taken so far left them
        if pager.transport.is_cuda:
            torch.cuda.synchronize(pager.device)  # write-backs in flight land first
        with open(tmp, "wb") as f:
            f.write(header)
            for seg, items in by_seg.items():
                views = seg.current_views() if seg is not None else None
                for _name, t in items:
                    with guards.unguarded():
                        value = views[where[id(t)][1]] if views is not None else t.detach()
                        f.write(_bytes_of(value))
    replace_atomically(tmp, path)
    return path


def _refuse_quantized(model: nn.Module, what: str, fix: str) -> None:
    """Refuse a model with quantized (wrapper-subclass) weights, naming the first."""
    for name, t in state_tensors(model):
        if wrappers.is_wrapper(t):
            raise ValueError(
                f"pager: {what}, and {name!r} is a quantized {type(t).__qualname__} (a tensor "
                f"subclass wrapping others); {fix}."
            )


def _bytes_of(t: torch.Tensor) -> memoryview:
    # A copy: numpy() of the (CPU) device's own memory would pin its storage for good.
    t = t.detach().to("cpu", copy=True).contiguous().reshape(-1)
    # (numpy's stubs give ndarray a __buffer__ only from Python 3.12)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")  # type: ignore[arg-type]
