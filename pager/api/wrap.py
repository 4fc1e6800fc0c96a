"""The public verbs: wrap, unwrap, of."""

from __future__ import annotations

import logging
from typing import Any, TypeVar, cast, overload

import torch
import torch.nn as nn

from ..base.budget import parse_budget, resolve_device
from ..base.common import _PAGERS
from ..codec.compress import check_codec, min_part_bytes
from ..experts.find import choose as choose_experts
from ..model import discover, outside
from ..model.build import add_expert_tables, add_row_tables, build_blocks
from ..model.pager import Pager
from ..model.pool import Pool
from ..rows.find import choose as choose_row_tables
from ..training import distributed, owners
from ..training.checkpoint import close
from . import checks
from .fit import needs, sized
from .pipeline import Verbs, given_options, is_pipeline, pipeline_pool, unwrap_pipeline, wrap_pipeline

log = logging.getLogger("pager")
_M = TypeVar("_M")  # (a model, or a diffusers pipeline: given back as it came)


def wrap(
    model: _M,
    budget=None,
    *,
    pool=None,
    name: str | None = None,
    device=None,
    blocks=None,
    optimizer=None,
    pin: bool = True,
    prefetch: int = 2,
    trace_steps: int = 0,
    defer_step: bool = True,
    optimizer_step: str = "auto",
    activations: str = "auto",
    compress: str | None = None,
    rows=None,
    row_cache=None,
    experts="auto",
    expert_cache=None,
    cold_experts: str = "auto",
    process_group=None,
    dist_timeout: float = 600.0,
    share_host_pages: bool = False,
    block_owners: bool = False,
    split_fetch=None,
    master_weights: bool = False,
    budget_covers: str = "process",
) -> _M:
    """Page `model` in place under a device memory budget; return the same object.

    Every block's parameters and buffers move to one pinned host page each; at
    most `budget` bytes of blocks are on the device at any time. Parameter and
    buffer objects stay the same objects, so optimizers built before or after
    `wrap` keep working.

    `model` may also be a diffusers pipeline: every `nn.Module` component
    (text encoders, transformer or UNet, VAE) is wrapped into one `Pool` of
    `budget`, named as the pipeline names it; `device`, `pin`, `prefetch`,
    `trace_steps`, `compress`, `activations` and `budget_covers` apply, the
    other options are one model's (docs/diffusion.md). `pager.of(pipe)` is then the pool.

    Args:
        model: the model, on the CPU or already on the device.
        budget: device bytes for blocks (and activations, see `activations`):
            an int, "10GiB", "512MiB", "1.5GB", "60%" of the device's memory,
            or "auto" (free memory less a margin). Or the residency engine
            of another wrapped model, `pager.of(other).engine`: the two
            models then share one budget (either one's blocks may evict the
            other's idle ones), the copy streams and one lock; each keeps its
            own host pages, hooks and schedule.
        device: where to run; defaults to the current CUDA device, else "cpu"
            (a separate host copy stands for device memory: same paging, no GPU).
        blocks: None (discover: the elements of the layer stacks, NAS candidate
            ops, and each module of 1 MiB or more outside them, such as the
            embedding and the head: [Note: nothing resident by force] in
            api/fit.py), a list of modules, a list of class names, or a
            predicate `(name, module) -> bool` (what it leaves out stays on
            the device).
        optimizer: an optimizer to `attach` (same as `pager.of(model).attach(opt)`).
        pin: page-lock host pages (fast asynchronous copies); False pages from
            pageable memory.
        prefetch: how many upcoming blocks to bring in ahead of use, room allowing.
        trace_steps: record a timeline of the last N steps for `trace()` (off: 0).
        defer_step: apply the optimizer update of a block that is paged out at
            `opt.step()` when the block is next used (bit for bit the same
            values; its transfers then overlap the next forward). False
            finishes every update, wherever it runs, within `opt.step()`.
        optimizer_step: where a block's optimizer update runs ([Note: the
            optimizer step on the host] in training/host_step.py). "host": on
            the CPU, over the block's host pages, in a worker thread that
            starts at `opt.step()` and runs ahead of the next forward, which
            brings the new weights up: the optimizer state never crosses the
            link (ZeRO-Offload's and torchao's CPUOffloadOptimizer's
            placement); blocks still on the device at `step()` leave first.
            "device": on the device (the GPU), the block's state brought in
            with it. "auto" (default): on the host for a block whose state is
            in host memory at `step()` (one still on the device leaves first),
            as many as the host updates without the next forward waiting for
            it (measured, [Note: how many update on the host] in
            training/host_placement.py); on the device
            for the rest. Where the budget holds every block's weights and
            gradients but not the activations beside the state, the state of
            blocks on the device goes to host memory too, and they update on
            the host ([Note: the state off the device] in training/state_room.py).
            Either way each block's first update runs on the device (it makes
            the state), and so do updates the host cannot run: `capturable`
            or `differentiable` optimizers, compressed or shared pages, a disk
            tier; under "auto", optimizers from outside `torch.optim` too.
        activations: what a block's training forward saves for its backward.
            "auto" (the default): blocks keep theirs on the device as far as
            the budget has room beyond every block with its gradients and
            optimizer state, the last blocks of the forward first; the others
            are offloaded or recomputed, the first the budget holds, decided
            before the first training forward from that forward measured on
            fake tensors (see [Note: activations, the automatic choice] in
            training/activations.py). "offload": each saved activation of
            1 MiB or more goes to pinned host memory as the forward moves on
            and comes back, a block ahead, for the backward (see [Note:
            activations off the device]). "recompute": a block keeps only its
            inputs, and its forward runs again (same dropout masks) when its
            backward needs what it saved: checkpointing without changing the
            model (see [Note: activations recomputed]). With these three the
            budget bounds blocks and activations together ([Note: one
            budget]), and the last block of a forward keeps its own. "keep":
            on the device, as without pager; the budget bounds blocks only.
        compress: store blocks' weights compressed in their host pages and
            decode them on the device after each copy, so fetches move fewer
            bytes ([Note: compressed pages] in codec/compress.py). None: plain
            pages. "lossless": bf16 weights in about 0.75x the bytes, decoded
            exactly (other dtypes stay plain). "fp8" (about 0.52x of bf16) and
            "int4" (about 0.28x): lossy, for inference and for the frozen
            weights of adapter training; the model's weights become the
            decoded values (`state_dict()` and `unwrap` give those). A block
            whose weights change later (a training step) is stored plain from
            then on; frozen parameters beside trainable ones (adapters) have
            a page of their own that stays compressed ([Note: frozen pages]
            in base/block.py). On CUDA a ring of staging buffers (3 slots of
            the largest piece, about 32 MiB each at most) comes out of the budget.
        rows: embedding tables to page by rows instead of as blocks
            ([Note: row tables] in rows/table.py): None (none, unless a table
            does not fit the budget even as a block: then it is chosen, and
            logged; see [Note: nothing resident by force] in
            api/fit.py), [] (none, ever), "auto" (every
            `nn.Embedding` / `nn.EmbeddingBag` whose weight is larger than a
            quarter of the budget), or a list of such modules or their
            qualified names. A row table stays in host memory; a lookup brings
            only its batch's rows to the device, and `opt.step()` updates only
            the rows the gradient touches (lazy for Adam-like optimizers, see
            [Note: exact updates of touched rows]). `weight.grad` is a sparse
            COO tensor on the CPU.
        row_cache: device bytes for the row tables' caches of recently used
            rows (and their slot maps), out of the budget: an int or a string
            like `budget`. Default: a quarter of the budget, at most what the
            blocks leave. 0 reads every row from the host.
        experts: mixture-of-experts layers' experts to page one expert at a
            time ([Note: experts paged one by one] in experts/table.py):
            "auto" (default: every module of transformers' experts
            convention, fused expert tensors and a forward given the
            routing), None (none: they page with their layer), or a list of
            such modules or their qualified names. Their weights stay in host
            memory; a call brings only the experts its routing names, into a
            device cache of the most used ones. Trained, their gradients and
            optimizer state stay on the host by expert and `opt.step()`
            updates the experts a step's tokens reached ([Note: experts
            trained one by one] in experts/train.py).
        expert_cache: device bytes for the experts' cache, out of the budget:
            an int or a string like `budget`. Default: what the budget has
            beyond the rest of the model and an eighth of it (for activations
            and a KV cache), at least the experts one token routes to (below
            a layer's experts, a call routed to more runs by chunks of
            tokens), at most all of them.
        cold_experts: where a routed expert the device cache lacks runs, in
            a call without gradients ([Note: cold experts on the host] in
            experts/host.py): "auto" (default; on CUDA the host computes as
            many of a call's cold experts as it can while the others copy
            in, chosen by the measured time of each side), "host" (every
            cold expert of at most a few tokens computed on the host; on
            the CPU device too) or "device" (every one copied in).
        process_group: data-parallel training (`torchrun`): a
            `torch.distributed` group whose ranks each wrap the same model
            under their own budget. Each block's gradients are averaged over
            the group as soon as its backward ends, on a communication
            stream, while the backward of the blocks before it runs (see
            [Note: a block is the bucket] in training/distributed.py): the values
            are `DistributedDataParallel`'s. Rank 0's weights are broadcast
            at wrap. None (default): the default group when torch.distributed
            is initialized with more than one rank; False: no averaging.
            `pager.of(model).no_sync()` accumulates without averaging.
        dist_timeout: seconds a rank waits for the others in pager's
            collectives on the host before it raises (a rank died or ran
            another loop). Collectives on CUDA tensors time out by the
            process group's own `timeout`.
        share_host_pages: with a process group, the ranks on one host keep
            one copy of the weights' pages in shared memory instead of one
            each ([Note: one host copy per node] in training/distributed.py): N ranks
            serving one model (each streaming for its own requests) hold its
            weights in host memory once. A block whose weights change on a
            rank (training) gets a page of that rank's own. With one
            process there is nothing to share: it runs as without.
        block_owners: with a process group, each trained block is updated
            by one rank of each node, its owner there, which alone on the
            node holds its optimizer state and writes its new weights into
            the node's shared page (implies `share_host_pages`); the node's
            others read them there at their next use ([Note: block owners]
            in training/owners.py). The N ranks of a node hold the weights
            and the optimizer state once between them; the values stay DDP's.
            `opt.state_dict()` and `unwrap` then gather the state from the
            owners: call them on every rank. With one process (plain
            `python`, or one rank) it trains as without, so one script runs
            on 1 to N GPUs ([Note: one script from 1 to N GPUs] in api/checks.py).
        split_fetch: other GPUs of this host whose PCIe links carry a share of
            every fetch: "all" (every GPU that can write to `device` over a
            peer link, NVLink), a list such as ["cuda:1"], or a dict of them
            to their budgets, {"cuda:1": "20GiB"}. Each helper copies its
            share of a page into two staging buffers in its own memory
            (64 MiB) and on to `device` over the peer link; only `device`
            computes. A model streamed for inference or `generate()` is
            bound by the link: with one helper its fetches take about half
            as long ([Note: split fetch] in engine/split_fetch.py). Each
            helper also keeps copies of pages the device cannot keep, up to
            its budget (by default `budget`; 0: its staging alone), which
            then come over the peer link alone ([Note: pages kept on
            helpers] in engine/helper_pages.py; `stats().helper_held_bytes`).
            None (default): `device`'s own link alone.
        master_weights: train a bf16 or fp16 model with a float32 master
            of each such parameter and float32 optimizer state (ZeRO-Offload's
            bf16 mode): every update steps the master with the gradient in
            float32, and the weight gets its rounding. The master is an entry
            of the parameter's optimizer state, `opt.state[p]["master_weight"]`:
            it pages with the block's state (in host memory, where the update
            runs on the host: only bf16 weights and gradients cross the
            link), and `opt.state_dict()` saves it ([Note: master weights] in
            training/masters.py). On the host of a CUDA run, torch's Adam
            and AdamW update a bf16 master in one pass, a C loop built at
            first use by the machine's C compiler (without one: a warning,
            and three passes at about half the speed). `unwrap` leaves the
            optimizer the state torch's own update of the parameter keeps
            (no master, its dtype).
        budget_covers: what the budget bounds on the device. "process"
            (default): what pager holds and what the process holds there
            outside pager (the forward's inputs and output, a loss and its
            backward, the caller's tensors): blocks leave it room, predicted
            before the first training step from the forward measured on fake
            tensors ([Note: what sits outside pager, predicted] in
            training/dry_run.py), then on CUDA the most it was seen to take,
            learned from the caching allocator's counters at each root
            forward's start and end and each backward's start (what the
            caller holds counts from the first forward; [Note: a budget that covers the
            process] in model/outside.py; `stats().outside_bytes`); on CUDA
            `wrap` resets the device's peak memory counter (unless another
            model there is mid-step). The
            prediction comes with the activations' measure: under
            `activations="keep"` there is none, and CUDA learns it alone.
            "pager": what pager holds alone (blocks, and activations and
            carried state as above); the rest is the caller's to leave room for.

    Example:
        >>> model = pager.wrap(model, budget="10GiB")
        >>> with torch.no_grad():
        ...     y = model(x.cuda())
        >>> print(pager.of(model).stats())
        >>> pipe = pager.wrap(FluxPipeline.from_pretrained(folder), budget="8GiB")
        >>> image = pipe("a cat", num_inference_steps=28).images[0]
    """
    if is_pipeline(model):
        values = locals()
        return wrap_pipeline(model, budget, pool, given_options(wrap, values), _verbs())
    return _wrap(
        cast(nn.Module, model),
        budget,
        pool=pool,
        name=name,
        device=device,
        blocks=blocks,
        optimizer=optimizer,
        pin=pin,
        prefetch=prefetch,
        trace_steps=trace_steps,
        defer_step=defer_step,
        optimizer_step=optimizer_step,
        activations=activations,
        compress=compress,
        rows=rows,
        row_cache=row_cache,
        experts=experts,
        expert_cache=expert_cache,
        cold_experts=cold_experts,
        process_group=process_group,
        dist_timeout=dist_timeout,
        share_host_pages=share_host_pages,
        block_owners=block_owners,
        split_fetch=split_fetch,
        master_weights=master_weights,
        budget_covers=budget_covers,
    )


def _wrap(
    model,
    budget=None,
    *,
    pool=None,
    name=None,
    device=None,
    blocks=None,
    optimizer=None,
    pin=True,
    prefetch=2,
    trace_steps=0,
    defer_step=True,
    optimizer_step="auto",
    activations="auto",
    compress=None,
    rows=None,
    row_cache=None,
    experts="auto",
    expert_cache=None,
    cold_experts="auto",
    process_group=None,
    dist_timeout=600.0,
    share_host_pages=False,
    block_owners=False,
    split_fetch=None,
    master_weights=False,
    budget_covers="process",
    setup=None,
    rows_from_values=True,
):
    """`wrap`; `setup(pager)`, if given, runs before the blocks are built
    (`pager.load` gives the pager its disk tier there). `rows_from_values`:
    tables may go by rows unasked (False where their values are mapped
    files, which a row table would keep as its host table)."""
    engine = checks.engine_of(budget, pool)
    device = checks.shared_device(engine, device) if engine is not None else resolve_device(device)
    checks.check_options(model, device, engine, name, prefetch, defer_step, master_weights, optimizer_step)
    covers_process = outside.check_covers(budget_covers)
    check_codec(compress)
    checks.check_modes(cold_experts, activations)
    budget_bytes = engine.budget_bytes if engine is not None else parse_budget(budget, device)
    tables = choose_row_tables(model, rows, budget_bytes)
    group = distributed.resolve_group(process_group)
    expert_modules = choose_experts(model, experts, training_group=group is not None)
    block_owners, share_host_pages = checks.sharing(
        block_owners, share_host_pages, group, process_group, model, pages_from_plan=compress is None and setup is None
    )
    helpers = checks.split_helpers(split_fetch, device, pin, engine, group, budget_bytes)
    if group is not None:
        checks.check_data_parallel(model, group, tables, expert_modules, dist_timeout, device, broadcast=setup is None)
    asked = {name for name, _m in tables}
    # (by rows unasked only from values in memory, and alone on a budget: a shared one's room for a
    # row cache is the other models' too)
    unasked_rows = rows is None and setup is None and rows_from_values and engine is None
    tables, sizing, adapter_bytes = sized(
        model, budget_bytes, blocks, tables, expert_modules, defaults=group is None, rows_allowed=unasked_rows
    )
    if master_weights:
        checks.check_master_tables(tables)
    held = checks.held_beside(engine, sizing.min_budget)
    checks.check_fits(budget, budget_bytes, sizing, model)
    # (sharing an engine: what the other models hold for life and in their caches is not this model's)
    cache_bytes = checks.row_cache_bytes(row_cache, device, budget_bytes - held, sizing.min_budget) if tables else 0
    experts_bytes = (
        checks.expert_cache_bytes(expert_cache, device, budget_bytes - held, sizing, cache_bytes, expert_modules)
        if expert_modules
        else 0
    )
    min_budget = sizing.min_budget  # of whole blocks: parts may be fetched together again
    parts: set = set()
    if blocks is None:
        least = min_part_bytes(compress) if compress else discover.SPLIT_MIN_BYTES
        sizing, parts = discover.split_large(model, sizing, budget_bytes, least, links=checks.links(helpers, engine))
    pager = Pager(
        model,
        device,
        budget_bytes,
        sizing.named,
        pin=pin,
        prefetch_depth=prefetch,
        defer_step=defer_step,
        activations=activations,
        engine=engine,
        name=name,
        compress=compress,
        optimizer_step=optimizer_step,
        helpers=helpers,
    )
    pager.min_budget_bytes = min_budget
    pager.master_weights = master_weights
    if share_host_pages:
        pager.share_host = lambda p: distributed.share_host_pages(p, group, dist_timeout)
    total = sizing.total
    checks.before_paging(pager, total, len(sizing.named), adapter_bytes, from_memory=setup is None)
    if engine is None and not tables and not expert_modules:  # (sharing a budget: the others' blocks count too)
        pager.fits_advice = total  # (said at the first inference forward if it still fits: model/hooks.py _advise)
    try:
        if setup is not None:
            setup(pager)
        build_blocks(pager, sizing.owned, sizing.uses, parts)
        add_row_tables(pager, tables, cache_bytes)
        add_expert_tables(pager, expert_modules, experts_bytes, cold_experts)
        pager.rows_unasked = {name for name, _m in tables} - asked
    except BaseException:
        _undo(pager)
        raise
    if compress and pager.transport.is_cuda:
        # Encoding ran on the device: its temporaries (a few times a block)
        # would stay in the allocator's cache, outside the budget.
        torch.cuda.empty_cache()
    checks.warn_if_staging_crowds(pager)
    if group is not None:
        try:
            distributed.check_same_blocks(pager, group, dist_timeout)
        except BaseException:
            close(pager)  # every tensor back where it was: the model as it was given
            raise
        pager.reducer = distributed.Reducer(pager, group, dist_timeout)
        if block_owners:
            pager.owners = owners.BlockOwners(pager, group, dist_timeout)
    if covers_process:
        pager.outside = outside.Outside(pager, outside.allocator_counter(device))
    _PAGERS[model] = pager
    if trace_steps:
        pager.start_trace(trace_steps)
    if optimizer is not None:
        pager.attach(optimizer)
    return model


def _verbs() -> Verbs:
    """The verbs api/pipeline.py applies to each component (it is beneath this module)."""
    return Verbs(wrap, unwrap, of, needs)


def _undo(pager) -> None:
    """A wrap that failed while it built the blocks and tables: every tensor
    back where it was, as far as it got (`close`), and the engine forgets
    the model. The first error is the one raised; one while undoing is logged."""
    try:
        close(pager)
    except Exception:
        log.exception("pager: undoing a wrap that failed failed too; the model may be left half-wrapped")
        for table in pager.expert_tables:
            table.restore()
        pager.engine.leave(pager)  # a shared engine forgets the model it could not page


@overload
def of(model: nn.Module) -> Pager: ...
@overload
def of(model: Any) -> Pool: ...
def of(model):
    """The `Pager` of a wrapped model; the `Pool` of a wrapped pipeline.

    Example:
        >>> print(pager.of(model).stats())
        >>> print(pager.of(pipe).report())  # a pipeline's pool: a line per component
    """
    if is_pipeline(model):
        return pipeline_pool(model)
    pager = _PAGERS.get(model)
    if pager is None:
        raise ValueError(
            f"pager: this {type(model).__name__} is not wrapped; call pager.wrap(model, budget=...) first."
        )
    return pager


def unwrap(model: _M) -> _M:
    """Undo `wrap`: every tensor back on its original device with its current
    value (gradients and attached optimizers' state too), hooks removed.

    A wrapped pipeline: each of its components.

    Example:
        >>> pager.unwrap(model)
    """
    if is_pipeline(model):
        return unwrap_pipeline(model, _verbs())
    module = cast(nn.Module, model)
    pager = of(module)
    close(pager)
    del _PAGERS[module]
    return model
