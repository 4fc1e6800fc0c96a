"""The Pager: one per wrapped model. Builds its blocks and uses them through
the residency engine; holds the objects that do the rest for it: its hooks
(`_hooks.Hooks`), served accesses and gradient operations (`_grad_ops`),
state dicts (`_checkpoint.StateDicts`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from itertools import chain, islice

import torch

from ..base.block import Block, Segment, layout
from ..base.budget import format_bytes
from ..base.common import BACKWARD, PREFETCH_WINDOW, STEP, WEIGHTS, _locked, _record_range
from ..base import guards
from ..training.grad_ops import GradOps
from .serving import Serving
from ..training.grad_pages import GradPages
from .hooks import Hooks
from .uses import Uses
from ..engine.engine import Engine
from ..training.activations import KEEP, Activations
from ..engine.schedule import Scheduler
from ..observe.stats import BlockStats, Stats, zero_counters
from ..observe.trace import Tracer

log = logging.getLogger("pager")


class Pager:
    """Pages one model's blocks between host pages and a device under a budget.

    Made by `pager.wrap`; reach it with `pager.of(model)`.
    """

    def __init__(self, model, device, budget_bytes, named_blocks, *, pin, prefetch_depth, defer_step=True,
                 activations="keep", engine: Engine | None = None, name: str | None = None,
                 compress: str | None = None):
        self.model = model
        self.device = device
        self.prefetch_depth = prefetch_depth
        self.compress = compress  # how blocks' weights pages are encoded ([Note: compressed pages] in codec/compress.py)
        self.defer_step = defer_step  # see [Note: deferred updates] in training/optim.py
        # The budget, what is resident, the copy streams and the host tier
        # (shared with other models when `engine` is given).
        self.engine = engine if engine is not None else Engine(device, budget_bytes, pin=pin)
        self.transport = self.engine.transport
        self.scheduler = Scheduler()
        self.blocks: list[Block] = []
        self.remainder: Block | None = None
        self.resident_bytes = 0  # this model's share of the engine's (kept by the engine)
        self.total_bytes = 0  # of every segment: all on the device when resident_bytes equals it
        self.carried_bytes = 0  # state the last forward carried on the device (a KV cache): see model/carried.py
        self.row_params: dict = {}  # id(weight) -> its RowTable ([Note: row tables] in rows/table.py)
        self.row_bytes = 0  # device bytes of the row tables' caches, held out of the room
        self.row_stream = None  # the row tables' side stream and staging (rows/reader.py), on CUDA
        # How the pool and the engine's messages name this model.
        self.name = name if name is not None else _unique_name(type(model).__name__, self.engine.owners)
        self.counters = Stats(budget_bytes=self.engine.budget_bytes)
        # Blocks' saved activations: None keeps them on the device (see training/activations.py).
        self.activations = Activations(activations, self.transport, self.counters) if activations != KEEP else None
        if self.activations is not None:
            self.activations.ledger.note_blocks(0)
        self.tracer = Tracer(cuda=device.type == "cuda")
        self.grad_slots: dict[int, tuple[Block, int]] = {}  # id(param) -> (block, slot index in grads)
        self.param_blocks: dict[int, Block] = {}
        self.original_device: dict[int, torch.device] = {}
        self.optimizers: list = []
        self.lock = self.engine.lock  # see _locked: one for every model sharing the engine
        self._warned: set[str] = set()
        self.asleep = False  # block hooks removed: see [Note: asleep] in model/hooks.py
        self.shared_mode = False  # other threads exist: uses open tensors to their threads only (_expose)
        self.asleep_readers: list = []  # the thread of each access running unserved on the sleeping pager
        self.thread_state = threading.local()
        self._closed = False
        self._named_blocks = named_blocks
        self.sources: dict | None = None  # id(tensor) -> `_disk.Piece` of its bytes, for a model `load`ed from files
        # The least budget that runs: the remainder and the largest block with
        # the blocks around it and those it borrows tied tensors from.
        self.min_budget_bytes = 0
        self.least_room = 0  # least_room_bytes(), chosen again when segments appear (Hooks.start_step)
        self.reducer = None  # a `_distributed.Reducer` when gradients are averaged over a process group
        self.share_host = None  # maps the weights pages onto the node's shared copy (wrap(share_host_pages=True))
        self.uses = Uses(self)  # what a use of a block does: acquire, release
        self.grad_pages = GradPages(self)
        self.hooks = Hooks(self)
        self.serve = Serving(self)
        self.grad_ops = GradOps(self, self.serve)
        self.engine.join(self)

    # ------------------------------------------------------------------ build
    def build(self, owned, uses, parts=frozenset()) -> None:
        order = [owned.get(i, []) for i in range(len(self._named_blocks))] + [owned.get(None, [])]
        if self.sources is None:  # (pages from files live in their disk tier's memory)
            self.engine.host.reserve(self, [layout([(n, t) for n, t, _p in named])[1] for named in order if named])
        if self.share_host is not None:
            self.share_host(self)  # the weights pages: one copy for the ranks of this node
        for i, (name, module) in enumerate(self._named_blocks):
            self.blocks.append(Block(name, module, i, owner=self))
            self.blocks[-1].part = id(module) in parts  # see [Note: splitting large blocks] in model/discover.py
        for i, block in enumerate(self.blocks):
            self._build_weights(block, owned.get(i, []))
        self._link_parents()
        if owned.get(None):
            self.remainder = Block("<remainder>", None, len(self.blocks), owner=self)
            self._build_weights(self.remainder, owned[None])
        for i, deps in uses.items():
            user = self.blocks[i] if i is not None else self.remainder
            for j in deps:
                owner = self.blocks[j] if j is not None else self.remainder
                if user is self.remainder:
                    owner.resident_for_life = True
                elif owner is not self.remainder:
                    user.deps.append(owner)
        for block in self.all_blocks():
            if block.resident_for_life or block is self.remainder:
                block.resident_for_life = True
                self.uses.acquire(block, WEIGHTS, record=False)
        self.hooks.install()

    def add_row_tables(self, tables: list, cache_bytes: int) -> None:
        """Page each (name, module) of `tables` by rows, their caches sharing
        `cache_bytes` in proportion to their sizes."""
        from ..rows.reader import RowStream
        from ..rows.table import RowTable

        if self.row_stream is None and self.transport.is_cuda:
            self.row_stream = RowStream(self.transport)
        total = sum(m.weight.numel() * m.weight.element_size() for _n, m in tables)
        for name, module in tables:
            share = cache_bytes * module.weight.numel() * module.weight.element_size() // max(1, total)
            table = RowTable(self, name, module, share)
            self.row_params[id(table.param)] = table
        self.row_bytes = cache_bytes

    @property
    def row_tables(self) -> list:
        """The embedding tables paged by rows, in the order `rows=` named them."""
        return list(self.row_params.values())

    def managed(self, p) -> bool:
        """Whether the pager updates `p` in `opt.step()` (a block's parameter or a row table's)."""
        return id(p) in self.param_blocks or id(p) in self.row_params

    def _link_parents(self) -> None:
        """Each block's nearest enclosing block (NAS candidates: their layer)."""
        by_module = {id(b.module): b for b in self.blocks}
        stack = [(self.model, None)]
        while stack:
            module, enclosing = stack.pop()
            block = by_module.get(id(module))
            if block is not None:
                block.parent, enclosing = enclosing, block
            stack += [(child, enclosing) for child in module.children()]

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

    def _build_weights(self, block: Block, named: list) -> None:
        for _n, t, _p in named:
            self.original_device[id(t)] = t.device
        codec = self.compress if block.module is not None else None  # (the remainder is fetched once)
        pieces = [self.sources[id(t)] for _n, t, _p in named] if self.sources is not None else None
        seg = self.engine.add_segment(block, "weights", [(n, t) for n, t, _p in named], values=pieces is None,
                                      codec=codec, pieces=pieces)
        guards.register(self, block, seg)
        guards.guard(seg)
        block.params = [t for _n, t, is_param in named if is_param]
        block.param_names = [n for n, _t, is_param in named if is_param]
        block.trainable = any(p.requires_grad for p in block.params)
        block.stats = BlockStats(block.name, seg.nbytes)
        for p in block.params:
            self.param_blocks[id(p)] = block

    def new_segment(self, block: Block, kind: str, named: list) -> Segment:
        """A new segment `kind` of `block` for tensors shaped like `named`
        (gradients, optimizer state): its page holds nothing yet."""
        seg = self.engine.add_segment(block, kind, named, values=False)
        guards.register(self, block, seg)
        guards.guard(seg)
        block.stats.nbytes = block.nbytes()
        return seg

    # ------------------------------------------------------------ residency
    # ------------------------------------- leaving (called by the engine)
    def grads_arriving(self, block: Block, seg: Segment) -> None:
        self.grad_pages.arriving(block, seg)

    def evictions_blocked(self) -> bool:
        return self.hooks.sleeping_forwards > 0 or self.hooks.held_for_graph or bool(self.hooks.graphs_asleep)

    def fixed_bytes(self) -> int:
        """What this model holds on the device for life (its remainder, and blocks it uses)."""
        return sum(b.nbytes() for b in self.all_blocks() if b.resident_for_life)

    def busy(self) -> bool:
        return self.hooks.root_depth > 0 or bool(self.hooks.backward_holds)

    def blocking_threads(self) -> set:
        return set(self.hooks.sleeping_threads)

    def may_leave(self, block: Block) -> bool:
        """Chosen to leave: False if it must stay (views of it kept where pager
        cannot look); a deferred update whose bytes are here is applied now."""
        if self.asleep:
            self.hooks.wake()  # (no sleeping forward runs: evictions wait for it) guard the idle tensors first
        if self.uses.keeps_unknown_views(block):
            return False
        if block.deferred_steps and not block.missing_bytes(STEP):
            # Prefetched for an update, but leaving unused: the bytes are here, so
            # apply it now (a gradient the user sets meanwhile must not overwrite its page).
            self.engine.wait(block)
            self.engine.pin(block)  # the update is this thread's use (in the shared mode, what lets it pass the guard)
            try:
                self.uses.expose(block)  # (guarded again as it leaves)
                self.uses.run_deferred(block)
            finally:
                self.engine.unpin(block)
        return True

    def leave_after(self, block: Block, ready):
        return ready if self.reducer is None else self.reducer.after_reduction(block, ready)

    def pages_leaving(self, block: Block) -> None:
        grads = block.segments.get("grads")
        if grads is not None and grads.resident:
            self.grad_pages.gather(grads)

    def page_leaving(self, block: Block, seg: Segment, ready, dirty: bool) -> bool:
        if seg.kind != "grads":
            return dirty
        self.grad_pages.page_out(block, seg)  # host_valid now says if any gradient is still wanted
        if not (dirty and seg.host_valid):
            return False
        # New values: describe them as they leave, or forget the old description.
        self.grad_ops.summarize(seg, ready) if self.grad_ops.summarize_on_leave else seg.summaries.clear()
        return True

    def left(self, block: Block) -> None:
        for seg in block.segments.values():
            guards.guard(seg)  # (already: idle) every later access is served
        if block.module is not None:
            self.hooks.guard(block)

    def blocks_moved(self) -> None:
        if self.activations is not None:
            self.activations.ledger.note_blocks(self.engine.resident_bytes)

    def activation_reserve_bytes(self):
        return None if self.activations is None else self.activations.ledger.reserve()

    def room_bytes(self) -> int:
        """What blocks may hold on the device: the budget, less the share that
        activations take where pager handles them ([Note: one budget] in
        training/activations.py), never less than the least that runs (`least_room_bytes`;
        `Hooks.start_step` warns when activations leave less than that)."""
        return self.engine.room_bytes()

    def least_room_bytes(self) -> int:
        """The least room for blocks that runs now: what stays resident, and
        the largest block with the blocks it borrows from, each with every
        segment it has (gradients and optimizer state, once they exist)."""
        fixed = sum(b.nbytes() for b in self.all_blocks() if b.resident_for_life)
        largest = max((b.nbytes() + sum(d.nbytes() for d in b.deps) for b in self.blocks if not b.resident_for_life),
                      default=0)
        return max(fixed + largest, self.min_budget_bytes)

    def prefetch(self) -> None:
        if not self.prefetch_depth or self.all_resident:
            return  # off, or nothing left to fetch
        disk = self.engine.host.disks.get(self)
        if disk is not None:  # pages further ahead start coming from disk ([Note: the disk tier])
            disk.read_ahead(self._upcoming())
        fetched = 0
        for distance, (block, kinds) in enumerate(islice(self._upcoming(), PREFETCH_WINDOW)):
            if fetched >= self.prefetch_depth:
                return
            if block.deferred_steps:
                kinds = STEP  # its pending update runs at this use
            elif kinds is WEIGHTS and block.weights.resident and not block.deps:
                continue  # the common case once the working set is resident
            if "grads" in kinds:
                block.owner.grad_pages.ensure_segment(block)
            missing = block.missing_bytes(kinds) + sum(d.missing_bytes(WEIGHTS) for d in block.deps)
            if not missing:
                continue
            if disk is not None and not self.engine.host.ready(block, kinds):
                return  # its page is still being read: the thread that runs compute does not wait for the disk
            if not self.engine.make_room(missing, protect={block, *block.deps}, within=distance):
                return
            for dep in block.deps:
                if dep.missing_bytes(WEIGHTS):
                    self.engine.fetch(dep, WEIGHTS)
            with _record_range(f"pager::prefetch[{block.name}]"):
                self.engine.fetch(block, kinds)
            block.stats.prefetches += 1
            block.owner.counters.prefetches += 1
            fetched += 1

    def _upcoming(self):
        """The uses to prefetch for: this model's; with other models on the
        engine, the rest of this step, then the plan of the model predicted
        to run next ([Note: sharing the room] in engine/engine.py)."""
        if len(self.engine.owners) == 1:
            return self.scheduler.upcoming()
        after = self.engine.next_owner(self)
        if after is self:
            return self.scheduler.upcoming()
        theirs = ((b, k) for b, k in after.scheduler.plan if k is WEIGHTS and not b.deferred_steps)
        return chain(self.scheduler.upcoming_this_step(), theirs)

    # ---------------------------------------------------------------- public
    @_locked
    def stats(self) -> Stats:
        """Counters since the last `reset()` (see `Stats`), with per-block rows:
        a snapshot, which later steps do not change."""
        self.engine.meter.resolve()
        blocks = [dataclasses.replace(b.stats, resident_bytes=b.device_bytes()) for b in self.all_blocks()]
        memory = {}
        if self.activations is not None:
            ledger = self.activations.ledger
            memory = dict(activation_bytes=ledger.live, peak_activation_bytes=ledger.peak,
                          activation_reserve_bytes=self.budget_bytes - self.room_bytes(),
                          peak_device_bytes=ledger.peak_with_blocks)
        if self.transport.is_cuda:
            memory.update(allocator_peak_bytes=torch.cuda.max_memory_allocated(self.device),
                          allocator_reserved_bytes=torch.cuda.memory_reserved(self.device))
        weights = [b.weights for b in self.all_blocks()]
        return dataclasses.replace(self.counters, resident_bytes=self.resident_bytes, blocks=blocks,
                                   carried_bytes=self.carried_bytes, page_bytes=sum(w.page_bytes for w in weights),
                                   plain_page_bytes=sum(w.nbytes for w in weights),
                                   compressed_blocks=sum(w.encoded is not None for w in weights), **memory)

    def report(self) -> str:
        """`stats()` as a table, with the link's measured peak, device memory
        and utilisation (pynvml) and host RAM and pinned bytes (psutil).

        Example:
            >>> print(pager.of(model).report())
        """
        from ..observe.report import system_lines

        s = self.stats()
        peak = self.link_gbps()
        lines = [s.report(), ""]
        if s.h2d_seconds:
            lines.append(
                f"host->device: {s.h2d_gbps:.1f} GB/s while copying, {100 * s.h2d_gbps / peak:.0f}% of the "
                f"{peak:.1f} GB/s measured peak; device->host: {s.d2h_gbps:.1f} GB/s"
            )
        disk = self.engine.host.disks.get(self)
        if disk is not None and s.disk_read_seconds:
            peak_disk = disk.peak_gbps()
            lines.append(
                f"disk: {s.disk_read_gbps:.2f} GB/s while reading ({100 * s.disk_direct_bytes / max(1, s.disk_read_bytes):.0f}% "
                f"direct), {100 * s.disk_read_gbps / peak_disk:.0f}% of the {peak_disk:.2f} GB/s measured sequential "
                f"peak; host pages {format_bytes(disk.arena.used_bytes)} of {format_bytes(disk.capacity_bytes or disk.arena.reserved_bytes)}, "
                f"{len(disk.kept)} kept; {s.host_hits} hits, {s.host_misses} waits for the disk")
        lines += system_lines(self)
        return "\n".join(lines)

    def link_gbps(self) -> float:
        """The host-to-device copy rate this machine reaches from page-locked
        memory (measured once, 256 MiB), the ceiling for fetches."""
        if getattr(self, "_link_gbps", None) is None:
            from ..observe.report import measure_link_gbps

            self._link_gbps = measure_link_gbps(self.device, pinned=self.arena.pin)
        return self._link_gbps

    @_locked
    def reset(self) -> None:
        """Zero every counter (peak resident bytes restart from what is resident
        now; disk reads in flight end first and count before)."""
        self.engine.meter.resolve()
        disk = self.engine.host.disks.get(self)
        if disk is not None:
            disk.settle()
        zero_counters(self.counters)
        for b in self.all_blocks():
            zero_counters(b.stats)
            b.stats.peak_resident_bytes = b.device_bytes()
        self.counters.peak_resident_bytes = self.resident_bytes
        if self.activations is not None:
            self.activations.ledger.reset_peak()

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
        by_module = {id(b.module): b for b in self.blocks}
        uses = []
        for m in modules:
            block = by_module.get(id(m))
            if block is None:
                raise ValueError(
                    f"pager: expect() got a {type(m).__name__} that is not a block of this model; "
                    f"pass block modules (pager.of(model).block_names() lists them)."
                )
            uses.append((block, WEIGHTS))
        if torch.is_grad_enabled():
            # A training step: its backward reaches these blocks in the reverse
            # of the order they finish in (last step's, on another path, is no guide).
            uses += [(b, BACKWARD) for b in reversed(_finish_order([b for b, _k in uses])) if b.trainable]
        self.scheduler.expect(uses)
        # Blocks kept for last step's order but not on this path may go.
        self.scheduler.kept &= {b for b, _kinds in uses}
        self.hooks.expect_used = True
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
        row_table = self._row_table(table)
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"pager: expect_rows({row_table.name!r}, indices) takes an int32 or int64 tensor of "
                            f"rows; got {type(indices).__name__}"
                            f"{f' of {indices.dtype}' if isinstance(indices, torch.Tensor) else ''}.")
        row_table.expect(indices)

    def _row_table(self, table):
        for t in self.row_params.values():
            if table is t.module or table is t.param or (isinstance(table, str) and table == t.name):
                return t
        names = [t.name for t in self.row_params.values()]
        what = repr(table) if isinstance(table, str) else f"a {type(table).__name__}"
        raise ValueError(f"pager: {what} is not a row table of this model (its row tables: {names}); pass the "
                         f"module, its qualified name or its weight, of a table named by wrap(..., rows=...).")

    def apply_deferred(self) -> None:
        """Apply every optimizer update deferred to a block's next use now.

        Needed only to read weights or optimizer state by other means than the
        model's forward, `state_dict()` and `clip_grad_norm_` (those apply what
        they need themselves). See `wrap(defer_step=...)`.

        Example:
            >>> opt.step()
            >>> pager.of(model).apply_deferred()
        """
        self._apply_deferred(self.all_blocks())

    @_locked
    def _apply_deferred(self, blocks) -> None:
        for block in blocks:
            if block.deferred_steps:
                self.uses.acquire(block, STEP, record=False)
                self.uses.release(block)

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
        from ..training.optim import attach

        attach(self, optimizer)

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
        from ..base.budget import parse_budget

        nbytes = parse_budget(budget, self.device)
        least = self.engine.least_budget()
        if nbytes < least:
            raise ValueError(
                f"pager: budget={budget!r} ({format_bytes(nbytes)}) is below the {format_bytes(least)} "
                f"this model needs (the remainder and its largest block"
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


def _unique_name(base: str, owners) -> str:
    """`base`, or `base#2`, `base#3`... if a model sharing the engine has it."""
    names, name, k = {o.name for o in owners}, base, 1
    while name in names:
        k += 1
        name = f"{base}#{k}"
    return name


def _finish_order(blocks):
    """The order in which calls to `blocks` (in call order) return: a nested
    block (a NAS candidate) returns before the block around it."""
    out, open_ = [], []
    for b in blocks:
        while open_ and not _encloses(open_[-1], b):
            out.append(open_.pop())
        open_.append(b)
    return out + open_[::-1]


def _encloses(outer, block) -> bool:
    while block.parent is not None:
        block = block.parent
        if block is outer:
            return True
    return False
