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

[Note: how many update on the host]
Under "auto" the host takes as many of a step's blocks as it keeps up with:
when the last forward's fetches waited for updates on the host longer than
`WAIT_SHARE` of that forward's length (CUDA events around it), one block
more updates on the device from the next step on; when they waited less
than a quarter of that, one block fewer. The blocks given to the device are
the last of the forward (their deferred update rides on their fetch, late
in the forward, where the link has room), so the host reaches the first
blocks sooner. What counts is whether a forward waited, not an estimate of
the host's work: its rate varies with whatever else reads host memory, and
the backward's tail hides a part of it. Under block owners a forward also
waits for other ranks' updates on the host, and those waits count too
([Note: block owners]).

[Note: a clip holds the host's updates back]
A clip's coefficient is known on the device once the whole backward is
done, and every update that reads it waits for it to land (the factor's
copy is in the job's `after`): the head start the host has without a clip
(the last blocks updated during the backward's tail) is gone, every update
starts at the step, and where the host's update of a block takes longer
than the forward's use of one, each block of the forward waits a little
more than the one before (a 1B decoder at 40%, H200, at 03c4764: a host
update 18 ms, a block's forward 15 ms, 110-150 ms of waits a step, the step
at 1.14x the step without clip). So under a step whose gradients carry a
factor from the device (`scaled_at_step`: a clip's coefficient, or
GradScaler's `unscale_` of a device scale), the placement is a schedule,
not a count: in forward order, a block updates on the host if the host,
starting at the step and taking each block's measured time
(`seconds_per_byte` of its weights, a running mean of the updates' own
seconds), finishes it a block's time before the forward reaches it (the
forward's own length over the blocks); else on the device, where its
update rides on its fetch. The first blocks go to the device, the rest to
the host. Until both times are measured the count below decides.

The forward's own length is measured only where nothing else is in it:
a forward that waited for the host (its length less its waits: the device
may have run on while the host waited, so that is its own length at
least) or that carried updates given to the device (its copies: at most)
only bounds it. Taken as it is, either would move the next choice the way
that undoes it: one step gives every block to the host, the next forward
waits, its length less the waits is short, the next step gives ten
blocks to the device, the forward after carries their state and is long,
and every block goes to the host again (a 1B decoder at 40%, H200 at
613b5a3: steps of 0.68 and 0.82 s in turn). A forward that carried
updates and did not wait also measures what one of them adds
(`device_update_seconds`, a running mean), and the schedule weighs it:
a block the host would finish late goes to the host anyway where its
wait is shorter than that (the forward reaches every later block later by
what it waited or carried so far).

A block given to the device is on trial for one forward: its state now
crosses the link both ways, and where the link was already busy, or the
host's AdamW shares host memory with those copies, the forward grows
though the host has less to do. If that forward is longer than the one
before by more than `SLOWER_SHARE`, the block goes back to the host and
the count stays below it for `HOLD_STEPS` steps (on an H100 of a 16-core
host, 1B decoder at 40%, the count had climbed to 6 while the forwards
still waited for the host, the step at 1.3x-1.45x against 1.02x with none
given).

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
from .state_room import StateRoom

MODES = ("auto", "device", "host")
FUSED_ON_HOST = ("Adam", "AdamW", "SGD", "Adagrad")  # torch.optim classes with a fused CPU kernel
WAIT_SHARE = 0.02  # "auto": a forward may wait this share of its length for updates on the host
SLOWER_SHARE = 0.02  # "auto": a forward this much longer after one more update went to the device takes it back
HOLD_STEPS = 32  # "auto": ... and for this many steps no more go to the device than before that one
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
        # Under "auto": how many of a step's blocks update on the device ([Note: how many update on the host]).
        self.on_device = 0
        self._trial: float | None = None  # the forward's seconds before the last block given to the device (on trial)
        self._ceiling, self._ceiling_until = 0, 0  # on_device stays at most this until that many choices
        self._choices = 0
        self.waited_seconds = 0.0  # fetches' waits for updates on the host, since wrap
        self._waited_then = 0.0
        self._forward_events: tuple | None = None  # (start, end) CUDA events, reused
        self._forward_open = False
        self._forward_read = False  # the last forward's length was used by `choose`
        self._fused: dict = {}  # optimizer class -> its fused CPU kernel runs here
        # Under a clip: the forward's own length on the device (neither waiting for the host nor carrying updates
        # given to the device), what one update given to the device adds to it, and how many the last step gave.
        self._forward_seconds: float | None = None
        self.device_update_seconds: float | None = None
        self._gave_device = 0
        self.seconds_per_byte = None  # the host's update time per byte of a block's weights, measured
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
        "auto" on CUDA, all but the last `on_device` ([Note: how many update
        on the host])."""
        if self.mode == "host" or not self.pager.transport.is_cuda:
            return blocks
        forward = None if self._forward_read else self._read_forward()
        if forward is not None:  # (once a forward: a step of several optimizers asks for each)
            self._forward_read = True
            waited, self._waited_then = self.waited_seconds - self._waited_then, self.waited_seconds
            self._measure_pace(forward, waited)
            self._gave_device = 0
            self._place(forward, waited, len(blocks))
        if self._forward_seconds is not None and self.seconds_per_byte is not None and scaled_at_step(blocks):
            host = self._by_deadline(blocks, self._forward_seconds)
        else:
            host = blocks[: len(blocks) - min(self.on_device, len(blocks))]
        self._gave_device += len(blocks) - len(host)
        return host

    def _measure_pace(self, forward: float, waited: float) -> None:
        """The forward's own length and what an update given to the device
        adds to it, from a forward of `forward` seconds that waited `waited`
        for the host ([Note: a clip holds the host's updates back])."""
        own = max(forward - waited, 0.0)
        known, carried = self._forward_seconds, self._gave_device
        waited_little = waited <= WAIT_SHARE * forward
        if known is None or (not carried and waited_little):
            pace = own
        elif not carried:  # it waited for the host: the device went on meanwhile, so its own length is at least this
            pace = max(known, own)
        else:  # it carried updates given to the device (and maybe waited): its own length is at most the whole
            pace = known
        self._forward_seconds = min(pace, forward)  # (never more than the whole: a first, cold, forward is no bound)
        if carried and waited_little:
            added = (forward - self._forward_seconds) / carried
            before = self.device_update_seconds
            self.device_update_seconds = added if before is None else 0.75 * before + 0.25 * added

    def _by_deadline(self, blocks: list, forward: float) -> list:
        """Under a clip, the blocks the host updates before the next forward
        needs them, or late by less than an update given to the device
        would make the forward ([Note: a clip holds the host's updates back])."""
        per_block = forward / max(len(self.pager.blocks), 1)
        device = self.device_update_seconds
        host, free, late = [], 0.0, 0.0
        for block in blocks:
            took = self.seconds_per_byte * block.segments["weights"].nbytes
            due = (block.index - 1) * per_block + late  # (a block's time ahead left for its fetch)
            wait = max(free + took - due, 0.0)
            if wait == 0.0 or (device is not None and wait < device):
                host.append(block)
                free += took
                late += wait
            else:
                late += device or 0.0
        return host

    def _place(self, forward: float, waited: float, n: int) -> None:
        """One more or one fewer on the device, after a forward of `forward`
        seconds that waited `waited` for the host (see the Note)."""
        self._choices += 1
        before, self._trial = self._trial, None
        if before is not None and forward > (1 + SLOWER_SHARE) * before:
            self.on_device = max(self.on_device - 1, 0)  # (the one on trial made it slower)
            self._ceiling, self._ceiling_until = self.on_device, self._choices + HOLD_STEPS
            return
        ceiling = self._ceiling if self._choices < self._ceiling_until else n
        if waited > WAIT_SHARE * forward and self.on_device < min(ceiling, n):
            self._trial = forward
            self.on_device += 1
        elif waited < WAIT_SHARE / 4 * forward:
            self.on_device = max(self.on_device - 1, 0)

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
            self.waited_seconds += waited
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
                rate = job.seconds / job.weight_bytes
                known = self.seconds_per_byte
                self.seconds_per_byte = rate if known is None else 0.75 * known + 0.25 * rate

    # ---------------------------------------------------------- measuring
    def forward_starts(self) -> None:
        """A training forward starts (CUDA: its length is measured for "auto")."""
        self._forward_read = False
        if self.mode != "auto" or not self.pager.optimizers or not self.pager.transport.is_cuda:
            return
        events = self._forward_events
        if events is None:
            events = self._forward_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        self._forward_open = True

    def forward_ends(self) -> None:
        events = self._forward_events
        if self._forward_open and events is not None:
            events[1].record()
            self._forward_open = False

    def _read_forward(self) -> float | None:
        """Seconds the last training forward took on the device (None: not measured, or not done)."""
        events = self._forward_events
        if events is None or self._forward_open or not events[1].query():
            return None
        return events[0].elapsed_time(events[1]) / 1e3

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


def scaled_at_step(blocks: list) -> bool:
    """Whether the updates of `blocks` read a factor the device computes at
    the step (a clip's coefficient): none can start before it lands."""
    for block in blocks:
        for ops in block.segments["grads"].pending.values():
            if any(isinstance(f, torch.Tensor) and f.device.type == "cuda" for _op, f in ops):
                return True
    return False


def host_update_landed(block) -> bool:
    """`block`'s update on the host is done and did not raise (one that
    raised is reported by the use that needs the block, not by a prefetch)."""
    future = block.host_update
    return future.done() and future.exception() is None
