"""Block owners (`wrap(..., block_owners=True)`, [Note: block owners]): each
trained block is updated by one rank, which alone holds its optimizer state
and writes its weights into the node's shared page. Spawned gloo ranks on
the CPU device, against DDP: bit for bit on two ranks."""

import copy
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pager
from pager.training.owners import BlockOwners
from helpers import assert_models_equal, assert_same
from models import SuperNet, TinyLM, tiny_cnn
from test_data_parallel import (OPTIMIZERS, _lm_pair, assert_optimizer_states_equal, assert_same_on_every_rank,
                                rank_batches, regime_budget, spawn, train_beside_ddp)
from test_training import _supernet_budget, lm_loss

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (shared host pages)")]


def assert_state_dicts_equal(sd, ref_sd, exact=True):
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, entry in ref_sd["state"].items():
        assert entry.keys() == sd["state"][i].keys()
        for key, value in entry.items():
            # (pager's state dict holds host copies: state_dict() needs no room on the device)
            assert_same(sd["state"][i][key].cpu(), value.cpu(), exact)
    assert sd["param_groups"] == ref_sd["param_groups"]


def assert_state_held_by_owners(model, opt):
    """Each block's state is on its owner alone (of this rank's node); a
    kept block's (the remainder's), each parameter's on its own owner."""
    owners = pager.of(model).owners
    for block, rank in owners.owner_of.items():
        held = any(p in opt.state and opt.state[p] for p in block.params)
        assert held == (rank == owners.rank), (block.name, rank, owners.rank)
    for block in owners.kept:
        for p in block.params:
            if p.requires_grad:
                assert bool(opt.state.get(p)) == owners.mine_param(p), (block.name, owners.rank)
    assert set(owners.owner_of.values()) == set(owners.node)  # every rank of the node owns some
    kept = [owners.param_owner[id(p)] for b in owners.kept for p in b.params if p.requires_grad]
    if len(owners.node) > 1 and len(kept) > 1:
        assert len(set(kept)) > 1  # (the remainder's state is not all on one rank)


def owners_train_lm(rank, world, tmp, regime, accumulate=False, steps=4, exact=True, optimizer="adam", clip=None,
                    device="cpu", node=None, **options):
    model, ddp = _lm_pair(rank, regime, device, block_owners=True, **options)
    if node is not None:  # (the ranks of this rank's host)
        assert pager.of(model).owners.node == node
    opt, ref_opt = OPTIMIZERS[optimizer](model.parameters()), OPTIMIZERS[optimizer](ddp.parameters())
    train_beside_ddp(model, ddp, opt, ref_opt, rank, steps, accumulate, clip, exact, device)
    stats = pager.of(model).stats()
    if regime == "streams":
        assert stats.peak_resident_bytes <= stats.budget_bytes
    if options.get("optimizer_step") == "host":
        assert stats.host_steps > 0  # (the owners' updates ran on the host and were published from there)
    assert_same_on_every_rank(model)
    assert_state_held_by_owners(model, opt)
    assert_state_dicts_equal(opt.state_dict(), ref_opt.state_dict(), exact)  # gathered from the owners
    assert_models_equal(model, ddp.module, exact)  # (state_dict: the weights as the owners' updates left them)
    pager.unwrap(model)  # every rank's optimizer gets the whole state back
    if exact:
        assert_optimizer_states_equal(opt, ref_opt, list(model.parameters()), list(ddp.module.parameters()))
    assert_models_equal(model, ddp.module, exact)


@pytest.mark.parametrize("regime", ["fits", "streams"])
def test_owners_train_as_ddp_bit_for_bit(tmp_path, regime):
    spawn(owners_train_lm, 2, tmp_path, regime=regime)


def test_owners_with_accumulation_and_clipping_equal_ddp(tmp_path):
    spawn(owners_train_lm, 2, tmp_path, regime="streams", accumulate=True, clip=0.5)


@pytest.mark.parametrize("optimizer_step", ["host", "device"])
def test_owners_update_on_the_host_or_the_device(tmp_path, optimizer_step):
    spawn(owners_train_lm, 2, tmp_path, regime="streams", optimizer="sgd", optimizer_step=optimizer_step)


def test_owners_on_four_ranks(tmp_path):
    """Within rounding of DDP (gloo's ring on four ranks: see test_four_ranks)."""
    spawn(owners_train_lm, 4, tmp_path, regime="streams", steps=3, exact=False, optimizer="sgd")


def owners_slow_publisher(rank, world, tmp, optimizer_step):
    """Rank 1 publishes each update 50 ms late: rank 0's fetches of its
    blocks wait, and count for "auto" only where the update ran on the host."""
    model, ddp = _lm_pair(rank, "streams", block_owners=True, optimizer_step=optimizer_step)
    owners = pager.of(model).owners
    if rank == 1:
        publish = owners.publish

        def late(block, on_host=False):
            time.sleep(0.05)
            publish(block, on_host)
        owners.publish = late
    opt, ref_opt = OPTIMIZERS["sgd"](model.parameters()), OPTIMIZERS["sgd"](ddp.parameters())
    train_beside_ddp(model, ddp, opt, ref_opt, rank, 3, False, None, True, "cpu")
    assert_models_equal(model, ddp.module)  # (waits for the last updates)
    p = pager.of(model)
    if rank == 0:
        waited = p.stats().owner_wait_seconds
        assert waited > 0.05
        if optimizer_step == "host":  # (a block's first update is on the device: it makes the state)
            assert p.host_steps.placement.waited_seconds > 0.01  # (its own updates on the host wait microseconds)
        else:
            assert p.host_steps.placement.waited_seconds == 0  # (an owner's device falling behind is no case for the host)
    pager.unwrap(model)


@pytest.mark.parametrize("optimizer_step", ["host", "device"])
def test_owners_late_on_the_host_count_as_waits_for_the_host(tmp_path, optimizer_step):
    spawn(owners_slow_publisher, 2, tmp_path, optimizer_step=optimizer_step)


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer_step", ["auto", "host", "device"])
def test_gpu_owners_train_as_ddp(tmp_path, optimizer_step):
    """Two ranks: NCCL on two GPUs (gloo on one); within rounding of DDP's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    spawn(owners_train_lm, 2, tmp_path, backend=backend, regime="streams", accumulate=True, clip=0.5,
          exact=False, optimizer="sgd", device="cuda", optimizer_step=optimizer_step, steps=5)


def owners_on_two_nodes(rank, world, tmp):
    import socket

    socket.gethostname = lambda: f"node{rank // 2}"  # ranks 0-1 one host, 2-3 another
    node = [0, 1] if rank < 2 else [2, 3]
    owners_train_lm(rank, world, tmp, regime="streams", steps=3, exact=False, optimizer="sgd", node=node)


def test_owners_on_two_nodes_of_two_ranks(tmp_path):
    """Each node has its owners, its shared pages and its counters
    (hierarchical ownership): every node updates every block once, from the
    gradients averaged over all four ranks. Within rounding of DDP (four
    ranks: see test_four_ranks)."""
    spawn(owners_on_two_nodes, 4, tmp_path)


def owners_on_two_torchrun_nodes_of_one_host(rank, world, tmp):
    os.environ["GROUP_RANK"] = str(rank // 2)  # (torchrun's node rank: two launches, --node-rank 0 and 1)
    node = [0, 1] if rank < 2 else [2, 3]
    owners_train_lm(rank, world, tmp, regime="streams", steps=3, exact=False, optimizer="sgd", node=node)


def test_owners_on_two_torchrun_nodes_of_one_host(tmp_path):
    """Two launches on one machine as two nodes (`torchrun --nnodes 2
    --node-rank N`) are two nodes: each its own owners and shared pages, as
    on two hosts; within rounding of DDP."""
    spawn(owners_on_two_torchrun_nodes_of_one_host, 4, tmp_path)


def owners_on_two_nodes_of_one_rank(rank, world, tmp):
    os.environ["GROUP_RANK"] = str(rank)  # (torchrun --nnodes 2 --nproc-per-node 1: a node of one rank each)

    def exchanged(self, shard):
        raise AssertionError("a node of one rank holds all of the state: nothing to gather")

    BlockOwners._gather_entries = exchanged  # (this rank's process only)
    owners_train_lm(rank, world, tmp, regime="streams", steps=3, node=[rank])


def test_owners_on_two_nodes_of_one_rank_each(tmp_path):
    """Each node updates every block and holds all of the optimizer's
    state: `state_dict()` exchanges nothing (it gathers within the node)
    and equals DDP's, bit for bit, as do the weights after `unwrap`."""
    spawn(owners_on_two_nodes_of_one_rank, 2, tmp_path)


def gathered_entries(rank, world, tmp):
    owners = object.__new__(BlockOwners)  # (the exchange alone: a node of `world` ranks over gloo)
    owners.group, owners.rank, owners.world, owners.node = dist.group.WORLD, rank, world, list(range(world))
    owners.node_cpu_group, owners.timeout_seconds = dist.group.WORLD, 60.0
    entries = {
        "step": torch.tensor(3.0 + rank),
        "exp_avg": torch.arange(12.0).view(4, 3).t() * (rank + 1),  # (not contiguous)
        "mask": torch.tensor([True, rank == 1]),
        "half": torch.arange(6, dtype=torch.bfloat16) + rank,
        "flag": rank == 1,
    }
    try:
        from torchao.optim.subclass_8bit import OptimState8bit

        entries["low_bit"] = OptimState8bit.zeros((256,), signed=True, block_size=256)  # (a tensor subclass)
    except ImportError:
        pass
    merged = owners._gather_entries({10 + rank: entries})
    assert sorted(merged) == [10 + r for r in range(world)]
    for r in range(world):
        got = merged[10 + r]
        assert got["flag"] is (r == 1) and torch.equal(got["step"], torch.tensor(3.0 + r))
        assert torch.equal(got["exp_avg"], torch.arange(12.0).view(4, 3).t() * (r + 1))
        assert torch.equal(got["mask"], torch.tensor([True, r == 1]))
        assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], torch.arange(6, dtype=torch.bfloat16) + r)
        if "low_bit" in entries:
            assert type(got["low_bit"]) is type(entries["low_bit"])


def test_the_optimizers_state_is_gathered_tensor_by_tensor_and_subclasses_pickled(tmp_path):
    """`opt.state_dict()` under block owners: each owner's tensors by
    broadcast, in the same order on every rank, whatever their dtype or
    strides; values that are not tensors, and tensor subclasses (torchao's
    low-bit optimizer state), pickled."""
    spawn(gathered_entries, 2, tmp_path)


def owners_supernet(rank, world, tmp, steps=6):
    """Ranks on different paths: a block one rank skipped still gets its
    owner's update on every rank."""
    torch.manual_seed(7)
    net = SuperNet(n_layers=4)
    ddp = DDP(copy.deepcopy(net), find_unused_parameters=True)
    pager.wrap(net, budget=_supernet_budget(net), device="cpu", block_owners=True)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    paths = torch.Generator().manual_seed(50 + rank)
    for ids, tgt in rank_batches(rank, steps):
        path = torch.randint(0, 3, (4,), generator=paths).tolist()
        net.set_path(path), ddp.module.set_path(path)
        pager.of(net).expect(net.path_modules(path))
        lm_loss(net, ids, tgt).backward()
        lm_loss(ddp, ids, tgt).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_same_on_every_rank(net)
    assert_state_dicts_equal(opt.state_dict(), ref_opt.state_dict())
    pager.unwrap(net)
    assert_optimizer_states_equal(opt, ref_opt, list(net.parameters()), list(ddp.module.parameters()))
    assert_models_equal(net, ddp.module)


def test_owners_supernet_ranks_on_different_paths_equal_ddp(tmp_path):
    spawn(owners_supernet, 2, tmp_path)


def owners_resume(rank, world, tmp, phase, steps=2):
    """Phase 0 trains on 4 ranks and saves (every rank gathers the state,
    rank 0 writes it); phase 1 loads it on 2 ranks (each keeps its own
    blocks' share) and goes on, against DDP loaded from the same file."""
    exact = world <= 2
    model, ddp = _lm_pair(rank, "streams", block_owners=True)
    opt, ref_opt = OPTIMIZERS["sgd"](model.parameters()), OPTIMIZERS["sgd"](ddp.parameters())
    path = os.path.join(tmp, "checkpoint.pt")
    if phase == 1:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"]), opt.load_state_dict(copy.deepcopy(state["opt"]))
        ddp.module.load_state_dict(state["model"]), ref_opt.load_state_dict(copy.deepcopy(state["opt"]))
        assert_models_equal(model, ddp.module)
    for ids, tgt in rank_batches(rank + 10 * phase, steps):
        lm_loss(model, ids, tgt).backward(), lm_loss(ddp, ids, tgt).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_same_on_every_rank(model)
    if world > 1:  # (one rank: nothing to share, [Note: one script from 1 to N GPUs])
        assert_state_held_by_owners(model, opt)  # (the state loaded before the optimizer's first step, too)
    sd = opt.state_dict()  # (on every rank: a collective)
    if phase == 0 and rank == 0:
        torch.save({"model": model.state_dict(), "opt": sd}, path)
    assert_state_dicts_equal(sd, ref_opt.state_dict(), exact)
    assert_models_equal(model, ddp.module, exact)
    dist.barrier()


def test_owners_checkpoint_taken_on_four_ranks_resumes_on_two_and_on_one(tmp_path):
    spawn(owners_resume, 4, tmp_path, phase=0)
    spawn(owners_resume, 2, tmp_path, phase=1)
    spawn(owners_resume, 1, tmp_path, phase=1)


def owners_rank_stops(rank, world, tmp):
    """Rank 1 stops after the first step: rank 0 gets pager's error within
    dist_timeout (waiting for rank 1's update, or in the averaging), and the
    checkpoint taken before loads."""
    model, _ddp = _lm_pair(rank, "streams", block_owners=True)
    p = pager.of(model)
    p.reducer.timeout_seconds = p.owners.timeout_seconds = 3
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = os.path.join(tmp, "before.pt")
    for step, (ids, tgt) in enumerate(rank_batches(rank, 3)):
        if step == 1 and rank == 1:
            os._exit(0)  # gone without a word, before its second forward
        try:
            lm_loss(model, ids, tgt).backward()
        except RuntimeError as e:
            assert rank == 0 and step == 1, (rank, step)
            assert "pager: rank 0 of 2" in str(e), str(e)
            state = torch.load(path, weights_only=True)
            assert state.keys() == model.state_dict().keys()
            (tmp_path_of(tmp) / "rank0-done").write_text(str(e))
            return
        opt.step(), opt.zero_grad()
        if step == 0:
            model.state_dict()  # (rank 0 saves; every rank reads: its forward waits for the owners' updates)
            if rank == 0:
                torch.save(model.state_dict(), path)
    raise AssertionError(f"rank {rank} was not stopped")


def tmp_path_of(tmp):
    import pathlib

    return pathlib.Path(tmp)


def test_owners_a_rank_that_dies_gives_the_others_a_clear_error(tmp_path):
    t0 = time.monotonic()
    spawn(owners_rank_stops, 2, tmp_path)
    assert time.monotonic() - t0 < 60
    message = (tmp_path / "rank0-done").read_text()
    assert "from its owner" in message or "averaging the gradients" in message \
        or "agreeing on the blocks used" in message, message


def owners_refusals(rank, world, tmp):
    cnn = tiny_cnn()
    before = copy.deepcopy(cnn.state_dict())
    with pytest.raises(ValueError, match="running statistics"):
        pager.wrap(cnn, budget="1GiB", device="cpu", block_owners=True)
    assert all(torch.equal(v, before[k]) for k, v in cnn.state_dict().items())
    with pytest.raises(ValueError, match="block_owners='yes' must be True or False"):
        pager.wrap(TinyLM(), budget="1GiB", device="cpu", block_owners="yes")
    # A paged block's weights changed outside step() and load_state_dict():
    # the ranks would no longer agree on its page. Rank 1, which does not
    # own layers.0, raises as its copy leaves at the step.
    model, _ddp = _lm_pair(rank, "streams", block_owners=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids, tgt = rank_batches(rank, 1)[0]
    lm_loss(model, ids, tgt).backward()
    with torch.no_grad():
        model.layers[0].mlp[0].weight.add_(1.0)
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"weights of block 'layers.0' \(owned by rank 0\) changed on rank 1 "
                                               r"outside optimizer.step\(\)"):
            opt.step()


def test_owners_refusals(tmp_path):
    spawn(owners_refusals, 2, tmp_path)


@pytest.mark.parametrize("option", ["block_owners", "share_host_pages"])
def test_one_process_with_owners_or_shared_pages_trains_as_alone(option, caplog):
    """[Note: one script from 1 to N GPUs]: the options of a torchrun script
    run with plain python (no process group): said once, and the model trains
    bit for bit as wrapped without them. With process_group=False they are refused."""
    torch.manual_seed(3)
    model, alone = TinyLM(n_layers=6), TinyLM(n_layers=6)
    alone.load_state_dict(model.state_dict())
    budget = regime_budget(model, "streams")
    with caplog.at_level(logging.INFO, logger="pager"):
        pager.wrap(model, budget=budget, device="cpu", **{option: True})
    assert sum("nothing to share" in r.getMessage() for r in caplog.records) == 1
    pager.wrap(alone, budget=budget, device="cpu")
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, alone)]
    for ids, tgt in rank_batches(0, 3):
        for m, opt in zip((model, alone), opts):
            lm_loss(m, ids, tgt).backward()
            opt.step()
            opt.zero_grad()
    assert_state_dicts_equal(opts[0].state_dict(), opts[1].state_dict())
    pager.unwrap(model), pager.unwrap(alone)
    assert_models_equal(model, alone)
    with pytest.raises(ValueError, match=f"{option}=True .* process_group=False turns the ranks off"):
        pager.wrap(TinyLM(), budget="1GiB", device="cpu", process_group=False, **{option: True})


def test_owners_spread_the_remainders_parameters():
    """Blocks alternate in model order; the remainder's parameters, largest
    first, go to the ranks with the fewest bytes: an embedding and a head on
    two different ranks, not both on one ([Note: block owners])."""
    from pager.training.owners import assign

    class Block:  # (what assign reads of a block)
        def __init__(self, n):
            self.params = [param(n)]

    def param(n):
        return torch.nn.Parameter(torch.zeros(n))
    blocks = [Block(100) for _ in range(4)]
    embed, norm, head = param(1000), param(10), param(1000)
    owner, param_owner = assign(blocks, [embed, norm, head], 2)
    assert [owner[b] for b in blocks] == [0, 1, 0, 1]
    assert {param_owner[id(embed)], param_owner[id(head)]} == {0, 1}
    assert param_owner[id(norm)] == 0  # (the ranks are even again after the head: the lowest)
    assert all(param_owner[id(b.params[0])] == owner[b] for b in blocks)
