"""Optimizer updates run on the host: `HostSteps`, one per wrapped model.

[Note: the optimizer step on the host]
A block whose pages are all in host memory when `opt.step()` is called (its
gradients went down as it left in the backward) is updated where its bytes
are: a worker thread runs the optimizer's own update over the block's host
pages, and its next use brings the new weights up. Its optimizer state
never crosses the link, and neither do its gradients a second time or its
weights a third: a step moves weights up and gradients down, 8 bytes per
fp32 parameter, against 24 for an update on the device (gradients and
state up, state and weights down). This is ZeRO-Offload's and torchao's
CPUOffloadOptimizer's step, per block and beside the other placement.

The update starts at `step()`, not as the gradients reach the host: until
the user calls it, clipping, GradScaler's unscale, the learning rate and
`zero_grad` may still change what it computes. It runs ahead of the next
forward (the Note on the host's order below); a block's fetch waits for
its own update (`wait`, called through the engine before any copy of its
pages), and prefetch stops at a block whose update is still running
(`host_update_landed`). One worker thread runs the updates, one at a time.

What runs is the optimizer's undecorated `step` on a shadow of it (its own
param groups and state dict, as for a deferred update, [Note: deferred
updates] in training/optim.py): the block's parameters are stand-ins whose
data are views of the weights page and whose `.grad` are views of the
grads page; the state entries in the state page are its views, the others
(Adam's host-side `step`) the optimizer's own objects, updated in place as
the optimizer would. The group options are those at `step()` time, and the
zeroing and scaling recorded on the gradients before the step are applied to
the page first, as on the device; a clip's one factor is taken by the fused
kernel in its own pass instead ([Note: a clip in the fused update] in
training/host_jobs.py). On the CPU device the update is
the optimizer's own code on the same bytes: bit for bit the unwrapped
model's. On CUDA, torch's fused CPU kernel runs for Adam, AdamW, SGD and
Adagrad (the per-tensor loop would take several times as long): within the
kernels' rounding of the device's.

A block steps on the host when `optimizer_step` allows it and its update
can run there: a `torch.optim` optimizer without `capturable` or
`differentiable` (any optimizer of the `Optimizer` class under "host"), the
block's first update done (its state exists, laid out in its page), no
update of it still deferred, and plain pages of its own (not compressed,
not in the node's shared copy, not under a disk tier). Blocks still on the
device at `step()` and idle leave first (their gradients go down): under
"host" every one, under "auto" those whose state is in host memory (on the
device their update would bring it up and take it back: 16 bytes a
parameter against the host's 8) but for the ones the scheduler keeps on the
device (their leaving would make a block use's work grow with the number
of blocks); a block whose state is on the device updates there, but where
the budget holds every block's weights and gradients and not the
activations beside their state ([Note: the state off the device] in
training/state_room.py). A
block's place in the next forward is taken from its place in the model.

[Note: the host's order]
The worker runs, of the updates given, the first in forward order whose
pages have landed in host memory (their write-backs' events have
completed), and polls while none has. `loss.backward()` returns once its
kernels are queued, so the host may reach `step()` while the GPU still runs
the backward: the blocks whose gradients came down first (the last of the
forward) are then updated during the backward's tail, as torchao's step
does for each parameter, while the first block of the next forward still
goes first once its gradients are down. Two updates of one block (two
steps with no use between) run in the order given.

Where a step's updates run under "auto" on CUDA (how many, and under a
clip which): [Note: how many update on the host] and [Note: a clip holds
the host's updates back] in training/host_placement.py.

Whatever reads a page from outside a block's use waits for the updates in
flight first: the model's and the optimizer's `state_dict()` and
`load_state_dict()`, `unwrap`, `Pager.apply_deferred()`. One exception: a
host-side entry of the optimizer's state (Adam's `step` count on the CPU)
read between `step()` and the block's next use may still show the count
before the update (as for a deferred update).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from concurrent.futures import Future

import torch

from ..base.common import WORKER_PREFIX, _record_range
from .host_jobs import AfterCopy, HostJob
from .host_placement import Placement
from .state_room import StateRoom

MODES = ("auto", "device", "host")
FUSED_ON_HOST = ("Adam", "AdamW", "SGD", "Adagrad")  # torch.optim classes with a fused CPU kernel
POLL_SECONDS = 2e-4  # how often the worker looks again while no update's pages have landed
IDLE_SECONDS = 30.0  # the worker's thread ends after this long without work


class HostWorker:
    """The thread that runs updates on the host ([Note: the host's order]).
    It ends after `IDLE_SECONDS` without work (a model dropped without
    `unwrap` leaves no thread behind) and starts again with the next."""

    def __init__(self, threads: int = 0):
        self.threads = threads  # its updates' CPU threads (0: torch's setting; see `host_threads`)
        self._queue: list = []  # (job, its Future, Futures it must follow), in forward order within a step
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        _WORKERS.add(self)

    def submit(self, job: HostJob | AfterCopy, after=()) -> Future:
        future: Future = Future()
        with self._ready:
            self._queue.append((job, future, after))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"{WORKER_PREFIX}host-step", daemon=True)
                self._thread.start()
            self._ready.notify()
        return future

    def close(self) -> None:
        """Let the thread go (its work is done: `HostSteps.close` waited for it)."""
        with self._ready:
            thread, self._thread = self._thread, None
            self._ready.notify()
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        me = threading.current_thread()
        if self.threads:
            torch.set_num_threads(self.threads)  # (this thread's OpenMP setting; threads running keep theirs)
        while True:
            with self._ready:
                if not self._queue and self._thread is me:
                    self._ready.wait(IDLE_SECONDS)
                if not self._queue:
                    if self._thread is me:
                        self._thread = None  # (idle: the next submit starts another)
                    return
                item = self._next()
            if item is None:
                time.sleep(POLL_SECONDS)  # (nothing has landed yet)
                continue
            job, future, _after = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job.run())
                except BaseException as error:  # (reported by the use that waits for it)
                    future.set_exception(error)

    def _next(self):
        for i, (job, _future, after) in enumerate(self._queue):
            if all(f.done() for f in after) and job.landed():
                return self._queue.pop(i)
        return None


def host_threads() -> int:
    """CPU threads for the updates on the host of one rank of several on
    this host (0: torch's own setting). torchrun sets OMP_NUM_THREADS=1 for
    each of several ranks, which leaves a rank's updates one core (a step
    2.5x as long, 2x H200); they get this rank's share of the cores it may
    run on instead, never fewer than torch's setting."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if ranks <= 1:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(torch.get_num_threads(), cores // ranks)


# A daemon thread still alive when the interpreter finalizes is stopped
# where it stands, and with torch's C++ on its stack that aborts the process
# ("terminate called without an active exception"; a spawned rank dies of
# SIGABRT). So at exit each worker finishes its queue and its thread ends,
# as `close` does.
_WORKERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _end_workers() -> None:
    for worker in list(_WORKERS):
        worker.close()


class HostSteps:
    """Where each block's optimizer update runs, and the updates on the host.

    Args:
        pager: the model's `Pager`.
        mode: "auto", "device" or "host" (`wrap(optimizer_step=...)`).
    """

    def __init__(self, pager, mode: str):
        self.pager = pager
        self.mode = mode
        self._worker: HostWorker | None = None
        self._running: set = set()  # blocks whose `host_update` may still be running
        self._fused: dict = {}  # optimizer class -> its fused CPU kernel runs here
        self.placement = Placement(pager)  # under "auto" on CUDA, how many and which update on the host
        self.state_room = StateRoom(pager)  # ([Note: the state off the device] in training/state_room.py)

    # ---------------------------------------------------------- placement
    def can_step(self, block, stateless: bool) -> bool:
        """Whether `block`'s update may run on the host (see the Note), where
        and how its gradients are aside (`OptimizerLink.gradients_on_host`).
        `stateless`: its updates make no state (SGD without momentum)."""
        if block.resident_for_life or block.deferred_steps or "grads" not in block.segments:
            return False
        if "state" not in block.segments and not stateless:
            return False  # its first update (on the device) makes its state and lays it out in a page
        # (a block this rank owns has its shared page marked its own: [Note: block owners])
        return not any(
            seg.encoded is not None or seg.shared or seg.cache is not None
            for kind, seg in block.segments.items()
            if kind != "frozen"
        )

    def optimizer_can(self, link) -> bool:
        """Whether `link`'s optimizer's updates may run on the host (see the Note)."""
        if self.mode == "device" or link.raw_step is None:
            return False
        optimizer = link.optimizer
        if self.mode == "auto" and type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
            return False  # (another's update may be slow on the host, or not per parameter: asked for by "host")
        return not any(g.get("capturable") or g.get("differentiable") for g in optimizer.param_groups)

    def blocks_for(self, link, blocks: list) -> set:
        """ids of `blocks` (those with gradients at `step()`) whose update
        runs on the host this step; blocks that leave for it leave now."""
        if not self.optimizer_can(link):
            self.state_room.placed(blocks, set())
            return set()
        able = [b for b in blocks if self.can_step(b, id(b) in link.stateless)]
        self.state_room.step_starts()
        if self.mode == "host":
            self._send_down(able)
        else:  # (a block whose state is on the device updates there: nothing to move for it; nor do kept ones leave)
            kept, traded = (
                self.pager.scheduler.kept,
                set(self.state_room.traded(able)),
            )  # ([Note: the state off the device])
            self._send_down(
                [
                    b
                    for b in able
                    if b in traded or "state" in b.segments and not b.segments["state"].resident and b not in kept
                ]
            )
        able = [b for b in able if link.gradients_on_host(b) and self._pages_on_host(b)]
        able.sort(key=lambda b: b.index)  # (the next forward's order, as the model's)
        host = {id(b) for b in self.choose(able)} if able else set()
        self.state_room.placed(blocks, host)
        return host

    def _pages_on_host(self, block) -> bool:
        """Every page of `block` is in host memory: its weights too leave now
        if they were fetched ahead (idle, so unchanged since)."""
        if any(seg.resident for seg in block.segments.values()):
            return block.pins == 0 and self.pager.engine.evict(block)
        return True

    def _send_down(self, blocks: list) -> None:
        """Blocks on the device and idle leave (their gradients go down), so
        that they update on the host too: under "host" every one; under
        "auto" those whose state is in host memory (an update on the device
        would bring it up and take it back, 16 bytes a parameter in fp32,
        where the host's moves 8: gradients down, weights up)."""
        engine = self.pager.engine
        for block in blocks:
            if block in engine.resident and block.pins == 0:
                engine.evict(block)

    def choose(self, blocks: list) -> list:
        """Of `blocks` (in next-forward order, each able to step on the host),
        those that do: all of them under "host" and on the CPU device; under
        "auto" on CUDA, the placement's choice (training/host_placement.py)."""
        if self.mode == "host" or not self.pager.transport.is_cuda:
            return blocks
        return self.placement.choose(blocks)

    # ---------------------------------------------------------- running
    def _started_worker(self) -> HostWorker:
        if self._worker is None:
            self._worker = HostWorker(host_threads() if self.pager.transport.is_cuda else 0)
        return self._worker

    def updating(self) -> bool:
        """Whether a block's update may still be running on the host."""
        return bool(self._running)

    def submit(self, block, job: HostJob) -> None:
        self.pager.engine.host_pages_change(block)  # (the update writes its weights' pages: copies elsewhere are stale)
        earlier = block.host_update
        future = self._started_worker().submit(job, after=() if earlier is None else (earlier,))
        future.add_done_callback(self._measured)
        owners = self.pager.owners
        if owners is not None and owners.owns(block):
            future.add_done_callback(lambda f: owners.published_on_host(block, f))  # ([Note: block owners])
        block.host_update = future
        self._running.add(block)
        self.pager.prefetch_frontier.reset()  # (a walk waits at it: [Note: the prefetch frontier])
        self.pager.counters.host_steps += 1

    def after_copy(self, event, fn) -> None:
        """Run `fn` on the worker once `event` (a copy; None: none) has
        landed, without holding up the thread that asks."""
        self._started_worker().submit(AfterCopy(event, fn))

    def wait(self, block) -> None:
        """Before `block`'s pages are copied or read: its update on the host
        is done (the engine calls this before a fetch, through the owner)."""
        future, block.host_update = block.host_update, None
        self._running.discard(block)
        if future is None:
            return
        if not future.done():
            start = time.perf_counter()
            with _record_range("host_step_wait", block.name):
                future.exception()  # (waits)
            waited = time.perf_counter() - start
            self.pager.counters.host_step_wait_seconds += waited
            self.placement.waited_seconds += waited
        self._result(block, future)

    def wait_all(self) -> None:
        for block in list(self._running):
            self.wait(block)

    def close(self) -> None:
        self.wait_all()
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    @staticmethod
    def _result(block, future: Future) -> None:
        error = future.exception()
        if error is not None:
            raise RuntimeError(
                f"pager: the optimizer's update of block {block.name!r} on the host raised (its weights and "
                f"state may be partly updated, as after a step that raised): {error!r}"
            ) from error

    def _measured(self, future: Future) -> None:
        # (on the worker thread)
        if future.exception() is None:
            job = future.result()
            self.pager.counters.host_step_seconds += job.seconds
            self.pager.counters.host_master_passes += job.passes
            if job.weight_bytes:
                self.placement.took(job.seconds, job.weight_bytes)

    # ---------------------------------------------------------- measuring
    def forward_starts(self) -> None:
        """A training forward starts (CUDA: its length is measured for "auto")."""
        self.placement.forward_starts(
            measure=self.mode == "auto" and bool(self.pager.optimizers) and self.pager.transport.is_cuda
        )

    def forward_ends(self) -> None:
        self.placement.forward_ends()

    # ---------------------------------------------------------- building
    def fused_on_host(self, optimizer) -> bool:
        """Whether the update runs torch's fused CPU kernel instead of the
        optimizer's per-tensor code: on CUDA only (on the CPU device the
        update must be the optimizer's own, bit for bit), for the classes
        that have one, where this torch has it (tried once)."""
        cls = type(optimizer)
        if (
            not self.pager.transport.is_cuda
            or cls.__module__.split(".")[:2] != ["torch", "optim"]
            or cls.__name__ not in FUSED_ON_HOST
        ):
            return False
        if cls not in self._fused:
            p = torch.nn.Parameter(torch.zeros(2))
            p.grad = torch.zeros(2)
            try:
                cls([p], lr=0.0, fused=True).step()
                self._fused[cls] = True
            except (RuntimeError, ValueError, TypeError):
                self._fused[cls] = False
        return self._fused[cls]


def host_update_landed(block) -> bool:
    """`block`'s update on the host is done and did not raise (one that
    raised is reported by the use that needs the block, not by a prefetch)."""
    future = block.host_update
    return future.done() and future.exception() is None
