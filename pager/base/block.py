"""A block: the paging unit. Its tensors, their pages, and their residency.

A block's tensors are laid out in segments, each one contiguous region with
a pinned host page and a device storage of the same layout:

    weights: the block's parameters and buffers (always)
    frozen:  where a block has parameters that require grad and some that do
             not (adapters on a frozen layer): those that do not, on a page of
             their own ([Note: frozen pages]); `weights` holds the rest
    grads:   gradients of its trainable parameters (once a backward made them)
    state:   the attached optimizer's state for its parameters (after a step)

A fetch copies each needed segment in one transfer; an eviction writes back
the dirty segments and frees the device storage of all of them.

[Note: identity by storage resize]
Every tensor of a segment is, once and for all at wrap time, made a typed view
(`t.data = view`) into the segment's flat uint8 device tensor. From then on the
tensor objects and their StorageImpl never change: eviction resizes that
storage to 0 bytes and a fetch resizes it back and copies the page in. Autograd
saves views of weights (F.linear saves `weight.t()`); since the views share the
StorageImpl, a backward after a re-fetch reads the re-fetched bytes. Rebinding
`param.data` per fetch would leave saved views on the old memory.

[Note: dirty by version counter]
Every in-place change of a tensor (an optimizer step, BatchNorm's running
stats, `load_state_dict`) bumps its version counter, while our own copies into
the flat storage bump only the flat tensor's counter. A segment whose tensors'
versions moved since the fetch is dirty and is written back before eviction;
a clean one leaves for free. Changes made through `.data` escape the counter:
`Block.mark_dirty()` covers those (the optimizer path calls it after a step).

[Note: frozen pages]
Fine-tuning adapters (LoRA) leaves most of a block frozen: its parameters do
not require grad, and only a few small ones change. In one page, the whole
page would be dirty after every step (written back at each eviction) and a
compressed one would turn plain. So a block with both kinds keeps the frozen
parameters on a page of their own, `frozen`, and the rest (the trainable
parameters and the buffers, which running statistics change) on `weights`.
The frozen page is compressed by `compress=` and stays so; as long as its
tensors keep their version counters it is clean and never written back (an
in-place change to a frozen parameter makes it dirty like any page; a
compressed one then turns plain). Every use fetches both (`WEIGHTS` in
base/common.py names them together), so they are resident together. A
block whose parameters all require grad, or none, has `weights` alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from typing import Protocol

    from ..codec.compress import Encoded

    class PageCache(Protocol):
        """What caches a segment's page (`engine.disk.DiskTier`, a layer above)."""

        def readable(self, seg: Segment) -> torch.Tensor: ...


ALIGN_BYTES = 512  # every slot and page starts on this boundary
DIRECT_ALIGN = 4096  # direct (O_DIRECT) reads: file offsets, lengths and memory on this boundary ([Note: direct reads])


def align(n: int, to: int = ALIGN_BYTES) -> int:
    return (n + to - 1) // to * to


def align_up(n: int) -> int:
    return align(n, DIRECT_ALIGN)


class PageState(enum.Enum):
    """Where a segment's bytes are (see [Note: the residency engine] in engine/engine.py)."""

    HOST = "host"  # only the host page holds them
    FETCHING = "fetching"  # device memory allocated, the copy up enqueued; compute has not waited on it
    RESIDENT = "resident"  # compute is ordered after the fetch
    WRITING_BACK = "writing back"  # left the device; its write-back to the page may still be running


def storage_key(t: torch.Tensor) -> int:
    """The identity of `t`'s storage (whatever its class)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage()._cdata


@dataclass
class Slot:
    """Where one tensor lives in its segment."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    nbytes: int
    stride: tuple | None = None  # kept for dense permuted layouts (a transposed weight)

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        t = flat[self.offset : self.offset + self.nbytes].view(self.dtype)
        return t.as_strided(self.shape, self.stride) if self.stride is not None else t.view(self.shape)


def layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[Slot], int]:
    """Slots for `named` tensors, each aligned, and the segment's total bytes.

    A tensor stored densely in another order (a transposed weight) keeps its
    strides, so kernels see the same layout and results stay bitwise equal;
    one with gaps (a slice) becomes contiguous."""
    slots, offset = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        permuted = not t.is_contiguous() and _dense_permuted(t)
        slots.append(Slot(name, t.dtype, t.shape, offset, nbytes, tuple(t.stride()) if permuted else None))
        offset = align(offset + nbytes)
    return slots, offset


def in_place(lead: int | None) -> bool:
    """A tensor whose file offset modulo `DIRECT_ALIGN` is `lead` is read
    straight into its page there: it then lies on an `ALIGN_BYTES` boundary
    too ([Note: direct reads] in engine/page_io.py)."""
    return lead is not None and lead % ALIGN_BYTES == 0


def layout_for_files(named: list[tuple[str, torch.Tensor]], leads: list) -> tuple[list[Slot], int]:
    """Slots for `named` tensors whose bytes come from files: a tensor whose
    `lead` (its file offset modulo `DIRECT_ALIGN`) is `in_place` sits at that
    offset modulo `DIRECT_ALIGN` with aligned gaps around it, so that the
    aligned range around it in its file can be read straight into the page
    ([Note: direct reads] in engine/page_io.py); any other is placed as by
    `layout`, on an `ALIGN_BYTES` boundary. The total is a multiple of
    `DIRECT_ALIGN`."""
    slots, offset = [], 0
    for (name, t), lead in zip(named, leads):
        nbytes = t.numel() * t.element_size()
        at = lead if in_place(lead) else None
        offset = align(offset) if at is None else align_up(offset) + at
        slots.append(Slot(name, t.dtype, t.shape, offset, nbytes))
        offset = offset + nbytes if at is None else align_up(offset + nbytes)
    return slots, align_up(offset)


def _dense_permuted(t: torch.Tensor) -> bool:
    """True if `t` fills its storage span exactly, in some order of its dims."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


@dataclass(eq=False)  # (compared and hashed by identity: the disk tier keys its pages by segment)
class Segment:
    """One contiguous region of a block: a host page and a device storage."""

    kind: str
    slots: list[Slot]
    nbytes: int
    host: torch.Tensor | None  # uint8 page in a host arena (None: on disk only, see engine/disk.py)
    flat: torch.Tensor  # uint8 on the device; storage is 0 or nbytes
    tensors: list[torch.Tensor] = field(default_factory=list)  # the bound device views
    # Quantized weights whose inner tensors are among `tensors` ([Note:
    # wrapper-subclass weights] in base/wrappers.py), and their own classes while guarded.
    wrappers: list = field(default_factory=list)
    wrapper_classes: list = field(default_factory=list)
    inner_ids: frozenset = frozenset()  # ids of their inner tensors
    state: PageState = PageState.HOST
    versions: list[int] = field(default_factory=list)
    force_dirty: bool = False
    writeback_event: object = None  # last write-back of this page, if any
    host_valid: bool = True  # the host page holds data worth fetching
    encoded: Encoded | None = None  # how the page is compressed (`codec.compress.Encoded`), None: plain
    shared: bool = False  # the page is in the node's shared copy (written to a private one on change)
    # While paged out, each tensor's own class (see [Note: paged-out tensors]
    # in base/guards.py), and views handed out by served accesses: (weakref, class).
    classes: list = field(default_factory=list)
    aliases: list = field(default_factory=list)
    exposed: bool = True  # tensors have their own class (resident, compute waited on the fetch)
    open: bool = False  # guarded, but the threads pinning its block pass unserved (shared mode)
    storage_key: int = 0  # the flat storage's address (_paged registry)
    storage: object = None  # the flat storage (held: see base.guards.register)
    base_refs: int = 0  # references to it from pager's own objects
    expected_refs: dict = field(default_factory=dict)  # kind of use -> views autograd keeps (_paged Note)
    saved: list = field(default_factory=list)  # weakrefs: autograd's saved views, counted (_paged Note)
    # grads segments only: the parameters, their names, zeroing/scaling
    # recorded while paged out (slot index -> [(op, factor)], replayed on
    # return), and per-slot norms computed as the gradients left.
    params: list = field(default_factory=list)
    names: list = field(default_factory=list)
    pending: dict = field(default_factory=dict)
    summaries: dict = field(default_factory=dict)  # slot -> (2-norm, inf-norm)
    summary_event: object = None  # on the d2h stream: the summaries are computed
    keys: list = field(default_factory=list)  # state segments only: (parameter, state key) of each tensor
    dropped: bool = False  # left empty, its gradients set to None (training/grad_pages.py)
    # Under a disk tier ([Note: the disk tier] in engine/disk.py): the tier caching
    # its page, where its bytes are on disk (`Piece`s; None: nowhere yet),
    # whether the host page is newer than the disk's, and the last copy that
    # reads or writes the host page (CUDA event).
    cache: PageCache | None = None
    disk: list | None = None
    host_dirty: bool = False
    host_event: object = None

    @property
    def resident(self) -> bool:
        """Device memory holds (or is receiving) its bytes."""
        return self.state is PageState.FETCHING or self.state is PageState.RESIDENT

    @property
    def page_bytes(self) -> int:
        """Bytes of its page, as stored (what a fetch moves)."""
        return self.encoded.page_bytes if self.encoded is not None else self.nbytes

    def host_views(self) -> list[torch.Tensor]:
        """Its tensors' values in the host page (of a compressed page: decoded
        copies). Under a disk tier, a page not in host memory is read into a
        buffer of its own (the cache is left as it is): the views are for
        reading; see `engine.disk.DiskTier.page_in` to change a page in place."""
        page = self.cache.readable(self) if self.cache is not None else cast(torch.Tensor, self.host)
        if self.encoded is not None:
            from ..codec.kernels import decoded_copy_from

            plain = decoded_copy_from(page, self.encoded, self.flat.device)
            return [s.view_of(plain) for s in self.slots]
        return [s.view_of(page) for s in self.slots]

    def current_views(self) -> list[torch.Tensor]:
        """Where the current values are: the device views when resident, else
        the host page (callers let write-backs in flight land first)."""
        return self.tensors if self.resident else self.host_views()

    def snapshot_versions(self) -> None:
        # (a quantized weight's own kernels change its inner tensors below
        # autograd, where version counters do not move: its own counter does)
        with torch._C.DisableTorchFunctionSubclass():
            self.versions = [t._version for t in chain(self.tensors, self.wrappers)]
        self.force_dirty = False

    def is_dirty(self) -> bool:
        with torch._C.DisableTorchFunctionSubclass():
            return self.force_dirty or any(
                t._version != v for t, v in zip(chain(self.tensors, self.wrappers), self.versions)
            )


class Block:
    """A paging unit: a module (or the remainder of the model) and its segments.

    Args:
        name: the module's qualified name ("" for the root), used in stats and errors.
        module: the module whose hooks bring this block in (None for the remainder).
        index: position in the pager's block list.
        owner: the pager whose model it belongs to (see `Owner` in engine/owner.py).
    """

    def __init__(self, name: str, module: torch.nn.Module | None, index: int, owner=None):
        self.name = name or "<root>"
        self.module = module
        self.index = index
        self.owner = owner
        self.segments: dict[str, Segment] = {}
        self.weight_segments: tuple = ()  # its pages of parameters and buffers: weights (and frozen)
        self.fetch_event = None  # the fetch compute has still to wait on (FETCHING)
        self.pins = 0
        self.thread_pins: dict = {}  # thread id -> pins it holds (see Engine.unpin)
        self.unaccounted_use = None  # a use that left views pager could not look for (Uses.keeps_unknown_views)
        self.deps: list[Block] = []  # blocks owning tensors this block also uses (tied weights)
        self.parent: Block | None = None  # the nearest block whose module holds this one's
        self.resident_for_life = False
        self.last_use_tick = 0
        self.fetched_data = False  # the last fetch moved bytes (a miss if on demand)
        self.settled = False  # acquired since its last fetch (see Uses.can_use_resident)
        self.params: list = []  # its parameters (in its weight segments), and their names
        self.param_names: list = []
        self.trainable = False  # any of its parameters requires grad
        self.quantized = False  # it has quantized (wrapper-subclass) weights ([Note: wrapper-subclass weights])
        self.stats: Any = None  # its `observe.stats.BlockStats` (made by model/build.py)
        self.unpinned_calls = 0  # forward calls whose acquire failed
        self.compute_start = None  # when its current use began (trace)
        self.uses = 0  # uses since wrap (not reset by Pager.reset)
        self.last_use_event = None  # compute event at its last release
        self.comm_event = None  # its gradients' all-reduce in flight (training.distributed.Reducer)
        self.release_versions = None  # its tensors' versions then
        self.guards: list = []  # a `model.direct_calls.InnerGuard` per inner module, for direct calls
        self.guarded = False  # its guards are on (while it is paged out)
        self.hook_handles: list = []  # its forward pre-/post-hook (removed while asleep)
        self.under_compile = (
            False  # its last forward ran in a torch.compile'd graph ([Note: pager under torch.compile])
        )
        self.deferred_steps: list = []  # optimizer updates applied at its next use (training.optim.Deferred)
        self.host_update = None  # its optimizer update running on the host (a Future; training/host_step.py)
        self.owner_update = (
            None  # the count of its owner's updates its pages must hold before a read (training/owners.py)
        )
        self.part = False  # a part of a large block, split off (model.discover.split_large)
        self.parts_merged = False  # its parts are to be fetched with it (Pager._merge_parts)...
        self.merged_deps = False  # ...and are among its deps

    # -- sizes -------------------------------------------------------------
    @property
    def residency(self) -> PageState:
        """Its weights' state (other segments follow them in and out)."""
        return self.segments["weights"].state if "weights" in self.segments else PageState.HOST

    @property
    def weights(self) -> Segment:
        return self.segments["weights"]

    def device_bytes(self) -> int:
        return sum(seg.nbytes for seg in self.segments.values() if seg.resident)

    def nbytes(self, kinds=None) -> int:
        return sum(s.nbytes for k, s in self.segments.items() if kinds is None or k in kinds)

    def missing_bytes(self, kinds) -> int:
        return sum(s.nbytes for k, s in self.segments.items() if k in kinds and not s.resident)

    def versions(self) -> tuple:
        """How many resident tensors it has and the sum of their version
        counters: equal at two times only if none of them changed between
        (counters only grow), and no list made (asked at every release)."""
        count = total = 0
        with torch._C.DisableTorchFunctionSubclass():
            for seg in self.segments.values():
                if seg.resident:
                    for t in seg.tensors:
                        total += t._version
                    for t in seg.wrappers:  # (see Segment.snapshot_versions)
                        total += t._version
                    count += len(seg.tensors)
        return count, total

    def mark_dirty(self, kinds=None) -> None:
        for k, seg in self.segments.items():
            if seg.resident and (kinds is None or k in kinds):
                seg.force_dirty = True

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {self.residency.value}, pins={self.pins})"
