"""Data-parallel training over torch.distributed (gloo, CPU device): each
test spawns 2-4 processes; each rank trains a paged model and the same model
under DistributedDataParallel on the same data, and they must agree bit for
bit (weights, gradients, optimizer state)."""

import contextlib
import copy
import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import pager
from helpers import assert_models_equal, assert_same, tensor_page_bytes
from models import SuperNet, TinyLM
from test_training import _supernet_budget, lm_loss, regime_budget

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def spawn(scenario, world, tmp_path, backend="gloo", **kwargs):
    """Run `scenario(rank, world, tmp_path, **kwargs)` on `world` ranks; re-raise a rank's failure."""
    init = tmp_path / f"init-{scenario.__name__}-{world}-{time.monotonic_ns()}"
    mp.spawn(_entry, args=(world, str(init), backend, scenario, str(tmp_path), kwargs), nprocs=world, join=True)


def _entry(rank, world, init, backend, scenario, tmp, kwargs):
    torch.set_num_threads(1)
    if kwargs.get("device") == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        scenario(rank, world, tmp, **kwargs)
    except BaseException:
        raise RuntimeError(f"rank {rank}:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()
    # The scenario passed: leave without finalizing the interpreter. gloo's
    # worker threads outlive destroy_process_group, and one that drops its
    # last collective's tensors (whose Python objects it then owns) while
    # the interpreter finalizes must take the GIL, gets pthread_exit'ed, and
    # aborts the rank ("terminate called without an active exception"; seen
    # 1 run in 7 after a scenario's closing all_gather and barrier).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_batches(rank, n, vocab=64):
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randint(0, vocab, (2, 8), generator=g), torch.randint(0, vocab, (2, 8), generator=g))
            for _ in range(n)]


def assert_optimizer_states_equal(opt, ref_opt, params, ref_params):
    for p, q in zip(params, ref_params):
        assert (p in opt.state) == (q in ref_opt.state)
        for key, value in ref_opt.state.get(q, {}).items():
            assert_same(opt.state[p][key], value)


def assert_same_on_every_rank(model):
    """Every rank holds the same weights."""
    flat = torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()])  # (copies: views would hold blocks)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for g in gathered[1:]:
        assert torch.equal(g, gathered[0])


def _lm_pair(rank, regime, device="cpu", **options):
    torch.manual_seed(100 + rank)  # different weights per rank: wrap broadcasts rank 0's
    model = TinyLM(n_layers=6)
    if device == "cuda":
        ref = DDP(copy.deepcopy(model).cuda(), device_ids=[torch.cuda.current_device()])
    else:
        ref = DDP(copy.deepcopy(model))
    if device == "cuda":  # (the budget is sized for pager's blocks: DDP's copy beside them would count)
        options.setdefault("budget_covers", "pager")
    pager.wrap(model, budget=regime_budget(model, regime), device=device, **options)
    return model, ref


OPTIMIZERS = {"adam": lambda params: torch.optim.Adam(params, lr=1e-2),
              "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)}


def train_beside_ddp(model, ddp, opt, ref_opt, rank, steps, accumulate, clip, exact, device):
    """`steps` steps of the paged model and of DDP's on this rank's batches;
    their gradients (and clipping norms) must agree at every step."""
    for ids, tgt in rank_batches(rank, steps):
        ids, tgt = ids.to(device), tgt.to(device)
        micro = [(ids, tgt), (ids.flip(0), tgt.flip(0)), (ids.roll(1, 1), tgt)] if accumulate else [(ids, tgt)]
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with (pager.of(model).no_sync() if not last else contextlib.nullcontext()):
                lm_loss(model, x, y).backward()
            with (ddp.no_sync() if not last else contextlib.nullcontext()):
                lm_loss(ddp, x, y).backward()
        if clip is not None:  # norms of the averaged gradients (of paged-out ones: computed as they left)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert_same(norm, torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip), exact)
        for p, q in zip(model.parameters(), ddp.module.parameters()):
            assert_same(p.grad, q.grad, exact)  # averaged, read through pager's stand-ins where paged out
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()


def train_lm(rank, world, tmp, regime, accumulate=False, steps=4, exact=True, optimizer="adam", device="cpu",
             clip=None, **options):
    model, ddp = _lm_pair(rank, regime, device, **options)
    opt, ref_opt = OPTIMIZERS[optimizer](model.parameters()), OPTIMIZERS[optimizer](ddp.parameters())
    train_beside_ddp(model, ddp, opt, ref_opt, rank, steps, accumulate, clip, exact, device)
    stats = pager.of(model).stats()
    assert stats.reductions > 0 and stats.reduced_bytes > 0
    if regime == "streams":
        assert stats.evictions > 0  # the step's blocks did not fit: gradients left for host memory
        assert stats.peak_resident_bytes <= stats.budget_bytes
    assert_same_on_every_rank(model)
    if exact:
        assert_optimizer_states_equal(opt, ref_opt, list(model.parameters()), list(ddp.module.parameters()))
    pager.unwrap(model)
    assert_models_equal(model, ddp.module, exact)
    return stats


@pytest.mark.parametrize("regime", ["fits", "streams"])
def test_training_equals_ddp_bit_for_bit(tmp_path, regime):
    spawn(train_lm, 2, tmp_path, regime=regime)


def test_accumulation_with_no_sync_and_clipping_equals_ddp(tmp_path):
    spawn(train_lm, 2, tmp_path, regime="streams", accumulate=True, clip=0.5)


@pytest.mark.parametrize("activations", ["offload", "recompute"])
def test_activations_off_the_device_equal_ddp(tmp_path, activations):
    spawn(train_lm, 2, tmp_path, regime="streams", activations=activations, steps=3)


def train_with_a_control_group(rank, world, tmp):
    """A group without a CPU backend (NCCL's case) gets a gloo group of the
    same ranks for the small exchanges ([Note: small exchanges go over the
    CPU]): here gloo pretends to be such a group."""
    from pager.training import distributed

    distributed.control_on_cpu = lambda group: False
    model, ddp = _lm_pair(rank, "streams")
    reducer = pager.of(model).reducer
    assert reducer.control_group is not reducer.group
    pager.unwrap(model)
    train_lm(rank, world, tmp, regime="streams", accumulate=True, steps=3)


def test_flags_go_over_a_cpu_group_of_the_same_ranks(tmp_path):
    spawn(train_with_a_control_group, 2, tmp_path)


def adapters_on_quantized_ranks(rank, world, tmp):
    from test_quantized import adapted, adapters_budget, forward, inputs

    model = adapted(seed=rank)  # different quantized weights per rank: wrap broadcasts rank 0's inner tensors
    pager.wrap(model, budget=adapters_budget(model), device="cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        model(inputs(100 * rank + step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out = forward(model, inputs(99))
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out)
    assert all(torch.equal(g, gathered[0]) for g in gathered[1:])
    pager.unwrap(model)
    dist.barrier()  # (no rank tears gloo down while another is still in the gather)


def test_adapters_on_quantized_weights_train_on_two_ranks(tmp_path):
    """Quantized weights ([Note: wrapper-subclass weights]) reach every rank from rank 0, by their inner
    tensors, and the adapters' averaged steps keep the ranks equal."""
    spawn(adapters_on_quantized_ranks, 2, tmp_path)


def test_four_ranks(tmp_path):
    """Beyond two ranks, gloo's ring sums each element in an order set by
    its position in the buffer reduced, and DDP's buckets are not pager's
    blocks: equal to DDP within rounding (SGD: Adam's normalisation would
    magnify the last bit of gradients near zero), and the same on every rank."""
    spawn(train_lm, 4, tmp_path, regime="streams", steps=3, exact=False, optimizer="sgd")


def train_supernet(rank, world, tmp, steps=6):
    """Each rank samples its own path: a candidate some ranks skip gets
    their zeros in its average; one no rank ran keeps grad None and is not
    stepped (DDP with find_unused_parameters=True)."""
    torch.manual_seed(7)
    net = SuperNet(n_layers=4)
    ddp = DDP(copy.deepcopy(net), find_unused_parameters=True)
    budget = _supernet_budget(net)
    pager.wrap(net, budget=budget, device="cpu")
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    paths = torch.Generator().manual_seed(50 + rank)
    for ids, tgt in rank_batches(rank, steps):
        path = torch.randint(0, 3, (4,), generator=paths).tolist()  # candidate 3 is never sampled
        net.set_path(path), ddp.module.set_path(path)
        pager.of(net).expect(net.path_modules(path))
        lm_loss(net, ids, tgt).backward()
        lm_loss(ddp, ids, tgt).backward()
        for p, q in zip(net.parameters(), ddp.module.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                assert_same(p.grad, q.grad)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert pager.of(net).stats().peak_resident_bytes <= budget
    for layer in net.layers:
        assert all(p not in opt.state for p in layer.candidates[3].parameters())
    assert_same_on_every_rank(net)
    assert_optimizer_states_equal(opt, ref_opt, list(net.parameters()), list(ddp.module.parameters()))
    pager.unwrap(net)
    assert_models_equal(net, ddp.module)


def test_supernet_ranks_on_different_paths_equal_ddp(tmp_path):
    spawn(train_supernet, 2, tmp_path)


def resume_lm(rank, world, tmp, phase, steps=2):
    """Phase 0 trains and saves (rank 0); phase 1, on another number of
    ranks, loads the checkpoint into a new paged model (and DDP's model) and
    goes on. Two ranks agree with DDP bit for bit, more within rounding (see
    test_four_ranks); SGD with momentum keeps state to resume."""
    exact = world <= 2
    model, ddp = _lm_pair(rank, "streams")
    opt, ref_opt = OPTIMIZERS["sgd"](model.parameters()), OPTIMIZERS["sgd"](ddp.parameters())
    path = os.path.join(tmp, "checkpoint.pt")
    if phase == 1:
        state = torch.load(path, weights_only=True)
        # (each its own copy: optimizers may keep the loaded tensors)
        model.load_state_dict(state["model"]), opt.load_state_dict(copy.deepcopy(state["opt"]))
        ddp.module.load_state_dict(state["model"]), ref_opt.load_state_dict(copy.deepcopy(state["opt"]))
    for ids, tgt in rank_batches(rank + 10 * phase, steps):
        lm_loss(model, ids, tgt).backward(), lm_loss(ddp, ids, tgt).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_same_on_every_rank(model)
    if phase == 0 and rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    if exact:
        assert_optimizer_states_equal(opt, ref_opt, list(model.parameters()), list(ddp.module.parameters()))
    assert_models_equal(model, ddp.module, exact)


def test_checkpoint_resumes_on_another_world_size(tmp_path):
    spawn(resume_lm, 4, tmp_path, phase=0)
    spawn(resume_lm, 2, tmp_path, phase=1)


def a_rank_fails(rank, world, tmp, how):
    """Rank 1 stops taking part at the second step; rank 0 must get pager's
    error within dist_timeout instead of waiting forever, and the checkpoint
    taken before loads."""
    model, _ddp = _lm_pair(rank, "streams")
    pager.of(model).reducer.timeout_seconds = 3
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = os.path.join(tmp, "before.pt")
    done = os.path.join(tmp, "rank0-done")
    for step, (ids, tgt) in enumerate(rank_batches(rank, 3)):
        if step == 1 and rank == 1:
            if how == "dies":
                os._exit(0)  # gone without a word (exit 0: the spawner lets rank 0 finish its check)
            while not os.path.exists(done):  # alive, but in another loop
                time.sleep(0.05)
            return
        try:
            lm_loss(model, ids, tgt).backward()
        except RuntimeError as e:
            assert rank == 0 and step == 1, (rank, step)
            assert "pager: rank 0 of 2" in str(e) and "another rank probably died" in str(e).lower(), str(e)
            state = torch.load(path, weights_only=True)
            assert state.keys() == model.state_dict().keys()
            with open(done, "w") as f:
                f.write(str(e))
            return
        opt.step(), opt.zero_grad()
        if step == 0 and rank == 0:
            torch.save(model.state_dict(), path)
    raise AssertionError(f"rank {rank} was not stopped")


@pytest.mark.parametrize("how", ["stalls", "dies"])
def test_a_rank_that_stops_gives_the_others_a_clear_error(tmp_path, how):
    t0 = time.monotonic()
    spawn(a_rank_fails, 2, tmp_path, how=how)
    assert time.monotonic() - t0 < 60
    message = (tmp_path / "rank0-done").read_text()  # rank 0 saw pager's error and checked it
    assert "agreeing on the blocks used" in message or "averaging the gradients" in message, message


@pytest.mark.cuda
@pytest.mark.parametrize("regime,share", [("fits", False), ("streams", False), ("streams", True)])
def test_gpu_training_equals_ddp(tmp_path, regime, share):
    """Two ranks: with two GPUs or more, NCCL, one GPU each; with one GPU, both
    ranks on it through gloo (its CUDA path: the comm stream, reductions in
    flight as blocks leave). Within rounding of DDP's (the same kernels)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    options = {"share_host_pages": True} if share else {}  # (the shared pages page-locked in each rank)
    spawn(train_lm, 2, tmp_path, backend=backend, regime=regime, accumulate=True, exact=False, optimizer="sgd",
          device="cuda", **options)


def refusals(rank, world, tmp):
    """What data parallelism cannot do is refused before anything changes,
    on every rank, naming the fix."""
    torch.manual_seed(0)
    model = TinyLM(n_layers=6 if rank == 0 else 5)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"differ between rank 0 and rank\(s\) \[1\]"):
        pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    assert_models_equal(model.eval(), _loaded(TinyLM(n_layers=6 if rank == 0 else 5), before))
    with pytest.raises(ValueError, match="rows="):
        pager.wrap(TinyLM(), budget=1 << 20, device="cpu", rows=["embed"])
    with pytest.raises(ValueError, match="dist_timeout"):
        pager.wrap(TinyLM(), budget=1 << 20, device="cpu", dist_timeout=0)
    with pytest.raises(ValueError, match="ProcessGroup"):
        pager.wrap(TinyLM(), budget=1 << 20, device="cpu", process_group="world")
    model = TinyLM()
    pager.wrap(model, budget=1 << 20, device="cpu", process_group=False)  # off: no averaging, no collective
    assert pager.of(model).reducer is None
    with pager.of(model).no_sync():  # (without a group: nothing)
        pass
    # Blocks that differ (here: chosen differently) are found once the pages
    # are built: the model is given back as it was.
    torch.manual_seed(0)
    model = TinyLM()
    before = copy.deepcopy(model)
    chosen = (lambda name, m: name.startswith("layers.")) if rank == 0 else (lambda name, m: name == "layers.0")
    with pytest.raises(ValueError, match="blocks differ"):
        pager.wrap(model, budget=1 << 30, device="cpu", blocks=chosen)
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(model)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert_models_equal(model, before)
    ids = rank_batches(rank, 1)[0][0]
    assert_same(model(ids), before(ids))
    # A rank whose own wrap fails (here: a budget below the least that runs)
    # leaves the others with pager's error within dist_timeout, not a hang.
    model = TinyLM()
    if rank == 1:
        with pytest.raises(ValueError, match="budget"):
            pager.wrap(model, budget=1000, device="cpu", dist_timeout=3)
    else:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 0 of 2: wrap: comparing the models"):
            pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", dist_timeout=3)
        assert time.monotonic() - t0 < 30


def _loaded(model, state):
    model.load_state_dict(state)
    return model.eval()


def test_refusals(tmp_path):
    spawn(refusals, 2, tmp_path)


def _shared_file_inode():
    """The inode of the node's shared pages as this process maps them."""
    with open("/proc/self/maps") as f:
        inodes = {line.split()[4] for line in f if "/dev/shm/pager-" in line}
    assert len(inodes) == 1, inodes
    return int(inodes.pop())


def shared_inference(rank, world, tmp, nodes=1):
    """The ranks of a node map one copy of the weights' pages, and each
    streams its own requests from it: outputs equal the unpaged model's.
    `nodes`: the ranks are launched as that many torchrun nodes (`GROUP_RANK`)."""
    per_node = world // nodes
    os.environ["GROUP_RANK"] = str(rank // per_node)
    torch.manual_seed(100 + rank)
    model = TinyLM(n_layers=6)
    torch.manual_seed(100)
    ref = TinyLM(n_layers=6)  # rank 0's weights, which wrap broadcasts
    budget = int(0.6 * tensor_page_bytes(model))  # weights stream through
    pager.wrap(model, budget=budget, device="cpu", share_host_pages=True)
    p = pager.of(model)
    assert all(b.weights.shared for b in p.all_blocks())
    inodes = [None] * world
    dist.all_gather_object(inodes, _shared_file_inode())
    # one file for each node, mapped by every rank of it
    assert [len(set(inodes[n * per_node : (n + 1) * per_node])) for n in range(nodes)] == [1] * nodes
    assert len(set(inodes)) == nodes
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("pager-") and str(inodes[0]) in n]
    with torch.no_grad():
        for ids, _tgt in rank_batches(rank, 3):
            assert_same(model(ids), ref(ids))
    assert p.stats().evictions > 0  # streamed through the budget
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_shared_host_pages_serve_every_rank(tmp_path):
    spawn(shared_inference, 2, tmp_path)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_shared_host_pages_per_torchrun_node_of_one_host(tmp_path):
    """Two launches on one machine as two nodes (`torchrun --nnodes 2
    --node-rank N`): each node maps its own copy, as on two hosts."""
    spawn(shared_inference, 4, tmp_path, nodes=2)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_shared_host_pages_copy_on_write_in_training(tmp_path):
    """Each rank's changed blocks get pages of their own: training equals DDP's."""
    spawn(train_lm, 2, tmp_path, regime="streams", share_host_pages=True)
