"""The public verbs: wrap, unwrap, of."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ..base import wrappers
from ..base.budget import format_bytes, parse_budget, resolve_device
from ..base.common import _PAGERS
from ..codec.compress import check_codec, min_part_bytes
from ..engine.engine import Engine
from ..engine.host import COPY_SECONDS_PER_GIB, PIN_PROGRESS_BYTES, PIN_SECONDS_PER_GIB
from ..engine.split_fetch import helper_budgets, resolve_helpers
from ..model import discover, outside
from ..model.build import add_row_tables, build_blocks
from ..model.pager import Pager
from ..model.pool import Pool
from ..rows.table import choose as choose_row_tables
from ..training import distributed, host_step, masters, owners
from ..training.checkpoint import close
from .fit import default_blocks, too_large_message

log = logging.getLogger("pager")


def wrap(
    model: nn.Module,
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
    process_group=None,
    dist_timeout: float = 600.0,
    share_host_pages: bool = False,
    block_owners: bool = False,
    split_fetch=None,
    master_weights: bool = False,
    budget_covers: str = "pager",
) -> nn.Module:
    """Page `model` in place under a device memory budget; return the same object.

    Every block's parameters and buffers move to one pinned host page each; at
    most `budget` bytes of blocks are on the device at any time. Parameter and
    buffer objects stay the same objects, so optimizers built before or after
    `wrap` keep working.

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
            it (measured, [Note: how many update on the host]); on the device
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
            on 1 to N GPUs ([Note: one script from 1 to N GPUs]).
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
        budget_covers: what the budget bounds on the device. "process":
            what pager holds and what the process holds there
            outside pager (the forward's inputs and output, a loss and its
            backward): blocks leave it room, predicted before the first
            training step from the forward measured on fake tensors
            ([Note: what sits outside pager, predicted] in
            training/dry_run.py), then on CUDA the most it was seen to take,
            learned from the caching allocator's counters at each training
            pass's forward end and backward start ([Note: a budget that
            covers the process] in model/outside.py; `stats().outside_bytes`);
            on CUDA `wrap` then resets the device's peak memory counter once.
            The prediction comes with the activations' measure: under
            `activations="keep"` there is none, and CUDA learns it alone.
            "pager" (default): what pager holds alone (blocks, and
            activations and carried state as above).

    Example:
        >>> model = pager.wrap(model, budget="10GiB")
        >>> with torch.no_grad():
        ...     y = model(x.cuda())
        >>> print(pager.of(model).stats())
    """
    return _wrap(
        model,
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
    process_group=None,
    dist_timeout=600.0,
    share_host_pages=False,
    block_owners=False,
    split_fetch=None,
    master_weights=False,
    budget_covers="pager",
    setup=None,
    rows_from_values=True,
):
    """`wrap`; `setup(pager)`, if given, runs before the blocks are built
    (`pager.load` gives the pager its disk tier there). `rows_from_values`:
    tables may go by rows unasked (False where their values are mapped
    files, which a row table would keep as its host table)."""
    engine = _engine_of(budget, pool)
    device = _shared_device(engine, device) if engine is not None else resolve_device(device)
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"pager: name={name!r} must be a non-empty string.")
    if name is not None and engine is not None and any(o.name == name for o in engine.owners):
        raise ValueError(f"pager: name={name!r} is taken by another model of this pool; give another.")
    _check_not_wrapped(model)
    _check_tensors(model, device)
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"pager: prefetch={prefetch!r} must be a whole number >= 0 (0 turns prefetch off).")
    if not isinstance(defer_step, bool):
        raise ValueError(f"pager: defer_step={defer_step!r} must be True or False.")
    if not isinstance(master_weights, bool):
        raise ValueError(f"pager: master_weights={master_weights!r} must be True or False.")
    if optimizer_step not in host_step.MODES:
        raise ValueError(
            f'pager: optimizer_step={optimizer_step!r} must be "auto" (on the host where it is '
            'measured to keep up, else on the device), "host" (the CPU) or "device".'
        )
    covers_process = outside.check_covers(budget_covers)
    check_codec(compress)
    if activations not in ("keep", "offload", "recompute", "auto"):
        raise ValueError(
            f'pager: activations={activations!r} must be "keep" (on the device), "offload" '
            '(to pinned host memory until the backward), "recompute" (dropped, and each block\'s '
            'forward run again in its backward) or "auto" (kept on the device as far as the budget has room, '
            "the rest offloaded or recomputed, the first the budget holds, decided before the first training "
            "forward from it measured on fake tensors)."
        )
    budget_bytes = engine.budget_bytes if engine is not None else parse_budget(budget, device)
    tables = choose_row_tables(model, rows, budget_bytes)
    group = distributed.resolve_group(process_group)
    _check_owners(block_owners, group, model, process_group)
    share_host_pages = True if block_owners else share_host_pages
    _check_sharing(share_host_pages, group, compress, setup, process_group)
    if group is None and (block_owners or share_host_pages):
        # ([Note: one script from 1 to N GPUs]) one process: nothing to share with, and the model trains as alone
        log.info(
            "pager: %s with one process (torch.distributed not initialized, or one rank): nothing to share; "
            "the model trains as a single process does.",
            "block_owners=True" if block_owners else "share_host_pages=True",
        )
        block_owners = share_host_pages = False
    helpers = _split_helpers(split_fetch, device, pin, engine, group, budget_bytes)
    if group is not None:
        _check_data_parallel(model, group, tables, dist_timeout, device, broadcast=setup is None)
    spec, asked = blocks, {name for name, _m in tables}
    if blocks is None and group is None and engine is None:
        # ([Note: nothing resident by force] in api/fit.py; by rows unasked only from values in memory)
        unasked_rows = rows is None and setup is None and rows_from_values
        tables, spec = default_blocks(model, budget_bytes, tables, rows_allowed=unasked_rows)
    if master_weights:
        _check_master_tables(tables)
    sizing, adapter_bytes = discover.adapters_resident(
        discover.size_up(model, spec, [m for _n, m in tables]), budget_bytes
    )
    if engine is not None and engine.fixed_bytes() + sizing.min_budget > engine.budget_bytes:
        raise ValueError(
            f"pager: this model needs {format_bytes(sizing.min_budget)} of device memory at least (its remainder "
            f"and largest block), but the shared {engine!r} has {format_bytes(engine.fixed_bytes())} of its "
            f"budget held for life by the models on it; raise that budget (pager.of(other).set_budget(...)) first."
        )
    _check_fits(budget, budget_bytes, sizing, model)
    cache_bytes = _row_cache_bytes(row_cache, device, budget_bytes, sizing.min_budget) if tables else 0
    min_budget = sizing.min_budget  # of whole blocks: parts may be fetched together again
    parts = set()
    if blocks is None:
        least = min_part_bytes(compress) if compress else discover.SPLIT_MIN_BYTES
        sizing, parts = discover.split_large(model, sizing, budget_bytes, least, links=_links(helpers, engine))
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
    total, named = sizing.total, sizing.named
    if setup is None:
        pager.arena.check_room(total, f"the model ({len(named)} blocks)")
    if total >= PIN_PROGRESS_BYTES and setup is None:
        kind, seconds = ("pinned", PIN_SECONDS_PER_GIB) if pager.arena.pin else ("pageable", COPY_SECONDS_PER_GIB)
        log.warning(
            "pager: copying %s into %s host pages for %d blocks; wrap takes about %.0f s",
            format_bytes(total),
            kind,
            len(named),
            seconds * total / 2**30,
        )
    if adapter_bytes:
        log.info(
            "pager: the trainable parameters of otherwise frozen blocks (adapters, %s) stay on the device "
            "with their gradients and optimizer state; their blocks stream read-only.",
            format_bytes(adapter_bytes),
        )
    if engine is None and not tables:  # (sharing a budget: the others' blocks count too)
        pager.fits_advice = total  # (said at the first inference forward if it still fits: model/hooks.py _advise)
    try:
        if setup is not None:
            setup(pager)
        build_blocks(pager, sizing.owned, sizing.uses, parts)
        add_row_tables(pager, tables, cache_bytes)
        pager.rows_unasked = {name for name, _m in tables} - asked
    except BaseException:
        pager.engine.leave(pager)  # a shared engine forgets the model it could not page
        raise
    if compress and pager.transport.is_cuda:
        # Encoding ran on the device: its temporaries (a few times a block)
        # would stay in the allocator's cache, outside the budget.
        torch.cuda.empty_cache()
    _warn_if_staging_crowds(pager)
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


def _check_master_tables(tables: list) -> None:
    """A row table updates its rows in its own dtype ([Note: exact updates
    of touched rows] in rows/table.py): under master_weights a bf16 one
    would be the exception, so it is refused."""
    for name, module in tables:
        if masters.wants_master(module.weight):
            raise ValueError(
                f"pager: master_weights=True, but the embedding table {name!r} ({module.weight.dtype}) is paged by "
                f"rows, whose updates run in the table's own dtype. Give it float32, a budget that holds it beside "
                f"a block (it then pages as a block, with masters), or rows=[] to page it as a block."
            )


def of(model: nn.Module) -> Pager:
    """The `Pager` of a wrapped model.

    Example:
        >>> print(pager.of(model).stats())
    """
    pager = _PAGERS.get(model)
    if pager is None:
        raise ValueError(
            f"pager: this {type(model).__name__} is not wrapped; call pager.wrap(model, budget=...) first."
        )
    return pager


def unwrap(model: nn.Module) -> nn.Module:
    """Undo `wrap`: every tensor back on its original device with its current
    value (gradients and attached optimizers' state too), hooks removed.

    Example:
        >>> pager.unwrap(model)
    """
    pager = of(model)
    close(pager)
    del _PAGERS[model]
    return model


# [Note: one script from 1 to N GPUs]
# `block_owners=True` and `share_host_pages=True` share work and host memory
# between the ranks of a node. A script written for `torchrun` runs them on
# one GPU too (plain `python`, or one rank): there is nothing to share, which
# is said once at INFO, and the model trains as a single process does (a
# test checks bit for bit). Only `process_group=False` beside them is
# refused: the caller turned off the ranks that they need.
def _check_sharing(share, group, compress, setup, process_group) -> None:
    if not isinstance(share, bool):
        raise ValueError(f"pager: share_host_pages={share!r} must be True or False.")
    if not share:
        return
    if process_group is False:
        raise ValueError(
            "pager: share_host_pages=True shares the weights' host pages between the ranks of a "
            "node, and process_group=False turns the ranks off; leave one of them out."
        )
    if compress is not None or setup is not None:
        raise ValueError(
            "pager: share_host_pages=True is not supported with compress= or with pager.load "
            "(their pages are not laid out as the plan); wrap without one of them."
        )


def _check_owners(block_owners, group, model, process_group) -> None:
    if not isinstance(block_owners, bool):
        raise ValueError(f"pager: block_owners={block_owners!r} must be True or False.")
    if not block_owners:
        return
    if process_group is False:
        raise ValueError(
            "pager: block_owners=True shares the blocks' optimizer updates between the ranks of a "
            "node, and process_group=False turns the ranks off; leave one of them out."
        )
    if group is not None:
        owners.check_model(model)


def _links(helpers, engine) -> int:
    """The links a fetch goes over: the device's own and its helpers' (a pool's, if it shares one)."""
    split = engine.transport.split if engine is not None else None
    return 1 + (len(split.helpers) if split is not None else len(helpers))


def _split_helpers(split_fetch, device, pin, engine, group, budget_bytes: int) -> list:
    """The helper GPUs of `split_fetch=` ([Note: split fetch] in engine/split_fetch.py), checked, each
    with the bytes it may hold."""
    if split_fetch is None:
        return []
    if engine is not None:
        raise ValueError(
            "pager: split_fetch= belongs to the budget's engine: this model shares one (pool= or "
            "budget=<engine>). Give split_fetch to pager.Pool(...) or to the first model's wrap."
        )
    if group is not None:
        raise ValueError(
            "pager: split_fetch= lends other GPUs' links to this one; with a process group each "
            "rank's GPU streams its own blocks over its own link already. Leave split_fetch out, or "
            "pass process_group=False for one process that streams over several GPUs."
        )
    helpers = resolve_helpers(split_fetch, device, pin)
    return list(zip(helpers, helper_budgets(split_fetch, helpers, budget_bytes)))


def _check_data_parallel(model, group, tables, timeout, device, broadcast: bool) -> None:
    """Refuse what data parallelism cannot do, before anything changes; then
    give every rank rank 0's weights (unless they come from one checkpoint)."""
    if tables:
        raise ValueError(
            "pager: rows= (row-paged embedding tables) is not supported with a process group yet: "
            "their sparse updates are not averaged over the ranks. Leave the tables to blocks "
            "(rows=None) for data-parallel training."
        )
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"pager: dist_timeout={timeout!r} must be a number of seconds > 0.")
    if (
        device.type == "cuda"
        and not distributed.control_on_cpu(group)
        and device != torch.device("cuda", torch.cuda.current_device())
    ):
        raise ValueError(
            f"pager: this rank pages onto {device} but its current CUDA device is "
            f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device(local_rank) first."
        )
    distributed.check_same_model(model, group, timeout, device)
    if broadcast:
        distributed.broadcast_from_first(model, group, device, timeout)


def _engine_of(budget, pool) -> Engine | None:
    """The engine a new model joins (a pool's, another model's), or None for a budget of its own."""
    if pool is not None:
        if not isinstance(pool, Pool):
            raise ValueError(
                f"pager: pool= takes a pager.Pool, not a {type(pool).__name__}; make one with pager.Pool(budget=...)."
            )
        if budget is not None:
            raise ValueError(
                "pager: give budget= or pool=, not both (a pool's models share the pool's budget; "
                "change it with pool.set_budget(...))."
            )
        return pool.engine
    if budget is None:
        raise ValueError('pager: wrap needs budget= (e.g. budget="10GiB") or pool= (a pager.Pool to share).')
    return budget if isinstance(budget, Engine) else None


def _shared_device(engine: Engine, device) -> torch.device:
    """The device of a shared engine; `device`, if given, must be it."""
    if not engine.owners and engine.pool is None:
        raise ValueError(
            "pager: budget= got the engine of a model that was unwrapped; pass "
            "pager.of(model).engine of a model that is still wrapped, or a budget."
        )
    if device is not None and resolve_device(device) != engine.device:
        raise ValueError(
            f"pager: budget= shares an engine on {engine.device}, but this model runs on {device}; "
            f"pass device={str(engine.device)!r} (or leave device out) to share it."
        )
    return engine.device


def _check_not_wrapped(model: nn.Module) -> None:
    if model in _PAGERS:
        raise ValueError("pager: this model is already wrapped; call pager.unwrap(model) before wrapping it again.")
    mine = {id(m) for m in model.modules()}
    for other in list(_PAGERS.keys()):
        if any(m is model for m in other.modules()):
            raise ValueError(
                f"pager: this {type(model).__name__} is a submodule of a wrapped "
                f"{type(other).__name__}; it is paged with it already (unwrap the outer model first)."
            )
        if id(other) in mine:
            raise ValueError(
                f"pager: this {type(model).__name__} contains a wrapped {type(other).__name__}; "
                f"unwrap the inner model first, then wrap the outer one."
            )


def _check_tensors(model: nn.Module, device: torch.device) -> None:
    devices = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise ValueError(
                f"pager: {name!r} is on the meta device (no data); materialize the model first "
                f"(e.g. model.to_empty(device='cpu') and load its weights)."
            )
        if t.layout != torch.strided:
            raise ValueError(
                f"pager: {name!r} has layout {t.layout}; pager pages dense tensors only. Keep this "
                f"module out of the blocks or convert it to dense."
            )
        problem = wrappers.refusal(name, t)
        if problem is not None:
            raise ValueError(problem)
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(
            f"pager: the model's tensors are on several devices ({sorted(map(str, devices))}); "
            f"move it to one device (e.g. model.cpu()) before wrapping."
        )
    bad = {d for d in devices if d.type not in ("cpu", device.type)}
    if bad:
        raise ValueError(f"pager: the model is on {bad.pop()}; move it to the CPU or to {device} first.")


def _row_cache_bytes(row_cache, device, budget_bytes: int, min_budget: int) -> int:
    """Device bytes for the row tables' caches: `row_cache`, or a quarter of
    the budget at most what the blocks leave."""
    if row_cache is None:
        return max(0, min(budget_bytes // 4, budget_bytes - min_budget))
    if isinstance(row_cache, int) and not isinstance(row_cache, bool) and row_cache == 0:
        return 0
    try:
        nbytes = parse_budget(row_cache, device)
    except ValueError as e:
        raise ValueError(str(e).replace("budget=", "row_cache=", 1)) from None
    if min_budget + nbytes > budget_bytes:
        raise ValueError(
            f"pager: row_cache={row_cache!r} ({format_bytes(nbytes)}) and the {format_bytes(min_budget)} the "
            f"blocks need at least exceed the budget ({format_bytes(budget_bytes)}); give row_cache of at most "
            f"{format_bytes(max(0, budget_bytes - min_budget))}, or raise the budget."
        )
    return nbytes


def _warn_if_staging_crowds(pager) -> None:
    """Compressed pages' staging ring comes out of the budget; if what is left
    cannot hold the largest block, the block runs anyway (over the budget)."""
    staging = pager.transport.staging_bytes
    if staging and pager.budget_bytes - staging < pager.min_budget_bytes:
        log.warning(
            "pager: the staging ring of compressed pages (%s) leaves %s of the %s budget, less than the %s the "
            "largest block needs beside the remainder; it runs over the budget by up to %s. Raise the budget to "
            "%s or more.",
            format_bytes(staging),
            format_bytes(pager.budget_bytes - staging),
            format_bytes(pager.budget_bytes),
            format_bytes(pager.min_budget_bytes),
            format_bytes(pager.min_budget_bytes + staging - pager.budget_bytes),
            format_bytes(pager.min_budget_bytes + staging),
        )


def _check_fits(budget, budget_bytes, sizing, model) -> None:
    if sizing.min_budget > budget_bytes:
        raise ValueError(too_large_message(budget, budget_bytes, sizing, model))
