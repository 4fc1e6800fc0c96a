"""Data-parallel training over torch.distributed: every rank pages its own
blocks under its own budget, and each block's gradients are averaged over the
process group as soon as the block's backward has ended.

[Note: a block is the bucket]
DDP copies gradients into buckets and all-reduces a bucket once every
gradient in it is ready. Here a block's gradients already sit in one flat
device buffer (its grads segment), so the block is the bucket, with no copy
in or out. A block is ready when every forward use of it in this step (and
every use of the blocks that borrow its tensors: `deps`) has had its
backward: its gradients are final. Each rank then scales the buffer by
1/world, as DDP does while it copies gradients into its bucket, so the values
are DDP's. It all-reduces the buffer on a communication stream, after the
backward's kernels, and releases the block at once. If the block has to leave
before the reduction is done, its write-back and the reuse of its memory are
ordered after the reduction (`after_reduction`). At the end of the backward,
compute waits for the last reduction, so `clip_grad_norm_` and `opt.step()`
read averaged gradients.

[Note: the same collectives in the same order on every rank]
Collectives match by order, so every rank must reduce the same blocks in the
same order. That holds even where ranks ran different blocks (a supernet's
sampled paths) or where a block's backward ends at different times. At the
first backward hook of a pass, the ranks exchange which blocks they used (ran
forward with grad, or hold gradients from earlier micro-steps): one small
all-reduce of a flag per block. The blocks some rank used are reduced in one
fixed order, the reverse of the block list (the backward's usual order). A
rank reduces the next block in that order as soon as the block's backward has
ended here, or at once if this rank did not use it (its share is zeros). A
block whose backward never comes here (its inputs needed no gradient: the
first block) is reduced at the end of the backward. Then one more small
all-reduce, a flag per parameter, says which parameters got a gradient on
some rank. As with `DistributedDataParallel(find_unused_parameters=True)`, a
parameter no rank gave a gradient keeps `grad=None` (the optimizer skips it),
and one that some rank gave a gradient has the average on every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import uuid
from datetime import timedelta
from itertools import chain

import torch
import torch.distributed as dist

from ..base import guards, wrappers

log = logging.getLogger("pager")
GRADS = ("grads",)


def resolve_group(process_group):
    """The group to average gradients over, or None (one process).

    None picks up the default group when torch.distributed is initialized with
    more than one rank; False turns data parallelism off."""
    if process_group is False:
        return None
    if process_group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "pager: process_group= was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (torchrun sets up its environment)."
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(
            f"pager: process_group={process_group!r} must be a torch.distributed.ProcessGroup "
            "(e.g. torch.distributed.group.WORLD or one from new_group), None or False."
        )
    return process_group


def control_on_cpu(group) -> bool:
    """Whether the group has a CPU backend (small flags are then exchanged
    without the device)."""
    return any(name in str(dist.get_backend(group)).lower() for name in ("gloo", "mpi"))


def control_group(group, timeout_seconds: float):
    """A group of the same ranks with a CPU backend, for pager's small
    exchanges on the host (`group` itself where it has one).

    [Note: small exchanges go over the CPU]
    Through NCCL, a handful of flags must be copied to the device, reduced
    on a stream and copied back, and the host waits for that stream: at
    the end of a backward it then waits for every reduction queued before
    (they follow the backward's kernels), so it reaches `opt.step()` only
    once the GPU has finished the backward, and updates on the host can no
    longer overlap the backward's tail (measured on 2x H200: a step 1.19x
    as long in a group of one rank; 1.004x over gloo). Over gloo the host
    exchanges them without touching the device. Made at wrap, by the
    group's ranks."""
    if control_on_cpu(group):
        return group
    return dist.new_group(
        dist.get_process_group_ranks(group),
        backend="gloo",
        timeout=timedelta(seconds=timeout_seconds),
        use_local_synchronization=True,
    )


def check_same_model(model: torch.nn.Module, group, timeout_seconds: float, device) -> None:
    """Every rank must wrap the same model (names, shapes, dtypes): else the
    ranks would reduce buffers that do not match. Raises naming the ranks."""
    text = ";".join(
        f"{name}:{tuple(t.shape)}:{t.dtype}:{getattr(t, 'requires_grad', False)}"
        for name, t in chain(model.named_parameters(), model.named_buffers())
    )
    _check_equal_across(
        group,
        text,
        timeout_seconds,
        device,
        "the models' parameters and buffers (names, shapes, dtypes, requires_grad) differ",
        "build the same model on every rank before wrapping it, or pass process_group=False "
        "if the ranks are not to average gradients (model parallel)",
    )


def check_same_blocks(pager, group, timeout_seconds: float) -> None:
    text = "|".join(b.name for b in pager.all_blocks())
    _check_equal_across(
        group,
        text,
        timeout_seconds,
        pager.device,
        "the blocks differ (discovery depends on the budget)",
        'give every rank the same budget (not "auto"), or the same blocks=',
    )


def _check_equal_across(group, text: str, timeout_seconds: float, device, what: str, fix: str) -> None:
    """Compare a digest of `text` across the ranks (waiting at most
    `timeout_seconds` for them: a rank that failed in its own wrap)."""
    digests = _gather_texts(
        group,
        hashlib.sha256(text.encode()).hexdigest(),
        timeout_seconds,
        device,
        "wrap: comparing the models of the ranks",
    )
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ValueError(
            f"pager: data parallel over {len(digests)} ranks: {what} between rank 0 and rank(s) {differ}; {fix}."
        )


def broadcast_from_first(model: torch.nn.Module, group, device: torch.device, timeout_seconds: float) -> None:
    """Rank 0's parameters and buffers on every rank (as DDP does at
    construction), before they move into pages."""
    src = dist.get_global_rank(group, 0)
    cpu = control_on_cpu(group)
    seen = set()
    with torch.no_grad():
        # (a quantized weight by its inner tensors: [Note: wrapper-subclass weights] in base/wrappers.py)
        for name, t in wrappers.expand([*model.named_parameters(), *model.named_buffers()]):
            if id(t) in seen or t.device.type == "meta":
                continue
            seen.add(id(t))
            staged = t.data if cpu or t.device.type != "cpu" else t.data.to(device)  # (NCCL: through the device)
            wait_for(
                dist.broadcast(staged, src, group=group, async_op=True),
                f"wrap: broadcasting {name!r}",
                group,
                timeout_seconds,
            )
            if staged is not t.data:
                t.data.copy_(staged)


def share_host_pages(pager, group, timeout_seconds: float) -> None:
    """[Note: one host copy per node]
    With `wrap(share_host_pages=True)`, the ranks on one host keep one copy of
    the model's weights in host memory instead of one each. The node's first
    rank names a file in /dev/shm; every rank of the node maps it
    (`HostArena.share`), page-locks it for its own GPU, and lays its weights
    pages out in it, in the same order (the ranks' blocks are the same:
    `check_same_blocks`). Each rank writes its pages there; the values are
    the same bytes on every rank (rank 0's, broadcast), so the writes agree.
    Once every rank has mapped it the file is unlinked: the memory lives as
    long as a rank maps it, and nothing is left behind if a rank dies.
    A page whose values change on one rank (a training step, running
    statistics) is written to a page of that rank's own instead (copy on
    write, `HostTier._store_private` in engine/tiers.py): the others go on reading the shared copy,
    never a page another rank is rewriting. So inference on N ranks holds the
    weights once per node; training holds each changed block per rank, as
    without sharing, unless each block has one writer per node ([Note:
    block owners] in training/owners.py)."""
    with node_file(
        group, timeout_seconds, pager.device, "share_host_pages=True", "the node's shared host pages"
    ) as path:
        pager.engine.host.share(pager, path)


@contextlib.contextmanager
def node_file(group, timeout_seconds: float, device, option: str, what: str):
    """A path in /dev/shm that every rank of a node gets alike, for the
    `with` body to map (the file is made by the first to map it). The
    node's first rank names it; once every rank has mapped it, it is
    unlinked: the memory lives as long as a rank maps it."""
    rank = dist.get_rank(group)
    first = node_ranks(group, timeout_seconds, device)[0]  # the node's first rank names the file
    folder = "/dev/shm"
    if not os.path.isdir(folder):
        raise ValueError(
            f"pager: {option} needs {folder} (shared memory, Linux); it is not here. "
            f"Wrap without {option.split('=')[0]}."
        )
    name = f"pager-{uuid.uuid4().hex}" if rank == first else ""
    names = _gather_texts(group, name, timeout_seconds, device, f"wrap: naming {what}")
    path = os.path.join(folder, names[first])
    yield path
    _gather_texts(group, "mapped", timeout_seconds, device, f"wrap: waiting for the node's ranks to map {what}")
    if rank == first:
        os.unlink(path)  # (mapped by every rank of the node: the memory stays while one maps it)


def node_ranks(group, timeout_seconds: float, device) -> list[int]:
    """The ranks of `group` on this rank's node, in order: those on its host
    and, under `torchrun`, of its node rank (`GROUP_RANK`). Two launches on
    one host as two nodes (`--nnodes 2 --node-rank 0` and `1`, as a test of
    a two-node run on one machine) are two nodes, each with its own shared
    pages and owners, as they would be on two hosts."""
    node = f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"
    nodes = _gather_texts(group, node, timeout_seconds, device, "wrap: finding the ranks of each node")
    return [r for r, n in enumerate(nodes) if n == node]


def _gather_texts(group, text: str, timeout_seconds: float, device, what: str, width: int = 256) -> list[str]:
    """Every rank's `text` (at most `width` bytes of UTF-8), in rank order."""
    data = text.encode()
    if len(data) > width:
        raise ValueError(f"pager: {text!r} is longer than {width} bytes")
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    if not control_on_cpu(group):
        mine = mine.to(device)
    texts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    wait_for(dist.all_gather(texts, mine, group=group, async_op=True), what, group, timeout_seconds)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in texts]


def wait_for(work, what: str, group, timeout_seconds: float) -> None:
    """Wait for a collective of pager's, at most `timeout_seconds`; raise
    saying what it was and that another rank probably stopped."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_seconds))
    except Exception as e:  # noqa: BLE001 (re-raised with what pager was doing)
        raise RuntimeError(
            f"pager: rank {dist.get_rank(group)} of {dist.get_world_size(group)}: {what} failed or timed out "
            f"(dist_timeout={timeout_seconds:g} s): {e}. Another rank probably died or raised, or ran another "
            "loop: every rank must wrap the same model and run the same forwards and backwards, and no_sync() "
            "alike."
        ) from e


class Reducer:
    """Averages each block's gradients over `group` as its backward ends
    (see [Note: a block is the bucket])."""

    def __init__(self, pager, group, timeout_seconds: float):
        self.pager = pager
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_seconds = timeout_seconds
        self.control_group = control_group(group, timeout_seconds)
        self.cuda = pager.transport.is_cuda
        # (CUDA only: a CPU run's collectives are waited for where they are issued)
        self.comm_stream: torch.cuda.Stream | None = torch.cuda.Stream(pager.device) if self.cuda else None
        self.sync_next = True  # False inside no_sync(): the next forwards' backward does not reduce
        self.step_syncs = True  # what the last forward saw
        self.uses: dict = {}  # block -> forward uses with grad since the last backward
        self.ended: dict = {}  # block -> backward ends in this pass
        self.order: list | None = None  # the blocks to reduce in this pass, in order (None: no reduction)
        self.next = 0  # the first of them not reduced yet
        self.used_here: set = set()
        self.had_grad: dict = {}  # id(param) -> it had a gradient here when its block was reduced

    @contextlib.contextmanager
    def no_sync(self):
        before, self.sync_next = self.sync_next, False
        try:
            yield
        finally:
            self.sync_next = before

    # ------------------------------------------------------------ the step
    def forward_starts(self) -> None:
        self.step_syncs = self.sync_next

    def forward_use(self, block) -> None:
        for b in _with_deps(block):
            self.uses[b] = self.uses.get(b, 0) + 1

    def backward_starts(self) -> None:
        """First backward hook of a pass: agree on the blocks to reduce
        ([Note: the same collectives in the same order on every rank])."""
        self.order, self.next, self.ended = None, 0, {}
        if not self.step_syncs:
            return
        candidates = [b for b in reversed(self.pager.blocks) if b.trainable]
        here = [b in self.uses or _has_grads(b) for b in candidates]
        flags = torch.tensor(here, dtype=torch.uint8)
        self._control(flags, "agreeing on the blocks used in this step")
        self.order = [b for b, f in zip(candidates, flags.tolist()) if f]
        self.used_here = {b for b, h in zip(candidates, here) if h}
        rest = self.pager.remainder
        if rest is not None and rest.trainable:
            # The model's own tensors outside blocks (an embedding, a head)
            # are used anywhere in the forward and have no hooks: their
            # gradients are final at the end of the backward only.
            self.order.append(rest)
            self.used_here.add(rest)

    def backward_ended(self, block) -> None:
        """`block`'s backward (one use of it) has ended: reduce what is ready."""
        if self.order is None:
            return
        for b in _with_deps(block):
            self.ended[b] = self.ended.get(b, 0) + 1
        while self.next < len(self.order):
            b = self.order[self.next]
            if b.module is None or (b in self.used_here and self.ended.get(b, 0) < self.uses.get(b, 0)):
                return  # its gradients are not final yet; later blocks wait for it (same order everywhere)
            self._reduce(b)
            self.next += 1

    def backward_finished(self, finished: bool) -> None:
        """End of a backward pass: reduce the rest, drop gradients no rank
        made, and order compute after the reductions."""
        order, self.order = self.order, None
        self.uses, self.ended = {}, {}
        if order is None:
            return
        try:
            if not finished:
                log.warning(
                    "pager: rank %d: a backward did not finish; its gradients were not averaged "
                    "(the other ranks wait for this rank's reductions until they time out).",
                    self.rank,
                )
                return
            while self.next < len(order):
                self._reduce(order[self.next])
                self.next += 1
            self._drop_unused(order)
        finally:
            self.had_grad = {}
            if self.cuda:
                # clip_grad_norm_ and opt.step() read the averaged gradients.
                self.pager.transport.compute_waits(self._comm.record_event())
                for b in order:
                    b.comm_event = None

    @property
    def _comm(self) -> torch.cuda.Stream:
        """The collectives' stream (a CUDA run's; a CPU run has none)."""
        assert self.comm_stream is not None
        return self.comm_stream

    def after_reduction(self, block, ready):
        """The event after which `block`'s memory may be read for its
        write-back and reused: after `ready` and its reduction in flight."""
        if block.comm_event is None:
            return ready
        # The write-back must copy the averaged gradients, not the ones the
        # all-reduce is still reading and overwriting.
        if ready is not None:
            self._comm.wait_event(ready)
        return self._comm.record_event()

    # ------------------------------------------------------------ helpers
    def _reduce(self, block) -> None:
        pager = self.pager
        pager.grad_pages.ensure_segment(block)
        seg = block.segments["grads"]
        pager.uses.acquire(block, GRADS, record=False)
        try:
            with torch.no_grad(), guards.unguarded():
                pager.grad_pages.gather(seg)  # gradients autograd put beside the page
                for i, p in enumerate(seg.params):
                    had = p.grad is seg.tensors[i]
                    self.had_grad[id(p)] = had
                    if not had:  # this rank's share is zeros; the page holds the average from now on
                        seg.tensors[i].zero_()
                        p.grad = seg.tensors[i]
                spans = _spans(seg)
                for span in spans:
                    span.mul_(1.0 / self.world)  # DDP's scaling, before the sum
                self._all_reduce(block, spans)
            seg.force_dirty = True
            counters = pager.counters
            counters.reduced_bytes += sum(s.numel() * s.element_size() for s in spans)
            counters.reductions += 1
        finally:
            pager.uses.release(block)

    def _all_reduce(self, block, spans) -> None:
        what = f"averaging the gradients of block {block.name!r}"
        if not self.cuda:
            for span in spans:
                self._wait(dist.all_reduce(span, group=self.group, async_op=True), what)
            return
        with torch.profiler.record_function(f"pager::reduce[{block.name}]"):
            # The all-reduce reads what the backward and the scaling wrote.
            self._comm.wait_stream(self.pager.transport.compute_stream())
            with torch.cuda.stream(self.comm_stream):
                works = [dist.all_reduce(span, group=self.group, async_op=True) for span in spans]
                for work in works:
                    work.wait()  # the comm stream (not the host, with NCCL) waits for the collective
            block.comm_event = self._comm.record_event()

    def _drop_unused(self, order) -> None:
        params = [p for b in order for p in b.segments["grads"].params]
        flags = torch.tensor([self.had_grad.get(id(p), False) for p in params], dtype=torch.uint8)
        self._control(flags, "agreeing on the parameters that got gradients")
        for p, f in zip(params, flags.tolist()):
            if not f:
                p.grad = None  # no rank gave it a gradient (DDP leaves it None too)

    def _control(self, flags: torch.Tensor, what: str) -> None:
        """`flags` (uint8, on the CPU) becomes their maximum over the ranks,
        over the CPU group: the host never waits for the device here."""
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
        self._wait(work, what)

    def _wait(self, work, what: str) -> None:
        wait_for(work, what, self.group, self.timeout_seconds)


def _with_deps(block):
    yield block
    for dep in block.deps:
        yield from _with_deps(dep)


def _has_grads(block) -> bool:
    return any(p.grad is not None for p in block.params if p.requires_grad)


def _spans(seg) -> list[torch.Tensor]:
    """The grads segment's flat buffer as typed views, one per run of slots
    of one dtype (one for the usual block of one dtype): what is reduced."""
    spans, start, end, dtype = [], None, None, None
    for slot in seg.slots:
        if slot.dtype != dtype:
            if dtype is not None:
                spans.append(seg.flat[start:end].view(dtype))
            start, dtype = slot.offset, slot.dtype
        end = slot.offset + slot.nbytes
    if dtype is not None:
        spans.append(seg.flat[start:end].view(dtype))
    return spans
