"""Which modules are blocks, and which block owns each tensor.

Default discovery, in the spirit of accelerate's `no_split_module_classes`
but with nothing to name:

* the elements of the model's layer containers (`nn.ModuleList` /
  `nn.Sequential`) are blocks: a transformer's layers, a CNN's stages (nested
  containers are flattened: ResNet's `layer1..4` give their residual blocks);
* inside such a block, a `ModuleList`/`ModuleDict` of two or more children that
  holds most of the block's bytes is a list of alternatives (a NAS supernet's
  candidate ops, a mixture's experts): each alternative becomes a block of its
  own, nested in its layer, so only the ones that run are fetched;
* everything else (embeddings, heads, final norms) is the *remainder*: it
  stays resident on the device and counts against the budget. Under `wrap`'s
  defaults its large modules become blocks too ([Note: nothing resident by
  force] in api/fit.py), so what stays is small.

[Note: adapters stay on the device]
Fine-tuning adapters (LoRA through peft, or trained norms) on a frozen model
leaves a few small trainable parameters in blocks that are otherwise frozen.
Paged with their block, they, their gradients and their optimizer state
would cross the link at every step (written back whenever the block leaves,
the update deferred to the block's next use), for parameters a few hundredths
of the block's size. So where all of them, with their gradients and an
Adam-sized state (4x their bytes), take at most 1/ADAPTER_SHARE of the
budget, `adapters_resident` gives them to the remainder: they stay on the
device for life, their blocks are frozen and never written back, and the
optimizer steps them on the device. Larger ones stay with their blocks, on a
page of their own beside the frozen one ([Note: frozen pages] in base/block.py).

[Note: splitting large blocks]
When the model does not fit and two of the largest blocks take an eighth of
the room the budget leaves for blocks (every block that is not kept streams
through two such slots), `split_large` makes the large parts of each block
(submodules that own at least SPLIT_MIN_BYTES themselves: its projections)
nested blocks of their own, fetched when they are called, so the slots are
part-sized and more of the budget keeps blocks resident. This is safe even if
a block's forward reads a part's weights without calling it (a fused QKV
concatenation): that read is served like any access to an idle block's tensor
([Note: paged-out tensors] in base/guards.py), and the pager then fetches the
block's parts together with it from its next use on (`Pager._merge_parts`).
Over several links (`split_fetch`), blocks are split only when two of the
largest take half of the room (SPLIT_SHARE_LINKS): a split fetch moves a
page over n links at n times the rate but costs the host more per fetch
(each helper's copies and their exchange), so with parts the links wait for
the host. On 2x H200 (a 7B-shaped Llama, bf16, 256-token forward) the
decoder layers as blocks took 85.2 ms at 50% of its bytes and 116.6 ms at
25%, their projections as blocks 113.2 and 135.6 ms; over one link the
parts were faster (129.4 against 141.5 ms at 50%), hence one link keeps
SPLIT_SHARE. A model whose two layers do not fit half the room (a
70B-shaped layer) is still split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch.nn as nn

from ..base.wrappers import aligned_bytes, nbytes_of

_CONTAINERS = (nn.ModuleList, nn.Sequential)
_ALTERNATIVES = (nn.ModuleList, nn.ModuleDict)


def tensor_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += nbytes_of(t)
    return total


def discover(model: nn.Module, spec=None) -> list[tuple[str, nn.Module]]:
    """Return the (qualified name, module) pairs that are blocks, in model order.

    Args:
        model: the model to page.
        spec: None (default discovery), a list of modules, a list of class
            names, or a predicate `(name, module) -> bool`.
    """
    names = {id(m): n for n, m in model.named_modules()}
    if spec is None:
        found = _default(model)
    elif callable(spec):
        found = [m for n, m in model.named_modules() if n and spec(n, m)]
    elif isinstance(spec, Iterable) and not isinstance(spec, (str, nn.Module)):
        items = list(spec)
        if all(isinstance(x, str) for x in items):
            wanted = set(items)
            found = [m for n, m in model.named_modules() if n and type(m).__name__ in wanted]
            unknown = wanted - {type(m).__name__ for m in model.modules()}
            if unknown:
                example = type(found[0]).__name__ if found else "DecoderLayer"
                raise ValueError(
                    f"pager: blocks= names classes {sorted(unknown)} that no submodule of the model "
                    f"has; give class names that appear in the model (e.g. {example!r})."
                )
        elif all(isinstance(x, nn.Module) for x in items):
            found = items
            for m in found:
                if id(m) not in names:
                    raise ValueError(
                        f"pager: blocks= holds a {type(m).__name__} that is not a submodule of the model; "
                        f"pass modules taken from the model itself (e.g. list(model.layers))."
                    )
                if m is model:
                    raise ValueError(
                        "pager: blocks= holds the model itself; a block must be a submodule "
                        "(the model's own tensors form the remainder)."
                    )
        else:
            raise ValueError(
                "pager: blocks= must be a list of modules, a list of class names, or a predicate "
                f"(name, module) -> bool; got a list of {sorted({type(x).__name__ for x in items})}."
            )
    else:
        raise ValueError(
            f"pager: blocks={spec!r} is not understood; pass a list of modules, a list of class "
            f"names, or a predicate (name, module) -> bool."
        )
    if spec is not None and not found:
        raise ValueError(
            "pager: blocks= matched no module of the model; check the predicate or class names "
            "(print([n for n, _ in model.named_modules()]) lists the candidates)."
        )
    seen: set[int] = set()
    for m in found:
        if id(m) in seen:
            raise ValueError(f"pager: blocks= names {names[id(m)]!r} twice; name each block once.")
        seen.add(id(m))
    blocks = [(names[id(m)], m) for m in found if tensor_bytes(m) > 0]
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(blocks, key=lambda nm: order[id(nm[1])])


def _default(model: nn.Module) -> list[nn.Module]:
    blocks: list[nn.Module] = []

    def visit(m: nn.Module, in_container: bool) -> None:
        # A container is a stack of blocks; a container inside a stack is a
        # stage to flatten (ResNet's layer1..4) when its elements are composite,
        # and a block itself (Sequential(conv, bn, relu)) when they are leaves.
        composite = any(next(c.children(), None) is not None for c in m.children())
        if isinstance(m, _CONTAINERS) and len(m) >= 2 and (not in_container or composite):
            for child in m.children():
                visit(child, True)
        elif in_container:
            blocks.append(m)
            blocks.extend(_alternatives(m))
        else:
            for child in m.children():
                visit(child, False)

    visit(model, False)
    return blocks


def _alternatives(block: nn.Module) -> list[nn.Module]:
    """Children of a list of alternatives that holds most of `block`'s bytes."""
    total = tensor_bytes(block)
    for m in block.modules():
        if m is not block and isinstance(m, _ALTERNATIVES) and len(m) >= 2:
            if 2 * tensor_bytes(m) > total:
                return [c for c in m.children() if tensor_bytes(c) > 0]
    return []


def owners(model: nn.Module, block_modules: list[nn.Module], exclude: frozenset = frozenset()):
    """Map each tensor to the innermost block holding it.

    Returns `(owned, uses)`: `owned[i]` lists `(qualified name, tensor, is_param)`
    owned by block i (None for the remainder); `uses[i]` is the set of other
    block indices (or None) whose tensors block i's modules also hold (tied
    weights), so block i depends on them. Tensors whose id is in `exclude`
    (row tables' weights) belong to no block.
    """
    index = {id(m): i for i, m in enumerate(block_modules)}
    owned: dict = {}
    owner_of: dict[int, object] = {}
    uses: dict = {}

    def walk(m: nn.Module, prefix: str, current) -> None:
        current = index.get(id(m), current)
        for kind, table in (("param", m._parameters), ("buffer", m._buffers)):
            for name, t in table.items():
                if t is None or id(t) in exclude:
                    continue
                qual = f"{prefix}{name}"
                if id(t) in owner_of:
                    first = owner_of[id(t)]
                    if first != current:
                        uses.setdefault(current, set()).add(first)
                    continue
                owner_of[id(t)] = current
                owned.setdefault(current, []).append((qual, t, kind == "param"))
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.", current)

    walk(model, "", None)
    return owned, uses


@dataclass
class Sizing:
    """The blocks of a model and what each needs on the device, from sizes alone."""

    named: list  # (qualified name, module) of each block
    owned: dict  # block index (None: remainder) -> [(name, tensor, is_param)]
    uses: dict  # block index -> indices of blocks it borrows tied tensors from
    own: list  # page bytes each block owns
    beside: list  # per block, the blocks that must be on the device with it (deps, ancestors)
    remainder: int  # page bytes outside every block (stays resident)
    tables: tuple = ()  # row-paged modules, outside every block ([Note: row tables] in rows/table.py)

    @property
    def sizes(self) -> list:
        """Bytes on the device to run each block (with its deps and ancestors)."""
        return [self.own[i] + sum(self.own[j] for j in with_) for i, with_ in enumerate(self.beside)]

    @property
    def min_budget(self) -> int:
        """The least budget that runs."""
        return self.least_room(self.own, self.remainder)

    @property
    def fixed(self) -> int:
        """What stays on the device for life: the remainder, and the blocks it
        borrows tied tensors from."""
        return self.remainder + sum(self.own[j] for j in self.held_blocks())

    def held_blocks(self) -> set:
        """The blocks the remainder borrows tied tensors from (with it for life)."""
        return {j for j in self.uses.get(None, ()) if j is not None}

    def least_room(self, per_block: list, fixed: int) -> int:
        """The least room that runs blocks of `per_block` bytes each (weights,
        or with gradients and state) beside `fixed` bytes of the remainder:
        those, the blocks the remainder borrows tied tensors from (they stay
        with it for life), and the largest other block with what it needs
        beside it."""
        held = self.held_blocks()
        fixed += sum(per_block[j] for j in held)
        return fixed + max(
            (per_block[i] + sum(per_block[j] for j in with_) for i, with_ in enumerate(self.beside) if i not in held),
            default=0,
        )

    @property
    def total(self) -> int:
        return self.remainder + sum(self.own)


SPLIT_MIN_BYTES = 1 << 20  # a part smaller than this stays with its block
SPLIT_SHARE = 8  # split when two of the largest blocks take 1/SPLIT_SHARE of the room for blocks
SPLIT_SHARE_LINKS = 2  # ... over several links (split fetch): 1/SPLIT_SHARE_LINKS of it


def split_large(
    model: nn.Module, sizing: Sizing, budget_bytes: int, min_part_bytes: int = SPLIT_MIN_BYTES, links: int = 1
) -> tuple[Sizing, set]:
    """`sizing` with the large parts (of `min_part_bytes` or more) of its
    blocks as nested blocks, when two of the largest blocks take
    1/SPLIT_SHARE of the room for blocks (1/SPLIT_SHARE_LINKS when fetches
    go over more than one link: see the Note); also the ids of those parts.
    Unchanged (and an empty set) otherwise. The blocks are sized again from
    the model, and small adapters stay with the remainder as
    `adapters_resident` has them."""
    named, own, remainder = sizing.named, sizing.own, sizing.remainder
    room = budget_bytes - remainder
    share = SPLIT_SHARE if links == 1 else SPLIT_SHARE_LINKS
    if not named or remainder + sum(own) <= budget_bytes or room <= 0 or share * 2 * max(own) < room:
        return sizing, set()
    modules = [m for _n, m in named]
    block_ids = {id(m) for m in modules}
    parts = []
    for block in modules:
        inner = [m for m in block.modules() if m is not block]
        if any(id(m) in block_ids for m in inner):
            continue  # holds blocks already (a layer of NAS candidates)
        large = [m for m in inner if _own_bytes(m) >= min_part_bytes and m not in sizing.tables]
        if len(large) >= 2:
            parts += large
    if not parts:
        return sizing, set()
    resized = adapters_resident(size_up(model, modules + parts, sizing.tables), budget_bytes)[0]
    return resized, {id(m) for m in parts}


def _own_bytes(m: nn.Module) -> int:
    return sum(nbytes_of(t) for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None)


ADAPTER_SHARE = 8  # adapters stay on the device where 4x their bytes take at most 1/8 of the budget


def adapters_resident(sizing: Sizing, budget_bytes: int) -> tuple[Sizing, int]:
    """`sizing` with the trainable parameters of otherwise frozen blocks
    given to the remainder, where they are small enough (see [Note: adapters
    stay on the device]), and their bytes; unchanged (and 0) otherwise."""
    moved = {}
    for i, named in sizing.owned.items():
        params = [e for e in named if e[2]]
        if i is not None and any(not t.requires_grad for _n, t, _p in params):
            moved[i] = [e for e in params if e[1].requires_grad]
    nbytes = sum(aligned_bytes(t) for entries in moved.values() for _n, t, _p in entries)
    if not nbytes or ADAPTER_SHARE * 4 * nbytes > budget_bytes:
        return sizing, 0
    owned = dict(sizing.owned)
    for i, entries in moved.items():
        ids = {id(t) for _n, t, _p in entries}
        owned[i] = [e for e in owned[i] if id(e[1]) not in ids]
    owned[None] = list(owned.get(None, [])) + [e for entries in moved.values() for e in entries]
    own = [sum(aligned_bytes(t) for _n, t, _p in owned.get(i, [])) for i in range(len(sizing.named))]
    return dataclasses.replace(sizing, owned=owned, own=own, remainder=sizing.remainder + nbytes), nbytes


def size_up(model: nn.Module, spec=None, tables=()) -> Sizing:
    """Discover the blocks of `model` and size them; nothing is changed.
    `tables` are modules paged by rows ([Note: row tables] in rows/table.py)
    or by expert ([Note: experts paged one by one] in experts/table.py):
    neither blocks nor their parameters in one."""
    skip = {id(m) for m in tables}
    named = [(n, m) for n, m in discover(model, spec) if id(m) not in skip]
    modules = [m for _n, m in named]
    owned, uses = owners(model, modules, frozenset(id(t) for m in tables for t in m._parameters.values()))
    own = [sum(aligned_bytes(t) for _n, t, _p in owned.get(i, [])) for i in range(len(named))]
    inside = [{id(m) for m in outer.modules()} for outer in modules]
    beside = []
    for i, m in enumerate(modules):
        ancestors = {j for j, ids in enumerate(inside) if j != i and id(m) in ids}
        beside.append(({j for j in uses.get(i, ()) if j is not None} | ancestors) - {i})
    remainder = sum(aligned_bytes(t) for _n, t, _p in owned.get(None, []))
    return Sizing(named, owned, uses, own, beside, remainder, tuple(tables))
