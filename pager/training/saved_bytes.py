"""What a training forward saves for its backward, per block (`SavedBytes`,
measured on fake tensors by training/dry_run.py), what each `activations=`
policy then holds on the device and how long its pass takes, predicted,
and the choice between them (`choose`).

[Note: what each policy holds, predicted]
From the sizes measured (training/dry_run.py), by the rules of
training/activations.py, the most that activations hold on the device in a
training pass (an upper bound of what the `Ledger` counts; pessimistic
where timing decides):
- kept (the blocks "auto" keeps, and the forward's last block, which every
  policy keeps: [Note: activations off the device]): all they save;
- offload: of the others, what stays (smaller than the threshold, or a view
  the policy does not send); at the forward's end, plus what is being
  copied out (the in-flight cap, as the ledger counts it while the forward
  may send; CUDA only); in the backward, plus two blocks' activations (the
  last block's own or one brought back, and the one brought ahead);
- recompute: of the others, their inputs (each storage once), what ops
  outside blocks save, and the largest one's activations recomputed; a
  block inside a recomputed one is recomputed with it ([Note: blocks inside
  a recomputed block] in training/activations.py): its inputs are not kept,
  and what it saves is recomputed with the outer block's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# activations="offload" sends every dense save ("offload") or its contiguous ones only ("offload, views kept")
OFFLOAD, OFFLOAD_VIEWS_KEPT, RECOMPUTE, KEEP = "offload", "offload, views kept", "recompute", "keep"
IN_FLIGHT_MIN_BYTES = 64 << 20  # the least cap of bytes being copied out before compute waits (offload.py)
BRING_AHEAD_BLOCKS = 1  # at a block's backward, the blocks before it whose activations come back too (offload.py)


@dataclass
class SavedBytes:
    """Bytes a training forward saves for its backward.

    `saved[i]` (each storage once) and `inputs[i]` (each storage once, across
    blocks) are per block, in the order of `names`; `outside` is what ops
    outside every block save (embeddings, heads, the loss), `outside_before`
    of it what ops before the first block save. For offloading, each save
    as a `Save`: `saves[i]` block i's, `after[i]` those of the ops after
    block i (offloaded with its), `before` those of the ops before the first."""

    names: list[str]
    saved: list[int]
    inputs: list[int]
    outside: int
    order: list[str]  # blocks in the order their forwards ran (innermost)
    saves: list[list[Save]] = field(default_factory=list)
    after: list[list[Save]] = field(default_factory=list)
    before: list[Save] = field(default_factory=list)
    outside_before: int = 0
    outside_peak: int = 0  # the process's bytes outside pager at the step's peak, predicted
    # ([Note: what sits outside pager, predicted] in training/dry_run.py)
    within: list[int] = field(default_factory=list)  # per block, the block whose forward runs it (-1: none)
    flops: list[int] = field(default_factory=list)  # per block, its forward's own FLOPs (its inner blocks' apart)
    backward_flops: list[int] = field(default_factory=list)  # ... and its backward's, predicted
    outside_flops: int = 0  # ... of the ops outside every block
    outside_backward_flops: int = 0
    flops_dtype: torch.dtype | None = None  # the dtype most of those FLOPs run in

    @property
    def total(self) -> int:
        return sum(self.saved) + self.outside

    def _group(self, i: int | None) -> list:
        return self.before if i is None else self.saves[i] + self.after[i]

    def stays(self, i: int | None, policy: str, min_bytes: int) -> int:
        """What offloading (`policy`) leaves on the device of block `i`'s
        saves and those of the ops after it (None: of the ops before the
        first block): each storage once, as the ledger counts it."""
        views = policy == OFFLOAD
        return sum({s.key: s.storage_bytes for s in self._group(i) if not s.sent(views, min_bytes)}.values())

    def sent(self, i: int | None, policy: str, min_bytes: int) -> int:
        """What offloading (`policy`) sends of the same: each view once, as `ActivationOffload.send` does."""
        views = policy == OFFLOAD
        return sum({s.view: s.nbytes for s in self._group(i) if s.sent(views, min_bytes)}.values())

    def held(self, i: int) -> int:
        """All of the same, each storage once (kept on the device)."""
        return sum({s.key: s.storage_bytes for s in self._group(i)}.values())

    def peak(self, policy: str, kept=(), min_bytes: int = 1 << 20, copies: bool = True) -> int:
        """The most activations hold on the device in a training pass under
        `policy` for the blocks not in `kept` (names), by [Note: what each
        policy holds, predicted]."""
        last = self.names.index(self.order[-1]) if self.order else None
        keeps = {i for i, n in enumerate(self.names) if n in kept} | ({last} if last is not None else set())
        rest = self._rest(kept)
        held = sum(self.saved[i] for i in keeps)
        if policy == KEEP or not rest:
            return held + sum(self.saved[i] for i in rest) + self.outside
        assert last is not None  # (the blocks in `rest` are of the order, which has a last one then)
        if policy == RECOMPUTE:  # at the forward's end; in the backward, one block's recomputed beside the rest
            groups = self.recomputed_groups(rest)
            inputs = sum(self.inputs[i] for i in groups)
            recomputed = max(sum(self.saved[j] for j in group) for group in groups.values())
            backward = held - self.saved[last] + inputs + self.outside + recomputed
            return max(held + inputs + self.outside, backward)
        # Offloaded, ops between blocks go with the block before them (the last one's stay with it).
        held = sum(self.held(i) for i in keeps)
        stays = sum(self.stays(i, policy, min_bytes) for i in [*rest, None])
        sent = [self.sent(i, policy, min_bytes) for i in rest]
        before_sent = self.sent(None, policy, min_bytes)
        # (the ledger counts the copies out as the full cap while the forward may send)
        in_flight = max(IN_FLIGHT_MIN_BYTES, max(sent)) if copies and (any(sent) or before_sent) else 0
        forward_end = held + stays + in_flight
        # In the backward: the last block's own with the one ahead of it brought, then two brought at a time.
        brought = max(self.held(last), max(sent)) + BRING_AHEAD_BLOCKS * max(max(sent), before_sent)
        return max(forward_end, held - self.held(last) + stays + brought)

    def recomputed_groups(self, rest) -> dict:
        """{block: the blocks its recomputation drops the saves of} for the
        recomputed blocks `rest` ([Note: blocks inside a recomputed block]
        in training/activations.py): a block inside a recomputed one is
        recomputed with it, and keeps no inputs of its own."""
        rest = set(rest)
        groups: dict = {}
        for i in sorted(rest):
            top = i
            while self._within(top) in rest:
                top = self._within(top)
            groups.setdefault(top, []).append(i)
        return groups

    def _within(self, i: int) -> int:
        return self.within[i] if self.within else -1

    def predicted_seconds(self, policy: str, kept, held: int, spare_bytes: int, speeds: Speeds, **kw) -> float:
        """A training pass's seconds under `policy` for the blocks not in
        `kept`, where activations hold `held` at most, predicted: the longer
        of the link's and compute's ([Note: the faster policy, predicted] in
        training/activations.py)."""
        rest = self._rest(kept)
        link = max(held - spare_bytes, 0) * speeds.link_share  # (what does not fit streams)
        if policy in (OFFLOAD, OFFLOAD_VIEWS_KEPT):  # (sent in the forward, brought back in the backward)
            min_bytes = kw.get("min_bytes", 1 << 20)
            link += sum(self.sent(i, policy, min_bytes) for i in [*rest, None])
        flops = self.outside_flops + self.outside_backward_flops + sum(self.flops) + sum(self.backward_flops)
        if policy == RECOMPUTE:  # (the blocks inside a recomputed one run again with it, those that keep too)
            again = set(rest)
            flops += sum(n for i, n in enumerate(self.flops) if self._under(i, again))
        return max(link / speeds.link_bytes_per_s, flops / speeds.flops_per_s)

    def _under(self, i: int, blocks: set) -> bool:
        """Whether block `i` is one of `blocks` or runs inside one."""
        while i != -1:
            if i in blocks:
                return True
            i = self._within(i)
        return False

    def _rest(self, kept) -> list[int]:
        """The blocks of the forward whose activations a policy handles: not
        in `kept`, and not the forward's last (every policy keeps its)."""
        last = self.names.index(self.order[-1]) if self.order else None
        return [i for i, n in enumerate(self.names) if n not in kept and i != last and n in self.order]


@dataclass(frozen=True)
class Speeds:
    """What the device does in a second, for [Note: the faster policy,
    predicted]: bytes over the host link, FLOPs in the dtype the forward
    computes in; `link_share`, the bytes a pass brings over the link per
    device byte of blocks' pages that do not fit: their weights twice
    (forward and backward; encoded where they are compressed) over all
    their pages (with gradients and optimizer state, which the host updates
    where they are)."""

    link_bytes_per_s: float
    flops_per_s: float
    link_share: float = 2.0


@dataclass(frozen=True)
class Save:
    """One tensor a forward saved: its bytes, its storage's, its layout, and
    keys for its storage and its view."""

    nbytes: int
    storage_bytes: int
    contiguous: bool
    dense: bool
    key: int
    view: tuple

    def sent(self, views: bool, min_bytes: int) -> bool:
        """Whether offloading sends it (`ActivationOffload.wants`); `views`: dense views that are not contiguous too."""
        return self.nbytes >= min_bytes and (self.contiguous or views and self.dense)


def choose(sb: SavedBytes, policy: str, spare_bytes: int, room_bytes: int | None, speeds=None, **kw) -> tuple | None:
    """(kept names, policy, the most activations hold) for `policy`, where
    activations may hold `room_bytes` beside what blocks need at least (None:
    unbounded) and `spare_bytes` beside every block with all its pages.
    "auto": the longest tail of the forward that keeps its own with the
    first of offload with views kept, offload and recompute for the rest
    (with `speeds`, a `Speeds`: the first of them in the order of their
    predicted seconds), all within `spare_bytes` (blocks give up no room);
    where none is, no tail and the first policy within `room_bytes`
    ([Note: activations, the automatic choice] in training/activations.py).
    None where nothing holds."""
    if policy != "auto":
        held = sb.peak(policy, (), **kw)
        return ((), policy, held) if room_bytes is None or held <= room_bytes else None
    order = list(dict.fromkeys(reversed(sb.order)))[::-1]  # (a block used twice: where it ran last)
    for n in range(len(order), -1, -1):
        kept = set(order[len(order) - n :])
        if sum(sb.saved[sb.names.index(name)] for name in kept) > spare_bytes:
            continue
        for p, held, _seconds in fastest_first(sb, kept, spare_bytes, speeds, kw):
            if held <= spare_bytes:
                return kept, p, held
    for p, held, _seconds in fastest_first(sb, set(), spare_bytes, speeds, kw):
        if room_bytes is None or held <= room_bytes:
            return set(), p, held
    return None


def fastest_first(sb: SavedBytes, kept: set, spare_bytes: int, speeds, kw) -> list:
    """[(policy, the most it holds, its predicted seconds or None)] of the
    policies "auto" chooses from, in their order of preference, or with
    `speeds` of their predicted seconds (ties in that order)."""
    held = [(p, sb.peak(p, kept, **kw)) for p in (OFFLOAD_VIEWS_KEPT, OFFLOAD, RECOMPUTE)]
    if speeds is None:
        return [(p, h, None) for p, h in held]
    timed = [(p, h, sb.predicted_seconds(p, kept, h, spare_bytes, speeds, **kw)) for p, h in held]
    return sorted(timed, key=lambda pht: pht[2])
