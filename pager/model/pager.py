"""The Pager: one per wrapped model. Builds its blocks and uses them through
the residency engine; holds the objects that do the rest for it: its hooks
(`model.hooks.Hooks`), served accesses and gradient operations (`_grad_ops`),
state dicts (`training.checkpoint.StateDicts`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..base import guards
from ..base.block import Block, Segment
from ..base.budget import format_bytes, parse_budget
from ..base.common import _locked
from ..engine.engine import Engine
from ..engine.schedule import Scheduler
from ..observe.stats import Stats
from ..observe.trace import Tracer
from ..observe.views import link_gbps_of, report_of, reset_counters, snapshot
from ..rows.find import find_row_table
from ..training.activations import KEEP, Activations
from ..training.attach import attach as attach_optimizer
from ..training.grad_ops import GradOps
from ..training.grad_pages import GradPages
from ..training.host_step import HostSteps
from . import step_needs
from .direct_calls import DirectCalls
from .hooks import Hooks
from .prefetch import Frontier, prefetch
from .serving import Serving
from .steps import Steps
from .uses import Uses

if TYPE_CHECKING:  # (the types of what `wrap` attaches; imported by it)
    from ..training.distributed import Reducer
    from ..training.owners import BlockOwners
    from .outside import Outside

log = logging.getLogger("pager")


class Pager:
    """Pages one model's blocks between host pages and a device under a budget.

    Made by `pager.wrap`; reach it with `pager.of(model)`.
    """

    def __init__(
        self,
        model,
        device,
        budget_bytes,
        named_blocks,
        *,
        pin,
        prefetch_depth,
        defer_step=True,
        activations="auto",
        engine: Engine | None = None,
        name: str | None = None,
        compress: str | None = None,
        optimizer_step: str = "auto",
        helpers=(),
    ):
        self.model = model
        self.device = device
        self.prefetch_depth = prefetch_depth
        self.compress = (
            compress  # how blocks' weights pages are encoded ([Note: compressed pages] in codec/compress.py)
        )
        self.defer_step = defer_step  # see [Note: deferred updates] in training/optim.py
        # The budget, what is resident, the copy streams and the host tier
        # (shared with other models when `engine` is given).
        self.engine = engine if engine is not None else Engine(device, budget_bytes, pin=pin, helpers=helpers)
        self.transport = self.engine.transport
        self.scheduler = Scheduler()
        self.prefetch_frontier = Frontier()  # ([Note: the prefetch frontier] in model/prefetch.py)
        self.blocks: list[Block] = []
        self.remainder: Block | None = None
        self.resident_bytes = 0  # this model's share of the engine's (kept by the engine)
        self.total_bytes = 0  # of every segment: all on the device when resident_bytes equals it
        self.carried_bytes = 0  # state the last forward carried on the device (a KV cache): see model/carried.py
        self.row_params: dict = {}  # id(weight) -> its RowTable ([Note: row tables] in rows/table.py)
        # Names of the row tables wrap chose itself ([Note: nothing resident by force] in api/fit.py).
        self.rows_unasked: set = set()
        self.row_bytes = 0  # device bytes of the row tables' and experts' caches, held out of the room
        self.expert_tables: list = []  # experts paged one by one ([Note: experts paged one by one] in experts/table.py)
        self.expert_params: dict = {}  # id(parameter) -> (its ExpertTable, its index there): stepped by expert
        self.outside_bytes = 0  # the process's device bytes outside pager, out of the room (budget_covers="process")
        self.step_bytes = 0  # what an update on the device holds beside the pages while it runs: training/step_room.py
        self.outside: Outside | None = None  # the `Outside` that learns them ([Note: a budget that covers the process])
        self.row_stream = None  # the row tables' side stream and staging (rows/reader.py), on CUDA
        # How the pool and the engine's messages name this model.
        self.name = name if name is not None else _unique_name(type(model).__name__, self.engine.owners)
        self.counters = Stats(budget_bytes=self.engine.budget_bytes)
        # Blocks' saved activations: None keeps them on the device (see training/activations.py).
        self.activations = _activations_of(self, activations)
        self.tracer = Tracer(cuda=device.type == "cuda")
        self.grad_slots: dict[int, tuple[Block, int]] = {}  # id(param) -> (block, slot index in grads)
        self.param_blocks: dict[int, Block] = {}
        self.original_device: dict[int, torch.device] = {}
        self.optimizers: list = []
        self.lock = self.engine.lock  # see _locked: one for every model sharing the engine
        self._warned: set[str] = set()
        # The model's bytes, until its first forward: if that is inference and they fit the budget then, the
        # user is told that no paging is needed (a training step may still page gradients and state).
        self.fits_advice: int | None = None
        self.asleep = False  # block hooks removed: see [Note: asleep] in model/asleep.py
        self.shared_mode = False  # other threads exist: uses open tensors to their threads only (Uses.expose)
        self.asleep_readers: list = []  # the thread of each access running unserved on the sleeping pager
        self.thread_state = threading.local()
        self._closed = False
        self.named_blocks = named_blocks  # (qualified name, module) of each block, in model order: for `build`
        self.sources: dict | None = (
            None  # id(tensor) -> the `engine.disk.Piece`s of its bytes, in order, for a model `load`ed from files
        )
        # The least budget that runs: the remainder and the largest block with
        # the blocks around it and those it borrows tied tensors from.
        self.min_budget_bytes = 0
        self.least_room = 0  # step_needs.least_room_bytes(), chosen again when segments appear (Steps.start_step)
        # A `training.distributed.Reducer` when gradients are averaged over a process group.
        self.reducer: Reducer | None = None
        # Maps the weights pages onto the node's shared copy (wrap(share_host_pages=True)).
        self.share_host: Callable[[Pager], None] | None = None
        self.owners: BlockOwners | None = None  # a `training.owners.BlockOwners` under wrap(block_owners=True)
        self.master_weights = False  # float32 masters of bf16 weights ([Note: master weights] in training/masters.py)
        self.uses = Uses(self)  # what a use of a block does: acquire, release
        self.grad_pages = GradPages(self)
        self.host_steps = HostSteps(self, optimizer_step)  # where updates run ([Note: the optimizer step on the host])
        self.steps = Steps(self)  # the step boundary: plan, kept set, advice
        self.direct_calls = DirectCalls(self)  # guards for modules called outside their block's forward
        self.hooks = Hooks(self)
        self.serve = Serving(self)
        self.grad_ops = GradOps(self, self.serve)
        self.engine.join(self)

    # ------------------------------------------------------------------ blocks
    @property
    def row_tables(self) -> list:
        """The embedding tables paged by rows, in the order `rows=` named them."""
        return list(self.row_params.values())

    def managed(self, p) -> bool:
        """Whether the pager updates `p` in `opt.step()` (a block's parameter, a row table's or experts')."""
        return id(p) in self.param_blocks or id(p) in self.row_params or id(p) in self.expert_params

    @property
    def all_resident(self) -> bool:
        """Every page of every block is on the device: nothing to fetch or evict."""
        return self.resident_bytes == self.total_bytes

    @property
    def budget_bytes(self) -> int:
        """Device bytes for blocks (and paged activations): the engine's budget."""
        return self.engine.budget_bytes

    @property
    def arena(self):
        """This model's pinned host pages (its share of the engine's host tier)."""
        return self.engine.host.arena_of(self)

    @property
    def resident(self) -> dict:
        """This model's blocks with device bytes, oldest first (an ordered set)."""
        return {b: None for b in self.engine.resident if b.owner is self}

    def all_blocks(self):
        return self.blocks + ([self.remainder] if self.remainder is not None else [])

    def new_segment(self, block: Block, kind: str, named: list) -> Segment:
        """A new segment `kind` of `block` for tensors shaped like `named`
        (gradients, optimizer state): its page holds nothing yet."""
        seg = self.engine.add_segment(block, kind, named, values=False)
        guards.register(self, block, seg)
        guards.guard(seg)
        block.stats.nbytes = block.nbytes()
        return seg

    # ------------------------------------------- residency (called by the engine)
    def host_pages_ready(self, block: Block) -> None:
        self.host_steps.wait(block)
        if self.owners is not None:
            self.owners.wait(block)

    def grads_arriving(self, block: Block, seg: Segment) -> None:
        self.grad_pages.arriving(block, seg)

    def evictions_blocked(self) -> bool:
        return self.hooks.sleep.blocks_evictions()

    def fixed_bytes(self) -> int:
        """What this model holds on the device for life (its remainder, and blocks it uses)."""
        return sum(b.nbytes() for b in self.all_blocks() if b.resident_for_life)

    def busy(self) -> bool:
        return self.hooks.root_depth > 0 or bool(self.hooks.backward_holds)

    def blocking_threads(self) -> set:
        return set(self.hooks.sleep.threads)

    def may_leave(self, block: Block) -> bool:
        """Chosen to leave: False if it must stay (see `Uses.may_leave`)."""
        return self.uses.may_leave(block)

    def leave_after(self, block: Block, ready):
        return ready if self.reducer is None else self.reducer.after_reduction(block, ready)

    def pages_leaving(self, block: Block) -> None:
        if self.owners is not None:
            self.owners.check_leaving(block)  # (before anything leaves)
        grads = block.segments.get("grads")
        if grads is not None and grads.resident:
            self.grad_pages.gather(grads)

    def page_leaving(self, block: Block, seg: Segment, ready, dirty: bool) -> bool:
        if seg.kind != "grads":
            return dirty
        self.grad_pages.page_out(block, seg)  # host_valid now says if any gradient is still wanted
        if not (dirty and seg.host_valid):
            return False
        # New values: describe them as they leave (what a clip reads).
        self.grad_ops.summarize(seg, ready)
        return True

    def left(self, block: Block) -> None:
        for seg in block.segments.values():
            guards.guard(seg)  # (already: idle) every later access is served
        if block.module is not None:
            self.direct_calls.guard(block)

    def blocks_moved(self) -> None:
        if self.activations is not None:
            self.activations.ledger.note_blocks(self.engine.resident_bytes)

    def activation_reserve_bytes(self):
        return None if self.activations is None else self.activations.ledger.reserve()

    def room_bytes(self) -> int:
        """What blocks may hold on the device: the budget, less the share that
        activations take where pager handles them ([Note: one budget] in
        training/activations.py), never less than the least that runs (`step_needs.least_room_bytes`;
        `Steps.start_step` warns when activations leave less than that)."""
        return self.engine.room.room_bytes()

    def prefetch(self) -> None:
        """Start fetching the next uses that have room ([Note: prefetch] in model/prefetch.py)."""
        prefetch(self)

    # ---------------------------------------------------------------- public
    @_locked
    def stats(self) -> Stats:
        """Counters since the last `reset()` (see `Stats`), with per-block rows: a snapshot."""
        return snapshot(self)

    def report(self) -> str:
        """`stats()` as a table, with the link's measured peak, device memory
        and utilisation (pynvml) and host RAM and pinned bytes (psutil).

        Example:
            >>> print(pager.of(model).report())
        """
        return report_of(self)

    def link_gbps(self) -> float:
        """The ceiling for fetches: host-to-device GB/s, measured once (256 MiB) on the fetch path."""
        return link_gbps_of(self)

    @_locked
    def reset(self) -> None:
        """Zero every counter (peak resident bytes restart from what is resident
        now; disk reads in flight end first and count before)."""
        reset_counters(self)

    @_locked
    def start_trace(self, steps: int = 4) -> None:
        """Record fetches, write-backs, waits and computes of the last `steps`
        steps for `trace()` (two CUDA events per block use while on).

        Example:
            >>> pager.of(model).start_trace(steps=2)
        """
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"pager: start_trace(steps={steps!r}) needs a whole number of steps >= 1.")
        self.tracer.start(steps)

    def trace(self, path: str) -> str:
        """Write a Chrome/Perfetto trace of the recorded steps, one track per stream.

        Args:
            path: the JSON file to write (open it in ui.perfetto.dev or chrome://tracing).

        Returns:
            `path`.

        Example:
            >>> pager.of(model).start_trace(steps=2)
            >>> model(x); model(x)
            >>> pager.of(model).trace("pager_trace.json")
        """
        if not self.tracer.enabled:
            raise RuntimeError(
                "pager: tracing is off; call pager.of(model).start_trace(steps=N) (or wrap(..., trace_steps=N)) "
                "before the steps to record, then trace(path)."
            )
        self.tracer.write(path)
        return path

    @_locked
    def expect(self, modules) -> None:
        """Say which blocks the next forward will use, in order, so they are prefetched.

        Args:
            modules: block modules (or modules inside blocks) in the order the
                next forward runs them; e.g. the candidate ops of the path a
                NAS supernet sampled for this step.

        Example:
            >>> path = [layer.candidates[k] for layer, k in zip(net.layers, choice)]
            >>> pager.of(net).expect(path)
        """
        self.steps.expect(modules)
        self.prefetch()

    def expect_rows(self, table, indices: torch.Tensor) -> None:
        """Start reading the rows of a row table that `indices` will look up,
        on a side stream while the model runs on ([Note: rows read ahead] in
        rows/reader.py): the next lookup takes the rows it misses in the
        cache from there, where no write has changed them since.

        Call it for the next batch after the current batch's forward (the
        read then overlaps its backward and step); the rows stay until the
        next `expect_rows` of that table replaces them. The lookup of this
        very tensor (unchanged) is prepared too: it makes no host sync, so
        the host runs ahead of the device (pass the same tensor to the model).

        Args:
            table: the row table: its `nn.Embedding` / `nn.EmbeddingBag`, its
                qualified name, or its weight.
            indices: the integer tensor of rows the next lookup will take
                (any shape, on any device).

        Example:
            >>> loss = model(ids, offsets)
            >>> pager.of(model).expect_rows(model.table, next_ids)
            >>> loss.backward(); opt.step(); opt.zero_grad()
        """
        self.check_open()
        find_row_table(self.row_tables, table).expect(indices)

    def apply_deferred(self) -> None:
        """Apply every optimizer update deferred to a block's next use now.

        Needed only to read weights or optimizer state by other means than the
        model's forward, `state_dict()` and `clip_grad_norm_` (those apply what
        they need themselves). See `wrap(defer_step=...)`. Updates running on
        the host (`wrap(optimizer_step=...)`) are waited for.

        Example:
            >>> opt.step()
            >>> pager.of(model).apply_deferred()
        """
        with self.lock:
            self.uses.apply_deferred(self.all_blocks())

    def attach(self, optimizer) -> None:
        """Page `optimizer`'s state with its blocks and stream its `step()` per block.

        Idempotent. The optimizer may be built before or after `wrap` from
        `model.parameters()`; it is never rebuilt, and any `torch.optim`
        optimizer with per-parameter state works.

        Args:
            optimizer: a `torch.optim.Optimizer` over this model's parameters.

        Example:
            >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
            >>> pager.of(model).attach(opt)
        """
        attach_optimizer(self, optimizer)

    def no_sync(self):
        """A context in which backwards accumulate gradients without averaging
        them over the process group, as `DistributedDataParallel.no_sync()`:
        run each micro-step's forward and backward but the last inside it.
        Without a process group it does nothing (one loop runs on one GPU and
        on several).

        Example:
            >>> with pager.of(model).no_sync():
            ...     loss_fn(model(x1), y1).backward()
            >>> loss_fn(model(x2), y2).backward()  # x1's and x2's gradients averaged here
        """
        return self.reducer.no_sync() if self.reducer is not None else contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`; kept for
        code written against earlier versions: torch's own works at any budget.

        Example:
            >>> pager.of(model).clip_grad_norm_(1.0)
        """
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)

    @_locked
    def set_budget(self, budget) -> None:
        """Change the budget of a live pager; blocks leave until the new one holds.

        Args:
            budget: as for `pager.wrap` (bytes, "10GiB", "60%", "auto").

        Example:
            >>> pager.of(model).set_budget("4GiB")
        """
        nbytes = parse_budget(budget, self.device)
        least = self.engine.least_budget()
        if nbytes < least:
            raise ValueError(
                f"pager: budget={budget!r} ({format_bytes(nbytes)}) is below the {format_bytes(least)} "
                f"this model needs (the remainder and its largest block"
                + (", its row tables' and experts' caches" if self.row_bytes else "")
                + (", beside what the models sharing its budget hold for life" if len(self.engine.owners) > 1 else "")
                + "); give at least that."
            )
        self.engine.set_budget(nbytes)

    def block_names(self) -> list[str]:
        """The qualified names of the blocks, in model order."""
        return [b.name for b in self.blocks]

    def warn_once(self, key: str, msg: str, *args) -> None:
        """Log `msg` at WARNING the first time `key` is seen for this model."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("pager: this model was unwrapped; wrap it again to page it.")


def _activations_of(pager: Pager, policy: str) -> Activations | None:
    """What keeps `pager`'s blocks' saved activations under `policy`, with
    the figures it reads from the model and its engine; None for "keep"."""
    if policy == KEEP:
        return None
    activations = Activations(
        policy,
        pager.transport,
        pager.counters,
        budget_bytes=lambda: pager.engine.room.usable_bytes() - pager.outside_bytes,
        spare_bytes=lambda: (
            pager.engine.room.spare_bytes(pager)
            - step_needs.pages_to_come_bytes(pager)
            - step_needs.beside_bytes(pager)  # (held beside activations: the ledger's reserve)
        ),
        least_bytes=lambda: step_needs.least_bytes(pager),
        update_bytes=lambda: step_needs.update_bytes(pager),
        measure=lambda args, kwargs: step_needs.measure(pager, args, kwargs),
        outside_bytes=lambda: pager.outside_bytes,
        budget_total=lambda: pager.engine.budget_bytes,
        beside_bytes=lambda budget=None: step_needs.beside_bytes(pager, budget),
        give_back=lambda nbytes: step_needs.give_back(pager, nbytes),
        least_said=lambda: step_needs.remainder_said(pager),
        speeds=lambda planned: step_needs.speeds(pager, planned),
    )
    activations.ledger.note_blocks(0)
    return activations


def _unique_name(base: str, owners) -> str:
    """`base`, or `base#2`, `base#3`... if a model sharing the engine has it."""
    names, name, k = {o.name for o in owners}, base, 1
    while name in names:
        k += 1
        name = f"{base}#{k}"
    return name
