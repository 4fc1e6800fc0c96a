"""The residency engine on its own terms: explicit page states, idempotent
transitions, models sharing one engine (one budget), and the package's layers."""

import ast
import copy
import pathlib

import pytest
import torch
import torch.nn.functional as F

import pager
from pager.base.block import PageState
from helpers import assert_models_equal, assert_same, tensor_page_bytes
from models import TinyLM


def stack(n=6, width=32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(n)])


def states(block):
    return {kind: seg.state for kind, seg in block.segments.items()}


def test_a_block_walks_host_fetching_resident_host_and_each_step_is_idempotent():
    model = stack()
    layer = tensor_page_bytes(model[0])
    pager.wrap(model, budget=3 * layer, device="cpu", prefetch=0)
    p = pager.of(model)
    engine, block = p.engine, p.blocks[2]
    assert states(block) == {"weights": PageState.HOST}
    with p.lock:
        engine.fetch(block, ("weights",))
        assert states(block) == {"weights": PageState.FETCHING} and engine.resident_bytes == layer
        engine.fetch(block, ("weights",))  # already there: nothing moves
        assert engine.resident_bytes == layer and p.stats().h2d_bytes == layer
        engine.wait(block)
        engine.wait(block)
        assert states(block) == {"weights": PageState.RESIDENT}
        assert engine.evict(block)
        assert states(block) == {"weights": PageState.HOST} and engine.resident_bytes == 0
        assert p.stats().d2h_bytes == 0  # clean: left for free
    model(torch.randn(2, 32))  # and it still runs, bit for bit below
    assert_same(model(torch.ones(2, 32)), pager.unwrap(model)(torch.ones(2, 32)))


def test_a_dirty_page_is_written_back_as_it_leaves():
    model = stack()
    pager.wrap(model, budget=3 * tensor_page_bytes(model[0]), device="cpu", prefetch=0)
    p = pager.of(model)
    block = p.blocks[0]
    with torch.no_grad():
        model[0][0].weight.add_(1.0)  # served: fetched, changed, version moved
    with p.lock:
        if block.weights.resident:
            assert p.engine.evict(block)
    assert block.weights.state is PageState.HOST and p.stats().d2h_bytes == block.weights.nbytes


def test_two_models_share_one_budget_bit_for_bit():
    a, b = stack(seed=1), stack(seed=2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    budget = 4 * tensor_page_bytes(a[0])
    pager.wrap(a, budget=budget, device="cpu")
    pager.wrap(b, budget=pager.of(a).engine)
    engine = pager.of(a).engine
    assert pager.of(b).engine is engine and engine.owners == [pager.of(a), pager.of(b)]
    peaks = []
    for m in list(a) + list(b):
        m.register_forward_hook(lambda *_: peaks.append(engine.resident_bytes))
    x = torch.randn(3, 32)
    with torch.no_grad():
        for _ in range(3):
            assert_same(a(x), ref_a(x))
            assert_same(b(x), ref_b(x))
    assert max(peaks) <= budget
    assert pager.of(a).stats().evictions > 0 and pager.of(b).stats().evictions > 0
    assert engine.resident_bytes == pager.of(a).resident_bytes + pager.of(b).resident_bytes


def test_two_models_sharing_an_engine_train_bit_for_bit():
    torch.manual_seed(0)
    a, b = TinyLM(), TinyLM()
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    # (a layer's update holds its new AdamW state and a copy of its weights beside its pages: 7, not 6)
    budget = 7 * max(tensor_page_bytes(layer) for layer in a.layers) + 3 * (
        tensor_page_bytes(a) - sum(tensor_page_bytes(layer) for layer in a.layers))
    pager.wrap(a, budget=budget, device="cpu")
    pager.wrap(b, budget=pager.of(a).engine)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b, ref_a, ref_b)]
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids, tgt = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
        for m, opt in zip((a, b, ref_a, ref_b), opts):
            F.cross_entropy(m(ids).flatten(0, 1), tgt.flatten()).backward()
            opt.step()
            opt.zero_grad()
    engine = pager.of(a).engine
    assert engine.resident_bytes <= budget
    assert pager.of(a).stats().evictions > 0 and pager.of(b).stats().evictions > 0
    assert_models_equal(a, ref_a)
    assert_models_equal(b, ref_b)


def test_unwrapping_one_model_frees_only_its_own():
    a, b = stack(seed=1), stack(seed=2)
    ref_b = copy.deepcopy(b)
    pager.wrap(a, budget=4 * tensor_page_bytes(a[0]), device="cpu")
    pager.wrap(b, budget=pager.of(a).engine)
    engine, pb = pager.of(a).engine, pager.of(b)
    x = torch.randn(3, 32)
    with torch.no_grad():
        a(x), b(x)
        pager.unwrap(a)
        assert engine.owners == [pb] and engine.total_bytes == pb.total_bytes
        assert engine.resident_bytes == pb.resident_bytes
        assert all(blk.owner is pb for blk in engine.resident)
        for _ in range(2):
            assert_same(b(x), ref_b(x))
    pager.unwrap(b)
    assert engine.resident_bytes == 0 and engine.total_bytes == 0 and not engine.owners


def test_a_shared_budget_refuses_a_model_that_cannot_run_beside_the_others():
    a, b = stack(seed=1), stack(n=2, width=256, seed=2)
    pager.wrap(a, budget=4 * tensor_page_bytes(a[0]), device="cpu")
    before = [t.clone() for t in b.parameters()]
    with pytest.raises(ValueError, match="largest block"):
        pager.wrap(b, budget=pager.of(a).engine)
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(b)
    assert all(torch.equal(t, u) for t, u in zip(b.parameters(), before))
    engine = pager.of(a).engine
    assert engine.owners == [pager.of(a)]
    pager.unwrap(a)
    with pytest.raises(ValueError, match="unwrapped"):
        pager.wrap(stack(), budget=engine)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second kind of device")
def test_a_shared_engine_names_its_device():
    a = stack()
    pager.wrap(a, budget=4 * tensor_page_bytes(a[0]), device="cpu")
    with pytest.raises(ValueError, match="shares an engine on cpu"):
        pager.wrap(stack(), budget=pager.of(a).engine, device="cuda")


# ------------------------------------------------------------------ layers
PACKAGE = pathlib.Path(pager.__file__).parent
# The subpackages, bottom up. A module imports from its own subpackage or from
# a layer below; subpackages of one layer do not import each other.
LAYERS = [{"codec"}, {"base"}, {"engine"}, {"training", "rows", "experts", "observe"}, {"model"}, {"api"}]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def package_modules() -> dict:
    """'sub.name' -> its path, for every module of every subpackage."""
    return {f"{f.parent.name}.{f.stem}": f for f in PACKAGE.glob("*/*.py") if f.stem != "__init__"}


def imports_of(module: str, path: pathlib.Path) -> set:
    """The package's modules that `module` imports (function-level imports too)."""
    sub = module.split(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = sub if node.level == 1 else None  # `..x`: from the package root
        parts = (node.module or "").split(".") if node.module else []
        if base is None:
            if len(parts) == 1:  # from ..engine import engine
                out |= {f"{parts[0]}.{a.name}" for a in node.names}
            elif parts:
                out.add(".".join(parts[:2]))
        else:
            out |= {f"{sub}.{parts[0]}"} if parts else {f"{sub}.{a.name}" for a in node.names}
    return out


def test_every_module_sits_in_a_layer_subpackage():
    assert {f.stem for f in PACKAGE.glob("*.py")} == {"__init__", "__main__"}
    assert {m.split(".")[0] for m in package_modules()} == set(LAYER_OF)


def test_no_module_imports_from_a_layer_above_or_beside_it():
    modules = package_modules()
    for module, path in modules.items():
        sub = module.split(".")[0]
        for dep in imports_of(module, path):
            assert dep in modules, (module, dep)
            dep_sub = dep.split(".")[0]
            assert dep_sub == sub or LAYER_OF[dep_sub] < LAYER_OF[sub], f"{module} imports {dep}"


def test_the_package_has_no_import_circle():
    modules = package_modules()
    graph = {m: imports_of(m, path) for m, path in modules.items()}
    seen, done = set(), set()

    def visit(m, path):
        assert m not in path, " -> ".join(path + [m])
        if m in done:
            return
        for n in graph[m]:
            visit(n, path + [m])
        done.add(m)

    for m in modules:
        visit(m, [])


def test_a_use_that_activations_crowd_runs_within_the_budget():
    """Activations hold part of the budget: a block in use that fits the
    budget (not the room left) still runs rather than failing."""
    model = stack()
    layer = tensor_page_bytes(model[0])
    pager.wrap(model, budget=4 * layer, device="cpu", activations="recompute", prefetch=0)
    p = pager.of(model)
    engine = p.engine
    p.activations.ledger.last_pass_peak = 2 * layer  # the last pass's activations took half the budget
    assert engine.room.room_bytes() == 2 * layer
    with p.lock:
        for block in p.blocks[:3]:
            engine.bring(block, ("weights",))  # in use: none may leave
        assert engine.room.make_room(layer, protect=set())  # 4 layers: over the room, within the budget
        assert not engine.room.make_room(layer + 1, protect=set())
        for block in p.blocks[:3]:
            p.uses.release(block)



# ------------------------------------------------------------------ work per use
def _lines_per_use(n: int, train: bool) -> tuple:
    """Lines of pager's code run per block use (a count of work, not a
    time) in steady steps of `n` Linear(8, 8) blocks under a quarter of
    what they page, and the evictions in those steps."""
    import sys

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if train else None
    per_block = tensor_page_bytes(model[0]) * (3 if train else 1)  # weights (gradients, momentum)
    pager.wrap(model, budget=n // 4 * per_block, device="cpu", optimizer=opt)
    p = pager.of(model)
    x = torch.randn(2, 8)
    root = str(PACKAGE) + "/"
    lines = [0]

    def local(frame, event, arg):
        if event == "line":
            lines[0] += 1
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(root) else None

    def step():
        if train:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        else:
            with torch.no_grad():
                model(x)

    for _ in range(3):  # the order learned, the kept set chosen, state made
        step()
    uses, evictions = sum(b.uses for b in p.blocks), p.stats().evictions
    sys.settrace(calls)
    try:
        for _ in range(3):
            step()
    finally:
        sys.settrace(None)
    uses = sum(b.uses for b in p.blocks) - uses
    return lines[0] / uses, p.stats().evictions - evictions


@pytest.mark.parametrize("train", [False, True])
def test_the_work_of_a_block_use_does_not_grow_with_the_number_of_blocks(train):
    """The hooks of a use do constant work: no scan of the resident blocks
    to choose a victim, no walk of the plan. Counted in lines of pager's
    code per use (deterministic), with 16 and 256 blocks paged alike."""
    small, small_evictions = _lines_per_use(16, train)
    large, large_evictions = _lines_per_use(256, train)
    assert small_evictions > 0 and large_evictions > 0  # paged, both
    assert large <= 1.15 * small, (small, large)


def test_the_idle_blocks_the_room_keeps_are_those_a_scan_finds():
    """The room keeps the blocks that may leave up to date as they are
    pinned, released, fetched and evicted ([Note: eviction order]): at
    every block boundary of training, inference and a change of order,
    they are the resident blocks no use pins, sorted by the kept set."""
    model = stack(8)
    layer = tensor_page_bytes(model[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pager.wrap(model, budget=9 * layer, device="cpu", optimizer=opt)
    p = pager.of(model)
    room = p.engine.room
    seen = []

    def check(*_args):
        with p.lock:
            room._sort_by_kept()
            idle = {b for b in p.engine.resident if b.pins == 0 and not b.resident_for_life}
            assert set(room.idle_streamed) | set(room.idle_kept) == idle
            assert not set(room.idle_streamed) & set(room.idle_kept)
            assert all(b in p.scheduler.kept for b in room.idle_kept)
            seen.append(len(idle))

    for layer_module in model:
        layer_module.register_forward_pre_hook(check)
        layer_module.register_forward_hook(check)
    x = torch.randn(4, 32)
    for i in range(4):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        check()
        with torch.no_grad():
            model[: 4 + i % 3](x)  # another order: a shorter path
        check()
    assert max(seen) > 0 and p.stats().evictions > 0
