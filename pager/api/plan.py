"""A plan before any GPU work: blocks, what stays, what moves, the floor."""

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import Any

import torch

from ..base import wrappers
from ..base.budget import format_bytes, parse_budget
from ..codec.compress import PIECE_BYTES, USUAL_RATIO, check_codec, min_part_bytes, page_bytes_estimate
from ..engine.schedule import Scheduler
from ..engine.split_fetch import CHUNK_BYTES, SPLIT_MIN_BYTES, helper_budgets, resolve_helpers
from ..experts.find import choose as choose_experts
from ..model import discover
from ..model.outside import check_covers
from ..observe.report import ASSUMED_LINK_GBPS, PROBED_DTYPES
from ..training import host_step
from ..training.dry_run import measure_saved, state_bytes_of
from ..training.offload import OFFLOAD_MIN_BYTES
from ..training.saved_bytes import (
    OFFLOAD,
    OFFLOAD_VIEWS_KEPT,
    RECOMPUTE,
    SavedBytes,
    Speeds,
    choose,
)
from ..training.step_room import TEMPORARIES_PRIOR
from .fit import default_blocks
from .plan_result import Plan


def plan(
    model: torch.nn.Module,
    budget,
    *,
    device=None,
    blocks=None,
    state_factor: float = 2.0,
    link_gbps: float | None = None,
    defer_step: bool = True,
    inputs=None,
    host_budget=None,
    disk_gbps: float | None = None,
    optimizer=None,
    compress: str | None = None,
    optimizer_step: str = "auto",
    split_fetch=None,
    master_weights: bool = False,
    budget_covers: str = "process",
) -> Plan:
    """Work out what paging `model` under `budget` will do, without doing it.

    Args:
        model: the model (not wrapped; nothing is changed).
        budget, device, blocks, defer_step, optimizer_step, master_weights,
            budget_covers: as for `pager.wrap` (under "process", the least
            budget that trains counts what the process holds outside pager,
            predicted from `inputs`; under `master_weights` a bf16 parameter's state
            is float32, with its float32 master beside it).
            A streamed block's update on the host ("auto", "host") moves its
            weights up for the forward and the backward and its gradients
            down; on the device, its gradients and state up and its weights
            and state down besides. ("auto" may give the device some blocks
            where the host falls behind: the figures are then its best case.)
        state_factor: optimizer state bytes per weight byte (Adam 2, SGD with
            momentum 1) for the training figures, without `optimizer`.
        optimizer: the optimizer that will train the model (built on its
            parameters): the state it keeps per parameter on the device is
            counted (`plan.train_blocks_min_bytes`, `plan.train_min_budget_bytes`,
            `plan.trains`).
        compress: as for `pager.wrap`: blocks split as wrap splits them under
            it, and a forward's bytes at the codec's usual ratio (an
            estimate: the real ratio depends on the values).
        link_gbps: host-to-device GB/s; measured on a CUDA device, else 55 assumed.
        split_fetch: as for `pager.wrap`: the link's rate is then measured
            over the helpers' links too (the forward's floor with them), and
            the plan says which streamed blocks the helpers keep in their
            memory (`plan.helper_kept`), which come over the peer links at
            their measured rate (`plan.peer_gbps`).
        inputs: a batch as the model's forward takes it: a tensor, a tuple of
            positional arguments or a dict of keyword arguments (a Hugging
            Face model: `{"input_ids": ids, "labels": ids}`, as the training
            step calls it: its loss saves for the backward too); values do
            not matter, only shapes and dtypes. The forward then runs on fake
            tensors (nothing is computed) to measure what a training step
            saves for its backward per block, and the plan predicts the
            step's peak for each `activations=` policy of `wrap`, and the
            least budget that trains (`plan.train_min_budget_bytes`): the
            one a run called with the same inputs refuses below. Without
            them activations are not counted: `train_min_budget_bytes` and
            (above what blocks need, `train_blocks_min_bytes`) `trains` are
            None ([Note: a plan without inputs]).
        host_budget: as for `pager.load`: the plan then says which blocks
            host memory keeps and what a forward reads from disk.
        disk_gbps: the disk's sequential read GB/s, for the disk floor.

    Example:
        >>> print(pager.plan(model, budget="10GiB", inputs=torch.zeros(4, 1024, dtype=torch.long)))
    """
    from ..base.budget import resolve_device

    if optimizer_step not in host_step.MODES:
        raise ValueError(
            f"pager: plan(optimizer_step={optimizer_step!r}) takes what wrap takes: "
            f"{', '.join(map(repr, host_step.MODES))}."
        )
    device = resolve_device(device)
    helpers = resolve_helpers(split_fetch, device, pin=True)
    budget_bytes = parse_budget(budget, device, host_bound=False)  # (a GPU's budget, planned where there is none)
    budgets = helper_budgets(split_fetch, helpers, budget_bytes)  # (what each helper may hold)
    # As wrap does: [Note: nothing resident by force] in api/fit.py (as blocks: plan has no row tables),
    # [Note: adapters stay on the device], [Note: splitting large blocks] in model/discover.py.
    spec, by_rows = blocks, []
    if blocks is None:
        by_rows, spec = default_blocks(model, budget_bytes, [], rows_allowed=True, say=False)
        if by_rows:  # (plan has no row tables: it counts them as blocks; size_up puts them in model order)
            spec = [*(spec or ()), *(m for _n, m in by_rows)]
    sizing = discover.adapters_resident(discover.size_up(model, spec), budget_bytes)[0]
    min_budget = sizing.min_budget
    parts: set = set()
    check_codec(compress)
    if blocks is None:
        least_part = min_part_bytes(compress) if compress else discover.SPLIT_MIN_BYTES
        sizing, parts = discover.split_large(model, sizing, budget_bytes, least_part, links=len(helpers) + 1)
    owned, own, remainder = sizing.owned, sizing.own, sizing.remainder

    state_of = state_bytes_of(optimizer, device, state_factor, master_weights)

    def trainable(i):
        return sum(discover.aligned_bytes(t) for _n, t, is_p in owned.get(i, []) if is_p and t.requires_grad)

    def state(i):
        return sum(state_of(t) for _n, t, is_p in owned.get(i, []) if is_p and t.requires_grad)

    names = [n for n, _m in sizing.named]
    kept = _kept(names, own, budget_bytes, remainder, order="spread")  # a forward's plan only reads weights
    moved = (
        own
        if not compress
        else [sum(_page_bytes(compress, t) for _n, t, _p in owned.get(i, [])) for i in range(len(names))]
    )
    forward = sum(n for name, n in zip(names, moved) if name not in kept)
    grads = [trainable(i) for i in range(len(names))]
    states = [state(i) for i in range(len(names))]
    step_sizes = [w + g + s for w, g, s in zip(own, grads, states)]
    fixed = remainder + trainable(None) + state(None)
    train_kept = _kept(names, step_sizes, budget_bytes, fixed)
    least = sizing.least_room(step_sizes, fixed)  # what `step_needs.least_room_bytes` will be with every segment
    h2d = d2h = 0
    on_host = optimizer_step != "device"
    for name, w, g, s in zip(names, own, grads, states):
        if name not in train_kept and on_host:
            h2d += 2 * w  # forward and backward ([Note: the optimizer step on the host])
            d2h += g  # gradients leave in backward; the host updates weights and state where they are
        elif name not in train_kept:
            if defer_step:  # the forward brings all in for the last step's update, the backward the weights
                h2d += (w + g + s) + w
            else:  # forward, backward, then the step brings all in
                h2d += 2 * w + (w + g + s)
            d2h += g + (w + s)  # gradients leave in backward; weights and state after their update

    if link_gbps is None and device.type == "cuda":
        from ..engine.transport import CudaTransport
        from ..observe.report import measure_link_gbps

        link, measured = measure_link_gbps(device, pinned=True), True
        writeback = link  # (fetches over the helpers' links too; write-backs over the device's own)
        if helpers:
            link = measure_link_gbps(device, pinned=True, transport=CudaTransport(device, [(h, 0) for h in helpers]))
    else:
        link, measured = (link_gbps or ASSUMED_LINK_GBPS), link_gbps is not None
        writeback = None
    notes = []
    if by_rows:
        notes.append(
            f"wrap pages {[name for name, _m in by_rows]} by rows, unasked: as a block it does not fit the "
            f"budget; this plan, which has no row tables, counts it as a block (its figures for it are an upper "
            f"bound: by rows a forward moves only the rows its batch reads)"
        )
    experts = choose_experts(model, "auto")
    if experts:
        notes.append(
            f"wrap pages the experts of {len(experts)} mixture-of-experts layers one by one (experts='auto'; "
            f"such as {experts[0][0]!r}); this plan counts them with their layers (its figures for them are an "
            f"upper bound: a token moves only the routed experts its cache of them misses), and wrap refuses a "
            f"budget without room for one token's experts beside the rest of the model"
        )
    if compress:
        notes.append(
            f"compress={compress!r}: a forward's bytes at the codec's usual ratio "
            f"({USUAL_RATIO[compress]}x of bf16 weights it codes); a ring of staging buffers (3 of the "
            f"largest piece, at most {format_bytes(3 * PIECE_BYTES)}) comes out of the budget"
        )
    if parts:
        notes.append(
            f"two of the largest blocks take a large share of the room for blocks: they stream as their "
            f"{len(parts)} parts (submodules of at least {format_bytes(discover.SPLIT_MIN_BYTES)})"
        )
    if names and remainder > budget_bytes // 2:
        notes.append(
            f"the remainder ({format_bytes(remainder)}) takes over half the budget: "
            "consider blocks= that include those modules"
        )
    room = budget_bytes - remainder
    if names and remainder + sum(own) > budget_bytes and room > 0 and 2 * max(own) > room // 4:
        notes.append(
            f"two of the largest blocks ({format_bytes(2 * max(own))}) take {100 * 2 * max(own) // room}% of the "
            f"room the budget leaves for blocks, and every block that is not kept streams through that room: "
            f"smaller blocks keep more resident (e.g. blocks=['Linear'], for blocks whose forward calls those "
            f"submodules rather than reading their weights)"
        )
    saved, peaks, outside = None, {}, 0
    covers_process = check_covers(budget_covers)
    if inputs is not None:
        args, kwargs = _as_call(inputs)
        try:
            saved = measure_saved(model, sizing.named, args, kwargs)
        except ValueError as e:
            raise ValueError(f"{e} (leave `inputs` out of plan() to plan without them)") from e
        if _lacks_labels(model, args, kwargs):
            notes.append(
                "the forward takes `labels` and inputs= has none: measured without them, the loss the model "
                "computes from them (and what its backward needs) is not counted; a training step that passes "
                "labels needs more: give them in inputs= (a causal LM: labels=input_ids)"
            )
        outside = saved.outside_peak if covers_process else 0  # ([Note: what sits outside pager, predicted])
        room = max(budget_bytes - outside, 0)  # (what blocks and activations may hold)
        share = 2 * sum(moved) / max(sum(step_sizes), 1)
        speeds = _speeds(saved, device, link, share) if device.type == "cuda" else None  # (as a run's)
        peaks = training_peaks(saved, room, fixed + sum(step_sizes), least, device.type == "cuda", speeds)
        notes += _activation_notes(peaks, room, least, outside)
    kw = {"min_bytes": OFFLOAD_MIN_BYTES, "copies": device.type == "cuda"}
    update = _update_bytes(optimizer, [*grads, trainable(None)], master_weights)  # (the remainder's too)
    # keep: activations beside the budget; else they come out of it ([Note: one budget] in training/activations.py);
    # at the step an update on the device holds its room instead ([Note: the step's room] in training/step_room.py)
    train_budgets = {
        p: int(outside + least + max(acts if p != "keep" else 0, update)) for p, (acts, _t) in peaks.items()
    }
    if saved is not None:
        train_budgets["auto"] = int(outside + least + max(least_held(saved, **kw), update))
    out = Plan(
        device=str(device),
        budget_bytes=budget_bytes,
        min_budget_bytes=min_budget,
        remainder_bytes=remainder,
        blocks=list(zip(names, own)),
        kept=sorted(kept, key=names.index),
        forward_bytes=forward,
        train_kept=sorted(train_kept, key=names.index),
        train_h2d_bytes=int(h2d),
        train_d2h_bytes=int(d2h),
        train_blocks_min_bytes=int(least),
        # One least budget that trains: the defaults' ("auto" at its least); not known without the
        # activations ([Note: a plan without inputs]).
        train_min_budget_bytes=train_budgets["auto"] if saved is not None else None,
        link_gbps=link,
        link_measured=measured,
        notes=notes,
        saved=saved,
        training_peaks=peaks,
        train_budgets=train_budgets,
        outside_bytes=outside,
        state_estimated_factor=None if optimizer is not None else state_factor,
    )
    if host_budget is not None:
        out.host_budget_bytes = parse_budget(host_budget, torch.device("cpu"), host_bound=False)
        out.host_kept, out.forward_disk_bytes = _host_kept(names, own, kept, out.host_budget_bytes)
        out.disk_gbps = disk_gbps
    if helpers:
        out.writeback_gbps = writeback
        if not compress:  # (compressed pages come over the device's link: [Note: pages kept on helpers])
            staging = 2 * CHUNK_BYTES  # (`SplitFetch.staging_bytes`)
            out.helper_kept = _on_helpers(names, own, kept, sum(max(0, b - staging) for b in budgets))
            out.forward_helper_bytes = sum(n for name, n in zip(names, own) if name in out.helper_kept)
            out.forward_bytes -= out.forward_helper_bytes
            if out.forward_helper_bytes:
                from ..observe.report import measure_peer_gbps

                out.peer_gbps = measure_peer_gbps(helpers[0], device)
        out.notes.append(
            f"split_fetch over {len(helpers)} other GPU(s): fetches at {link:.1f} GB/s measured over "
            f"every link, write-backs at {writeback:.1f} GB/s over the device's own"
        )
    return out


def _on_helpers(names: list, own: list, kept: Collection, room_bytes: int) -> list:
    """The streamed blocks the helpers keep: in the forward's order (the
    order they are fetched a second time in), those that split, while the
    helpers have room ([Note: pages kept on helpers])."""
    on_helpers = []
    for name, n in zip(names, own):
        if name not in kept and SPLIT_MIN_BYTES <= n <= room_bytes:
            on_helpers.append(name)
            room_bytes -= n
    return on_helpers


def _host_kept(names, sizes, device_kept, host_budget: int) -> tuple[list[str], int]:
    """The blocks host memory keeps and the bytes a forward reads from disk at
    most (the streaming window may hold some pages across forwards), by the
    rule of [Note: a kept set in host memory] in engine/disk.py."""
    streamed = [(n, s) for n, s in zip(names, sizes) if n not in device_kept]
    room = host_budget - 2 * max((s for _n, s in streamed), default=0)
    kept, used = [], 0
    for name, size in streamed:
        if used + size <= room:
            kept.append(name)
            used += size
    return kept, sum(s for n, s in streamed if n not in kept)


def training_peaks(
    sb: SavedBytes, budget: int, blocks_bytes: int, least: int, copies: bool = True, speeds: Speeds | None = None
) -> dict:
    """Per `activations=` policy: (the most activations hold on the device in
    a training pass, blocks and activations together), by the rules the run
    decides with ([Note: what each policy holds, predicted] in
    training/saved_bytes.py). `blocks_bytes`: every block with its gradients and
    state; `least`: the least room for blocks that runs; `copies`: copies
    out run behind compute (CUDA) and hold device memory until done;
    `speeds`: the device's, for "auto" ([Note: the faster policy,
    predicted] in training/activations.py)."""
    kw: dict[str, Any] = {"min_bytes": OFFLOAD_MIN_BYTES, "copies": copies}
    acts = {"keep": sb.total, "offload": sb.peak(OFFLOAD, **kw), "recompute": sb.peak(RECOMPUTE, **kw)}
    chosen = choose(sb, "auto", budget - blocks_bytes, budget - least, speeds, **kw)
    acts["auto"] = chosen[2] if chosen is not None else least_held(sb, **kw)
    peaks = {"keep": (acts["keep"], min(max(budget, least), blocks_bytes) + acts["keep"])}
    for policy in ("offload", "recompute", "auto"):
        room = max(budget - acts[policy], least)  # [Note: one budget]: blocks take the rest, at least what runs
        peaks[policy] = (acts[policy], min(room, blocks_bytes) + acts[policy])
    return peaks


def _speeds(sb: SavedBytes, device, link_gbps: float, link_share: float) -> Speeds | None:
    """The CUDA `device`'s speeds for "auto"'s choice, as a run measures them
    (`step_needs.speeds`); None where the forward computes nothing counted."""
    from ..observe.report import measure_matmul_flops

    if sb.flops_dtype not in PROBED_DTYPES:
        return None
    flops = measure_matmul_flops(device, sb.flops_dtype)
    return Speeds(link_gbps * 1e9, flops, link_share)


def _update_bytes(optimizer, grads: list, master_weights: bool) -> int:
    """The most an update of one block on the device holds beyond its pages
    with their state (`StepRoom.update_bytes`): an unfused optimizer's
    temporaries, one copy of the block's trainable parameters (float32
    under master weights: twice a bf16 parameter's bytes)."""
    fused = optimizer is not None and all(g.get("fused") for g in optimizer.param_groups)
    factor = 0.0 if fused else TEMPORARIES_PRIOR * (2 if master_weights else 1)
    return max((int(factor * g) for g in grads), default=0)


def least_held(sb: SavedBytes, **kw) -> int:
    """The least that activations hold under any policy "auto" may choose."""
    return min(sb.peak(p, **kw) for p in (OFFLOAD_VIEWS_KEPT, OFFLOAD, RECOMPUTE))


def _activation_notes(peaks: dict, budget: int, least: int, outside: int = 0) -> list[str]:
    """What the peaks say of the policies; `budget`: what blocks and
    activations may hold (less `outside`, what the process holds beside them)."""
    notes = []
    keep_acts, keep_total = peaks["keep"]
    if keep_total > budget:
        notes.append(
            f'with activations="keep", a training step holds {format_bytes(keep_acts)} of them beside '
            f'the blocks\' budget: "auto" (the default), "offload" and "recompute" put them under it'
        )
    fitting = [p for p in ("offload", "recompute") if peaks[p][1] <= budget]
    if not fitting:
        need = outside + least + min(peaks["offload"][0], peaks["recompute"][0])
        notes.append(
            f"activations leave blocks less than the {format_bytes(least)} they need at least under every policy: "
            f"a budget of at least {format_bytes(need, up=True)} holds a training step with these inputs "
            "(or a smaller batch)"
        )
    return notes


def _kept(names, sizes, budget, fixed, order: str = "early") -> frozenset:
    """The blocks the scheduler keeps resident for a cyclic order (the same
    rule, and the same `order` as the run: [Note: kept blocks spread out])."""
    scheduler = Scheduler()
    scheduler.plan = [(name, None) for name in names]
    size = dict(zip(names, sizes))
    scheduler.choose_kept(budget, lambda name: size[name], fixed, order)
    return scheduler.kept


def _page_bytes(compress: str, t: torch.Tensor) -> int:
    """About the bytes `t` takes in a page under `compress` (a quantized weight's inner tensors stay as they are)."""
    return wrappers.nbytes_of(t) if wrappers.is_wrapper(t) else page_bytes_estimate(compress, t)


def _lacks_labels(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether `model`'s forward takes `labels` (a Hugging Face model, which
    then computes its loss inside) and this call gives none."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if "labels" not in params:
        return False
    if "labels" in kwargs:
        return kwargs["labels"] is None
    positional = [n for n, q in params.items() if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    at = positional.index("labels") if "labels" in positional else len(args)
    return at >= len(args) or args[at] is None


def _as_call(inputs) -> tuple:
    """(args, kwargs) of a forward called with `inputs`: a tensor, a tuple of positional arguments or a dict."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}
