"""Building a wrapped model's blocks: their weights pages, the links between
them (tied tensors, enclosing blocks), the blocks resident for life, and
the row tables. Runs once, at `wrap` or `load`."""

from __future__ import annotations

import logging

from ..base import guards, wrappers
from ..base.block import Block, layout
from ..base.budget import format_bytes
from ..base.common import WEIGHTS
from ..experts.ahead import router_of
from ..experts.cache import ExpertCache, caches_of
from ..experts.find import expert_bytes, layout_of, routed_of
from ..experts.table import ExpertTable
from ..observe.stats import BlockStats
from ..rows.reader import RowStream
from ..rows.table import RowTable

log = logging.getLogger("pager")


def build_blocks(pager, owned: dict, uses: dict, parts=frozenset()) -> None:
    """Make `pager`'s blocks and their weights pages, link them, and install its hooks.

    Args:
        pager: the model's `Pager`, with no blocks yet.
        owned: block index (None: the remainder) -> [(name, tensor, is_param)] it owns.
        uses: block index -> the indices of the blocks whose tensors it uses (tied weights).
        parts: ids of modules that are parts of a block split for its size.
    """
    order = [owned.get(i, []) for i in range(len(pager.named_blocks))] + [owned.get(None, [])]
    if pager.sources is None:  # (pages from files live in their disk tier's memory)
        pages = [page for named in order for _kind, page in _pages(named)]
        sizes = [layout(wrappers.expand([(n, t) for n, t, _p in page]))[1] for page in pages]
        pager.engine.host.reserve(pager, sizes)
    if pager.share_host is not None:
        pager.share_host(pager)  # the weights pages: one copy for the ranks of this node
    for i, (name, module) in enumerate(pager.named_blocks):
        pager.blocks.append(Block(name, module, i, owner=pager))
        pager.blocks[-1].part = id(module) in parts  # see [Note: splitting large blocks] in model/discover.py
    for i, block in enumerate(pager.blocks):
        _build_weights(pager, block, owned.get(i, []))
    _link_parents(pager)
    if owned.get(None):
        pager.remainder = Block("<remainder>", None, len(pager.blocks), owner=pager)
        _build_weights(pager, pager.remainder, owned[None])
    for i, deps in uses.items():
        user = pager.blocks[i] if i is not None else pager.remainder
        for j in deps:
            owner = pager.blocks[j] if j is not None else pager.remainder
            if user is pager.remainder:
                owner.resident_for_life = True
            elif owner is not pager.remainder:
                user.deps.append(owner)
    for block in pager.all_blocks():
        if block.resident_for_life or block is pager.remainder:
            block.resident_for_life = True
            pager.uses.acquire(block, WEIGHTS, record=False)
    pager.hooks.install()


def add_row_tables(pager, tables: list, cache_bytes: int) -> None:
    """Page each (name, module) of `tables` by rows, their caches sharing
    `cache_bytes` in proportion to their sizes."""
    if pager.row_stream is None and pager.transport.is_cuda:
        pager.row_stream = RowStream(pager.transport)
    total = sum(m.weight.numel() * m.weight.element_size() for _n, m in tables)
    for name, module in tables:
        share = cache_bytes * module.weight.numel() * module.weight.element_size() // max(1, total)
        table = RowTable(pager, name, module, share)
        pager.row_params[id(table.param)] = table
    pager.row_bytes = cache_bytes


def add_expert_tables(pager, modules: list, cache_bytes: int, cold_experts: str = "auto") -> None:
    """Page each (name, experts module) of `modules` by expert
    ([Note: experts paged one by one] in experts/table.py): the modules of one
    layout share a device cache, the caches sharing `cache_bytes` in
    proportion to their experts' bytes; `cold_experts`: where a call's
    experts a cache lacks run ([Note: cold experts on the host] in experts/host.py)."""
    groups: dict = {}
    for name, module in modules:
        groups.setdefault(layout_of(module), []).append((name, module))
    total = sum(expert_bytes(m) * m.num_experts for _n, m in modules)
    for shapes, members in groups.items():
        share = cache_bytes * sum(expert_bytes(m) * m.num_experts for _n, m in members) // max(1, total)
        per_expert = expert_bytes(members[0][1])
        capacity = min(share // per_expert, sum(m.num_experts for _n, m in members))
        least = max(routed_of(m) for _n, m in members)
        cache = ExpertCache(shapes, capacity, pager.device, least=least, cold_experts=cold_experts)
        if capacity < max(m.num_experts for _n, m in members):
            log.warning(
                "pager: the experts' cache holds %d experts, fewer than the %d of a layer: a call routed to more "
                "of them (a prefill) runs by groups of tokens where the kernels read the cache in place "
                "(batched_mm), each group's experts copied in, or copies those beyond it from the host (slower "
                "than a cache that holds a layer; the same values). A budget with room for %s more avoids it.",
                capacity,
                max(m.num_experts for _n, m in members),
                format_bytes((max(m.num_experts for _n, m in members) - capacity) * per_expert),
            )
        base = 0
        for name, module in members:
            parent = pager.model.get_submodule(name.rpartition(".")[0]) if "." in name else pager.model
            router = router_of(parent, module, module.num_experts)
            pager.expert_tables.append(ExpertTable(pager, name, module, cache, base, router))
            base += module.num_experts
    by_model_order = sorted(pager.expert_tables, key=lambda t: [n for n, _m in modules].index(t.name))
    for table, nxt in zip(by_model_order, by_model_order[1:]):
        table.next = nxt if nxt.cache is table.cache else None  # ([Note: experts fetched ahead]: one cache's lock)
    pager.row_bytes += sum(c.device_bytes() for c in caches_of(pager.expert_tables))


def _pages(named: list) -> list:
    """[(kind, its (name, tensor, is_param) entries)]: the weight pages of a
    block owning `named`; the frozen parameters on a page of their own where
    some parameters require grad and some do not ([Note: frozen pages] in base/block.py)."""
    frozen = [e for e in named if e[2] and not e[1].requires_grad]
    if not frozen or not any(is_param and t.requires_grad for _n, t, is_param in named):
        return [("weights", named)] if named else []
    rest = [e for e in named if not (e[2] and not e[1].requires_grad)]
    return [("weights", rest), ("frozen", frozen)]


def _build_weights(pager, block: Block, named: list) -> None:
    for _n, t in [(n, t) for n, t, _p in named] + wrappers.expand([(n, t) for n, t, _p in named]):
        pager.original_device[id(t)] = t.device  # (a quantized weight's inner tensors too)
    pages = _pages(named) or [("weights", [])]
    for kind, page in pages:
        # The remainder is fetched once; a page of trainable parameters beside a
        # frozen one stays plain (it changes every step).
        plain = block.module is None or (kind == "weights" and len(pages) > 1)
        pieces = [pager.sources[id(t)] for _n, t, _p in page] if pager.sources is not None else None
        tensors = [(n, t) for n, t, _p in page]
        wrapped = [(n, t) for n, t in tensors if wrappers.is_wrapper(t)]  # ([Note: wrapper-subclass weights])
        inner = wrappers.expand(wrapped)
        seg = pager.engine.add_segment(
            block,
            kind,
            wrappers.expand(tensors),
            values=pieces is None,
            pieces=pieces,
            codec=None if plain else pager.compress,
            keep_plain=frozenset(n for n, _t in inner),
        )
        seg.wrappers = [t for _n, t in wrapped]
        seg.inner_ids = frozenset(id(t) for _n, t in inner)
        with guards.unguarded():
            for t in seg.wrappers:  # onto the device storage's device, around their inner views
                wrappers.follow_inner(t)
        # (as each page is made: a wrap that fails at the next one undoes this one: api/wrap.py `_undo`)
        block.weight_segments = tuple(block.segments[k] for k, _page in pages if k in block.segments)
        guards.register(pager, block, seg)
        guards.guard(seg)
    block.weight_segments = tuple(block.segments[kind] for kind, _page in pages)
    block.params = [t for _n, t, is_param in named if is_param]
    block.param_names = [n for n, _t, is_param in named if is_param]
    block.trainable = any(p.requires_grad for p in block.params)
    block.quantized = any(seg.wrappers for seg in block.weight_segments)
    block.stats = BlockStats(block.name, block.nbytes())
    for p in block.params:
        pager.param_blocks[id(p)] = block


def _link_parents(pager) -> None:
    """Each block's nearest enclosing block (NAS candidates: their layer)."""
    by_module = {id(b.module): b for b in pager.blocks}
    stack = [(pager.model, None)]
    while stack:
        module, enclosing = stack.pop()
        block = by_module.get(id(module))
        if block is not None:
            block.parent, enclosing = enclosing, block
        stack += [(child, enclosing) for child in module.children()]
