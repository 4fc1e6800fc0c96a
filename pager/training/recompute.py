"""Activations dropped and recomputed for the backward (`activations="recompute"`: pager's own checkpointing).

[Note: activations recomputed]
With `activations="recompute"` (pager's own checkpointing: the model's code
does not change), a block's training forward keeps only its inputs (detached,
with their version), the RNG states and the autocast state (`Recompute`; a
block inside a recomputed block keeps nothing: [Note: blocks inside a
recomputed block] in training/activations.py);
each activation it saves is dropped and the graph holds a `Dropped` instead
(index and metadata). The first `Dropped` of a block that its backward asks for
runs the block's forward again (the block is resident: its pre-backward hook
acquired it), in autograd's thread, with the forward's RNG states (dropout
draws the same masks) and autocast, under hooks that keep the i-th saved tensor
for the i-th `Dropped` still alive; pager's own forward hooks then only
acquire and release (`recomputing()`). The forward stops (an exception
from the hook, as torch's checkpoint stops early) once it has saved its last
tensor: what follows, often the block's last matmul, saved nothing. Not under
torch's CUDA sanitizer: its trace hooks run inside the op that raises, with
the exception already set, and fail (a SystemError out of the backward); the
forward then runs to its end, to the same values. Each value is handed out once (a
second backward through a retained graph runs the forward again). A saved
tensor of another shape or dtype than in the forward, or an input changed in
place since, is an error (the recomputation would differ). The block's own
weights are saved as they are: they page with the block.

[Note: buffers a forward changes]
BatchNorm's training forward updates its running statistics in place
(running_mean, running_var, num_batches_tracked), so running it again would
count the batch twice, and the model would no longer be the unwrapped one
(torch's own checkpoint has that flaw). `Recompute` notes the version of
each buffer of the block at the forward's start; at the recomputation, the
buffers whose version moved since (the forward changed them:
num_batches_tracked), and the running statistics of the norm layers in it
(their kernel updates them without moving the version), are copied aside
and put back after it. The recomputation's outputs do not depend on them (a
training BatchNorm normalizes by the batch's statistics).

[Note: caches a forward writes]
A transformers model called with `use_cache` (its default, in training too)
gives each decoder layer a KV cache object that the layer appends its keys
and values to. Running the layer again would append them twice: its
attention would read keys of twice the length (a saved tensor of another
shape: an error under eager attention), and the cache would no longer be
the unwrapped model's. So `Recompute` notes, for each input that is such a
cache (`_cache_layers`: a `layers` list, `update` and `get_seq_length`), the
attributes of each of its layers at the forward's start (a shallow copy:
the layers reassign their tensors, they do not write into them); the
recomputation puts those back on the layers the forward changed, runs, and
then gives those layers what the forward had left them. A layer that writes
into its tensors (a static cache: `StaticCache`) is not put back so; such a
cache in a training forward is not supported (the first pass's measure on
fake tensors fails on it already).
"""

from __future__ import annotations

import sys
import threading
import weakref
from contextlib import ExitStack, contextmanager

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..base.common import outside_compile
from ..base.registry import entry_of, unguarded
from ..base.saving import tls
from .ledger import tensor_bytes


class Dropped:
    """A dropped activation, as the graph holds it ([Note: activations recomputed])."""

    __slots__ = ("recompute", "index", "shape", "dtype", "__weakref__")

    def __init__(self, recompute, index, shape, dtype):
        self.recompute, self.index, self.shape, self.dtype = recompute, index, shape, dtype

    def unpack(self):
        return self.recompute.value(self)


def recomputing() -> bool:
    """True in a thread that runs a block's forward again for its backward."""
    return getattr(tls, "recording", None) is not None


class Recompute:
    """One training forward of a block, to run again in its backward for the
    activations it dropped ([Note: activations recomputed]).

    Args:
        block: the block (its `module` is called again; `name` in errors).
        args, kwargs: what its forward was called with.
        stats: the pager's `Stats` (recomputes, activations_recomputed_bytes).
        ledger: the `Ledger` (the inputs kept, values recomputed and not yet handed out).
    """

    def __init__(self, block, args, kwargs, stats, ledger):
        self.block, self.stats, self.ledger = block, stats, ledger
        # (for __del__, should what follows raise)
        self.held: list = []
        self.values: dict = {}  # index -> recomputed tensor, until handed out
        self.keys: dict = {}  # index -> its key in the ledger (`Ledger.hold`)
        flat, self.spec = tree_flatten((args, kwargs))
        with unguarded():
            self.inputs = [_Input(t) if isinstance(t, torch.Tensor) else t for t in flat]
            self.held = [
                ledger.hold(x.tensor)
                for x in self.inputs
                if isinstance(x, _Input) and entry_of(x.tensor) is None and x.tensor.device == ledger.device
            ]
        self.devices = sorted({t.device.index or 0 for t in flat if isinstance(t, torch.Tensor) and t.is_cuda})
        self.rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices])
        self.autocast = [
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")
            if kind == "cpu" or self.devices
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.holders: list = []  # weakref to each Dropped, in the order the forward saved them
        self.dropped_bytes = 0  # what they held
        self.first_save = getattr(tls, "saves", 0)  # this thread's saves before the forward's first
        self.index_of: dict = {}  # the forward's n-th save -> the index of the Dropped it made
        self.lock = threading.Lock()  # unpack runs on autograd's threads
        with unguarded():  # ([Note: buffers a forward changes])
            self.buffers = [(b, b._version) for b in block.module.buffers()] if block.module is not None else []
        # ([Note: caches a forward writes])
        self.cache_layers = [(layer, dict(vars(layer))) for t in flat for layer in _cache_layers(t)]

    def drop(self, t, number: int) -> Dropped:
        """Drop `t`, the thread's `number`-th save."""
        dropped = Dropped(self, len(self.holders), t.shape, t.dtype)
        self.index_of[number - self.first_save] = dropped.index
        self.holders.append(weakref.ref(dropped))
        nbytes = tensor_bytes(t)  # (what `keep` will count)
        self.dropped_bytes += nbytes
        self.ledger.dropped[self.block] = self.ledger.dropped.get(self.block, 0) + nbytes
        return dropped

    def value(self, dropped: Dropped) -> torch.Tensor:
        with self.lock:
            if dropped.index not in self.values:
                self._run()
            t = self.values.pop(dropped.index)
            key = self.keys.pop(dropped.index)
        self.ledger.let_go(key)  # autograd holds it now
        return t

    def __del__(self):  # the graph let go of every `Dropped`: the inputs and unused values go
        for key in self.held:
            self.ledger.let_go(key)
        for key in self.keys.values():
            self.ledger.let_go(key)

    def _run(self) -> None:
        """Run the block's forward again, keeping what it saves for the
        `Dropped` still alive (and not yet handed out)."""
        args, kwargs = tree_unflatten(
            [x.get(self.block) if isinstance(x, _Input) else x for x in self.inputs], self.spec
        )
        rng_now = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices])
        _set_rng(self.rng, self.devices)
        stats = self._stats() if self.buffers else set()
        changed = [(b, b.clone()) for b, version in self.buffers if b._version != version or id(b) in stats]
        written = _put_back(self.cache_layers)
        tls.recording = (self, [0])
        torch._C._autograd._push_saved_tensors_default_hooks(*_AGAIN_HOOKS)
        try:
            with torch.enable_grad(), _autocast(self.autocast, self.autocast_cache):
                self.block.module(*args, **kwargs)
        except _AllSaved:
            pass
        finally:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            tls.recording = None
            _set_rng(rng_now, self.devices)
            with torch.no_grad():
                for buffer, before in changed:
                    # (the forward changed it once already; through .data: the recomputed graph may
                    # have saved it, at the version it has)
                    buffer.data.copy_(before)
            _put_back(written)
            self.ledger.recomputed(self.dropped_bytes)
        missing = [i for i, ref in enumerate(self.holders) if ref() is not None and i not in self.values]
        if missing:
            raise RuntimeError(
                f"pager: block {self.block.name!r} saved {len(self.holders)} tensors for its backward in its "
                f'forward but fewer when run again (activations="recompute"): its forward must save the same '
                "tensors each time it runs (no control flow on values or on global state that changes); use "
                'activations="offload" or "keep" for this model.'
            )
        self.stats.recomputes += 1

    def _stats(self) -> set:
        """ids of the block's running statistics (BatchNorm's, InstanceNorm's):
        their kernel updates them without moving their version."""
        return {
            id(b)
            for m in self.block.module.modules()
            if isinstance(m, torch.nn.modules.batchnorm._NormBase)
            for b in (m.running_mean, m.running_var)
            if b is not None
        }

    def keep(self, i: int, t) -> None:
        """The recomputation saved `t` as its `i`-th tensor."""
        ref = self.holders[i]() if i < len(self.holders) else None
        if ref is None or i in self.values:
            return
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise RuntimeError(
                f"pager: block {self.block.name!r} saved a tensor of shape {list(ref.shape)} and {ref.dtype} as its "
                f"#{i} for its backward in its forward, but {list(t.shape)} and {t.dtype} when run again "
                '(activations="recompute"): its forward must save the same tensors each time it runs; use '
                'activations="offload" or "keep" for this model.'
            )
        self.values[i] = t
        self.keys[i] = self.ledger.hold(t)  # (by storage: a tensor saved twice, or the input kept, counts once)
        self.stats.activations_recomputed_bytes += tensor_bytes(t)


class _Input:
    """An input of a recomputed forward: a detached alias and its version
    (a block's own weights and other paged tensors: the tensor itself)."""

    __slots__ = ("tensor", "version", "requires_grad")

    def __init__(self, t):
        self.tensor = t if entry_of(t) is not None else t.detach()
        self.version, self.requires_grad = t._version, t.requires_grad

    def get(self, block) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"pager: an input of block {block.name!r} of shape {list(self.tensor.shape)} was changed in place "
                'after its forward, and the block\'s activations are recomputed from it (activations="recompute"): '
                'change a copy (`.clone()`) instead, or use activations="offload" or "keep".'
            )
        if entry_of(self.tensor) is not None:
            return self.tensor
        return self.tensor.detach().requires_grad_(self.requires_grad)


def _cache_layers(x) -> list:
    """The layers of `x` if it is a transformers KV cache (`Cache`: a
    `layers` list, `update`, `get_seq_length`), else none."""
    layers = getattr(x, "layers", None) if hasattr(x, "get_seq_length") and hasattr(x, "update") else None
    return [layer for layer in layers if hasattr(layer, "__dict__")] if isinstance(layers, list) else []


def _put_back(noted: list) -> list:
    """Give each layer of `noted` ((layer, its attributes)) those attributes
    where it has others now; return what those layers had."""
    out = []
    for layer, attributes in noted:
        now = vars(layer)
        if now.keys() != attributes.keys() or any(now[k] is not v for k, v in attributes.items()):
            out.append((layer, dict(now)))
            now.clear()
            now.update(attributes)
    return out


def _pack_again(t):
    # [Note: saves counted across nested blocks]
    # A block's forward may run blocks inside it (a layer's parts): what
    # those save is dropped for the outer block's recomputation too ([Note:
    # blocks inside a recomputed block] in training/activations.py), or kept
    # where an inner block keeps its own. Running the outer forward again
    # runs the inner ones too, under these hooks alone, so its saves are
    # matched by number: the n-th save since the forward began, whoever's
    # frame took it, both times.
    recompute, counter = tls.recording
    n = counter[0]
    counter[0] += 1
    with unguarded():
        t = t.detach()
    index = recompute.index_of.get(n)
    if index is None:
        entry = entry_of(t)
        if entry is not None:  # (a block's weight, saved as it is) counted, as in the forward
            entry[2].saved.append(weakref.ref(t))  # ([Note: autograd's saved views, counted] in base/saving.py)
        return t
    recompute.keep(index, t)
    if index == len(recompute.holders) - 1 and not _cuda_trace_hooks_on():
        raise _AllSaved  # the rest of the forward saves nothing the backward needs
    return t


def _cuda_trace_hooks_on() -> bool:
    """Whether torch's CUDA sanitizer watches (see [Note: activations recomputed])."""
    sanitizer = sys.modules.get("torch.cuda._sanitizer")
    return sanitizer is not None and getattr(getattr(sanitizer, "cuda_sanitizer", None), "enabled", False)


class _AllSaved(Exception):
    """Ends a recomputation once it has saved all that the forward saved."""


def _unpack_again(t):
    return t


_AGAIN_HOOKS = (outside_compile(_pack_again), outside_compile(_unpack_again))  # (see saving._HOOKS)


def _set_rng(states, devices) -> None:
    torch.set_rng_state(states[0])
    for d, state in zip(devices, states[1]):
        torch.cuda.set_rng_state(state, d)


@contextmanager
def _autocast(states, cache: bool):
    """The forward's autocast state (autograd's thread has its own)."""
    with ExitStack() as stack:
        for kind, enabled, dtype in states:
            stack.enter_context(torch.amp.autocast(kind, enabled=enabled, dtype=dtype, cache_enabled=cache))
        yield
