"""Block owners: each block's optimizer update made by one rank of the node,
which alone holds the block's optimizer state (`wrap(..., block_owners=True)`).

[Note: block owners]
Data parallel without owners keeps everything on every rank: N ranks of a
node hold N copies of the optimizer state (8 bytes a parameter for AdamW in
fp32) and of the weights. With owners, the ranks of one node keep one copy
of each (every node does the same on its own: hierarchical ownership; the
nodes share nothing but the averaging of gradients):

- Weights: one copy in the node's shared host pages ([Note: one host copy
  per node] in training/distributed.py). Each block that trains has an
  owner rank, chosen at wrap: the blocks in model order, each to the rank
  with the fewest trainable bytes so far, so the ranks hold equal shares
  and consecutive blocks alternate.
- Gradients are averaged over the ranks as without owners (every rank
  holds the average: `clip_grad_norm_` and reads of `.grad` are DDP's).
- At `optimizer.step()`, a rank updates its own blocks only: the
  optimizer never sees another rank's block, so it makes no state for
  it. The owner writes the block's new weights into the node's page in
  place (an update on the host writes them there; one on the device is
  copied down at once, never deferred) and then publishes
  it, from the host worker once the page holds it: the block's slot in a
  small shared counter file holds how many updates of the block the page
  holds.
- A rank that does not own the block counts the updates it expects (one
  per `step()` in which the block had gradients: the same on every rank,
  as the averaging agrees on which parameters have them), and drops its
  copy on the device at `step()`; its next fetch of the block waits until
  the counter reaches that count, and reads the page. Prefetch stops at a
  block whose update has not been published yet.
- Where an owner's updates run is chosen as for one rank ([Note: how many
  update on the host]), its own blocks only, and a fetch that waited for
  an owner's update counts as a wait for the host where that update ran on
  the host (the owner says so beside the counter): the ranks of a node
  share its host and wait alike, so when the owners' hosts fall behind,
  each gives the device more of its own blocks. A wait for an update on an
  owner's device does not count (more updates there would not shorten it).
- Blocks that stay on every rank's device for life (the remainder:
  embeddings and a head outside blocks; the blocks it borrows from) have
  owners by parameter, not by block: their optimizer state is on the
  owner's device, and a remainder's embedding and head (AdamW state of 1 GB
  for a 32000-word vocabulary at d=2048 in fp32) would leave one rank that
  much less room for blocks, slowing its backward and so every rank's step.
  No page is read for them: at the end of each `step()` every rank takes
  part in a broadcast of each of their parameters (of the blocks that had
  gradients) from its owner, on the device.

The page is never read while it is written: its owner writes it only at a
step, after the block's gradients were averaged, which needs every rank's
backward of the block to have ended; the others read it for their next
forward only once the counter says the update is there. Whatever reads
weights from outside a block's use (`state_dict()`, `unwrap`) waits for the
updates expected first, as it does for deferred ones. The values are those
of one rank updating everything: the same optimizer code on the same
averaged gradients, so on the CPU device the weights, gradients and state
equal DDP's bit for bit.

Checkpoints: `opt.state_dict()` gathers every rank's share (a collective:
every rank calls it, as with FSDP; each gets the whole state), and
`opt.load_state_dict(full)` keeps this rank's share, so a checkpoint taken
on N ranks resumes on M. `model.load_state_dict()` is called on every rank
too: each block's owner writes its page and publishes it; the others drop
their copy. `unwrap` gives each rank's optimizer the whole state back
(a collective too).

What this holds: the weights' pages once per node, the state once per node
(the kept blocks' weights are on every device, as without owners); the
gradients pages per rank (each rank's average is read by its own clipping
and `.grad`). Weights that change outside `step()` and `load_state_dict()`
(running statistics, a user's in-place edit) would leave a page that the
ranks do not agree on: BatchNorm's running statistics are refused at wrap,
and any other change to a paged block's weights raises before the block
leaves.
"""

from __future__ import annotations

import io
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..base.common import _record_range
from .distributed import control_group, node_file, node_ranks, wait_for

log = logging.getLogger("pager")
POLL_SECONDS = 50e-6


def check_model(model: torch.nn.Module) -> None:
    """Refuse, before anything changes, a model whose weights change outside
    the optimizer's step in every forward (see the Note)."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.training:
            raise ValueError(
                f"pager: block_owners=True: {name or '<root>'} ({type(m).__name__}) updates its running statistics "
                "in every training forward, on each rank its own, and with owners the ranks read one copy of its "
                "weights. Use block_owners=False, or BatchNorm without running statistics "
                "(track_running_stats=False), or SyncBatchNorm's statistics computed before wrapping."
            )


def assign(blocks: list, params: list, world: int) -> tuple[dict, dict]:
    """(block -> its owner rank, id(param) -> its owner rank): the blocks in
    model order, then the parameters (of the kept blocks) from the largest,
    each to the rank with the fewest trainable bytes so far (ties: the
    lowest rank)."""
    load = [0] * world
    owner: dict = {}
    param_owner: dict = {}

    def take(nbytes: int) -> int:
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += nbytes
        return rank

    for block in blocks:
        owner[block] = take(sum(p.numel() * p.element_size() for p in block.params if p.requires_grad))
        param_owner.update((id(p), owner[block]) for p in block.params)
    for p in sorted(params, key=lambda p: -p.numel() * p.element_size()):  # (stable: model order among equals)
        param_owner[id(p)] = take(p.numel() * p.element_size())
    return owner, param_owner


class BlockOwners:
    """Which rank updates each block, and the node's counters of published
    updates ([Note: block owners]). One per wrapped model.

    Args:
        pager: the model's `Pager` (its weights pages in the node's shared copy).
        group: the process group (on one host or several).
        timeout_seconds: how long a fetch waits for an owner's update.
    """

    def __init__(self, pager, group, timeout_seconds: float):
        self.pager = pager
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_seconds = timeout_seconds
        sharded = [b for b in pager.blocks if b.trainable and not b.resident_for_life]
        unshared = [b.name for b in sharded if not b.weights.shared]
        if unshared:
            raise RuntimeError(
                f"pager: block_owners=True: the weights pages of blocks {unshared[:3]} are not in "
                "the node's shared copy; wrap with share_host_pages=True."
            )
        # Blocks on every rank's device for life (the remainder: embeddings,
        # a head) have owners too; their updates reach the others by broadcast.
        self.kept = [b for b in pager.all_blocks() if b.trainable and b.resident_for_life]
        # Owners are ranks of this node (each node updates every block, from
        # the same averaged gradients, and holds its state once).
        self.node = node = node_ranks(group, timeout_seconds, pager.device)
        kept_params = [p for b in self.kept for p in b.params if p.requires_grad]
        owner, param_owner = assign(sharded, kept_params, len(node))
        self.owner_of = {b: node[i] for b, i in owner.items()}  # the sharded blocks
        self.param_owner = {k: node[i] for k, i in param_owner.items()}  # their parameters, and the kept blocks'
        # (a group this rank is in; torch's stubs type `new_group` as a group or its non-member marker, by version)
        self.node_group: Any = (
            group
            if len(node) == self.world
            else dist.new_group(
                [dist.get_global_rank(group, r) for r in node],
                timeout=timedelta(seconds=timeout_seconds),
                use_local_synchronization=True,
            )
        )
        self.slot = {b: i for i, b in enumerate(sharded)}
        self._kept_stepped: list = []  # kept blocks with gradients at this step()
        with node_file(group, timeout_seconds, pager.device, "block_owners=True", "the node's update counters") as path:
            shared = torch.from_file(path, shared=True, size=max(1, 2 * len(sharded)), dtype=torch.int64)
        # (read at fetches: numpy indexing costs less than a tensor's; each view keeps the map)
        self.counters = shared.numpy()[: len(sharded)]
        self.on_host = shared.numpy()[len(sharded) :]  # 1 where the update last published ran on the host
        self.published: dict = {}  # block of this rank -> updates of it written to its page
        self.expected: dict = {}  # block of another rank -> updates of it this rank has to read
        for block in self.slot:
            if self.owner_of[block] == self.rank:
                block.weights.shared = False  # written in place: the others read its updates there
        self.cpu_group = pager.reducer.control_group  # ([Note: small exchanges go over the CPU])
        # The optimizer's state is gathered within the node (None: a node of one rank has it all).
        self.node_cpu_group: Any = (
            None
            if len(node) == 1
            else self.cpu_group
            if len(node) == self.world
            else control_group(self.node_group, timeout_seconds)
        )

    def mine(self, block) -> bool:
        """Whether this rank updates `block` (a kept block: some of its parameters)."""
        if block in self.owner_of:
            return self.owner_of[block] == self.rank
        if block in self.kept:
            return any(self.param_owner.get(id(p)) == self.rank for p in block.params)
        return True  # (no owner: every rank updates it)

    def mine_param(self, param) -> bool:
        """Whether this rank updates `param` (one of a block it updates)."""
        return self.param_owner.get(id(param), self.rank) == self.rank

    def owns(self, block) -> bool:
        """Whether `block` is this rank's and the others read its updates from its page."""
        return self.owner_of.get(block) == self.rank and block in self.slot

    # -------------------------------------------------------------- a step
    def take_step(self, blocks: list) -> list:
        """Of the blocks with gradients at `step()`, those this rank updates;
        each of the others will be read from the node's page once its owner
        has published the update."""
        mine, given = [], set(blocks)
        self._kept_stepped = [b for b in self.kept if b in given]  # (the same order on every rank)
        for block in blocks:
            if self.mine(block):
                mine.append(block)
            elif block in self.slot:
                self._expect(block)
        return mine

    def after_step(self) -> None:
        """After this rank's updates (every rank, at each `step()`): each
        kept block that had gradients gets its owner's new weights, on the
        device, by broadcast over the group."""
        for block in self._kept_stepped:
            what = f"broadcasting the weights of block {block.name!r} from their owners"
            for p in block.params:
                if id(p) not in self.param_owner:
                    continue  # (frozen: unchanged)
                src = dist.get_global_rank(self.group, self.param_owner[id(p)])
                if self.pager.transport.is_cuda:  # (stream-ordered after the update, before the next forward)
                    dist.broadcast(p.data, src, group=self.node_group)
                else:
                    wait_for(
                        dist.broadcast(p.data, src, group=self.node_group, async_op=True),
                        what,
                        self.group,
                        self.timeout_seconds,
                    )
        self._kept_stepped = []

    def _expect(self, block) -> None:
        self.expected[block] = block.owner_update = self.expected.get(block, 0) + 1
        self.pager.prefetch_frontier.reset()  # (a walk waits at it: [Note: the prefetch frontier])
        engine = self.pager.engine
        engine.host_pages_change(block)  # (the owner writes its new weights into the pages)
        if block in engine.resident and not (block.pins == 0 and engine.evict(block)):
            raise RuntimeError(
                f"pager: block_owners=True: rank {self.rank} cannot take the update of block {block.name!r} from "
                f"its owner (rank {self.owner_of[block]}): at optimizer.step() the block is in use, or views of its "
                "tensors are kept outside pager, so its copy on the device cannot be replaced. Drop those views "
                "before step()."
            )

    def updated_on_device(self, blocks: list) -> None:
        """`blocks` were updated on the device: this rank's pages get the new
        weights now, each published (by the host worker) once its copy has
        landed: the others may read the page from the moment it is."""
        for block in blocks:
            if self.owns(block):
                event = self.pager.engine.write_back(block, ("weights",))
                self.pager.host_steps.after_copy(event, lambda b=block: self.publish(b))

    def publish(self, block, on_host: bool = False) -> None:
        """The node's page of `block` holds one update more (on any thread),
        made on the host if `on_host` (said before the count, which the
        others read first)."""
        count = self.published[block] = self.published.get(block, 0) + 1
        self.on_host[self.slot[block]] = on_host
        self.counters[self.slot[block]] = count

    def published_on_host(self, block, future) -> None:
        """Done callback of `block`'s update on the host (on its worker)."""
        if future.exception() is None:
            self.publish(block, on_host=True)

    # -------------------------------------------------------------- reading
    def landed(self, block) -> bool:
        return self.counters[self.slot[block]] >= block.owner_update

    def wait(self, block) -> None:
        """Before `block`'s pages are read here: its owner's updates are in them."""
        want = block.owner_update
        if want is None:
            return
        slot = self.slot[block]
        if self.counters[slot] < want:
            with _record_range("owner_wait", block.name):
                self._poll(block, slot, want)
        block.owner_update = None

    def _poll(self, block, slot: int, want: int) -> None:
        """Sleep until `block`'s counter reaches `want` (raise after `timeout_seconds`)."""
        start = time.perf_counter()
        while self.counters[slot] < want:
            if time.perf_counter() - start > self.timeout_seconds:
                raise RuntimeError(
                    f"pager: rank {self.rank} of {self.world} waited {self.timeout_seconds:g} s (dist_timeout) "
                    f"for update {want} of block {block.name!r} from its owner, rank {self.owner_of[block]} "
                    f"(block_owners=True; the page holds {self.counters[slot]}). That rank probably died or "
                    "raised, or did not call optimizer.step() (or load_state_dict()) as this one did: every "
                    "rank must run the same steps."
                )
            time.sleep(POLL_SECONDS)
        waited = time.perf_counter() - start
        self.pager.counters.owner_wait_seconds += waited
        if self.on_host[slot]:  # (the owner's host fell behind: "auto" gives the device more of each rank's own)
            self.pager.host_steps.placement.waited_seconds += waited

    def wait_all(self) -> None:
        for block in self.expected:
            self.wait(block)

    def check_leaving(self, block) -> None:
        """`block` is about to leave: raise if its weights changed outside a
        step, where the node's ranks would no longer agree on its page."""
        seg = block.segments["weights"]
        if block in self.slot and seg.resident and seg.is_dirty():
            raise RuntimeError(
                f"pager: block_owners=True: the weights of block {block.name!r} (owned by rank "
                f"{self.owner_of[block]}) changed on rank {self.rank} outside optimizer.step() and "
                "load_state_dict() (running statistics, or an in-place change): the node's ranks read one copy "
                "of them, which its owner alone writes. Change weights through the optimizer or "
                "load_state_dict() on every rank, or wrap with block_owners=False."
            )

    # -------------------------------------------------------------- loading
    def loaded(self, block) -> None:
        """`model.load_state_dict()` wrote `block`'s weights (on every rank):
        its owner's page gets them and is published; the others drop theirs
        and read the page."""
        if block not in self.slot:
            return  # (a kept block: loaded on every rank's device alike)
        if self.owns(block):
            self.updated_on_device([block])
        else:
            block.weights.force_dirty = False  # (the owner writes the same values; this copy is dropped)
            block.weights.snapshot_versions()
            self._expect(block)

    # -------------------------------------------------------------- state
    def gather_state(self, optimizer, state: dict) -> dict:
        """`optimizer.state_dict()["state"]` (by parameter index) with every
        rank's share: each sharded parameter's entries from its owner, a rank
        of this node (every node updates every block: [Note: block owners]),
        so a node of one rank has them all and exchanges nothing."""
        if self.node_cpu_group is None:
            return state
        index = _param_index(optimizer)
        owner = {i: self.param_owner[key] for key, i in index.items() if key in self.param_owner}
        merged = dict(state)
        merged.update(self._gather_entries({i: v for i, v in state.items() if owner.get(i) == self.rank}))
        return dict(sorted(merged.items()))

    def keep_own_state(self, optimizer) -> None:
        """After `load_state_dict()`: the state of the other ranks' blocks goes."""
        for g in optimizer.param_groups:
            for p in g["params"]:
                if not self.mine_param(p):
                    optimizer.state.pop(p, None)

    def give_whole_state(self, optimizer) -> None:
        """Before the optimizer is detached (unwrap): the state of the other
        ranks' blocks, gathered, on each parameter's original device."""
        state = optimizer.state_dict()["state"]
        index = _param_index(optimizer)
        for g in optimizer.param_groups:
            for p in g["params"]:
                entry = None if self.mine_param(p) else state.get(index.get(id(p)))
                if entry is not None:
                    device = self.pager.original_device[id(p)]
                    optimizer.state[p] = {
                        k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in entry.items()
                    }

    def _gather_entries(self, shard: dict) -> dict:
        """Every node rank's `shard` ({index: {key: value}}), merged. What
        each entry holds goes first, pickled (shapes, dtypes and the values
        that are not tensors: small); then each tensor by its own broadcast
        from its owner into a tensor made for it: no pickled copy of the
        state's bytes, which took minutes for gigabytes (a 3.8 GB model's
        AdamW state on two ranks did not finish in 3 minutes)."""
        what = "gathering the optimizer's state from the blocks' owners"
        layout = {  # index -> key -> ("tensor", shape, dtype) or ("value", the value, pickled)
            # (a tensor subclass, such as torchao's low-bit optimizer state, is pickled: no collective takes it)
            i: {
                k: ("tensor", tuple(v.shape), v.dtype)
                if type(v) is torch.Tensor and v.layout == torch.strided
                else ("value", v)
                for k, v in entry.items()
            }
            for i, entry in shard.items()
        }
        merged: dict = {}
        for node_rank, part in zip(self.node, self._gather(layout, what)):
            src = dist.get_global_rank(self.group, node_rank)
            for i, entry in part.items():
                merged[i] = out = {}
                for k, (kind, *held) in entry.items():
                    if kind == "value":
                        out[k] = held[0]
                        continue
                    # (the same order on every rank: the owner's layout's)
                    t = shard[i][k].contiguous() if node_rank == self.rank else torch.empty(held[0], dtype=held[1])
                    wait_for(
                        dist.broadcast(t, src, group=self.node_cpu_group, async_op=True),
                        what,
                        self.node_cpu_group,
                        self.timeout_seconds,
                    )
                    out[k] = shard[i][k] if node_rank == self.rank else t
        return merged

    def _gather(self, obj, what: str) -> list:
        """Every node rank's `obj` (pickled), in rank order, over the node's
        CPU group."""
        group = self.node_cpu_group
        buf = io.BytesIO()
        torch.save(obj, buf)
        mine = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in self.node]
        wait_for(
            dist.all_gather(sizes, torch.tensor([mine.numel()]), group=group, async_op=True),
            what,
            group,
            self.timeout_seconds,
        )
        width = max(int(s) for s in sizes)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: mine.numel()] = mine
        parts = [torch.empty(width, dtype=torch.uint8) for _ in self.node]
        wait_for(dist.all_gather(parts, padded, group=group, async_op=True), what, group, self.timeout_seconds)
        return [torch.load(io.BytesIO(p[: int(s)].numpy().tobytes()), weights_only=False) for p, s in zip(parts, sizes)]


def _param_index(optimizer) -> dict:
    """id(param) -> its index in `optimizer.state_dict()` (torch's packing)."""
    index: dict[int, int] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            index.setdefault(id(p), len(index))
    return index
