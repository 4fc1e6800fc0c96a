import logging
import os
import random
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

LEFT_THREAD_SECONDS = 10.0  # how long a thread a test started may take to end after it


def pytest_addoption(parser):
    parser.addoption(
        "--shuffle",
        metavar="SEED",
        default=os.environ.get("PAGER_TEST_SHUFFLE"),
        help="run the tests in an order shuffled from SEED ('random': a new seed, reported at the end); "
        "also PAGER_TEST_SHUFFLE. The suite must pass in any order.",
    )


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle")
    if seed:
        if seed == "random":
            seed = str(random.SystemRandom().randrange(1 << 32))
        config.shuffle_seed = seed
        random.Random(seed).shuffle(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    seed = getattr(config, "shuffle_seed", None)
    if seed is not None:
        terminalreporter.write_line(f"tests ran in a shuffled order: again with --shuffle {seed}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _unwrap_leftovers():
    """A failed test must not leave a wrapped model behind for the next one."""
    yield
    import pager
    from pager.base.common import _PAGERS

    for model in list(_PAGERS.keys()):
        pager.unwrap(model)


@pytest.fixture(autouse=True)
def _no_state_for_the_next_test():
    """What one test leaves must not change the next: a thread it started
    and left running would put the next test's pagers in the shared mode
    (base/threads.py), and compiled code and dynamo's caches would be
    reused. Threads left are joined (a test that leaves one running fails),
    and dynamo is reset after a test that compiled."""
    before, graphs = set(threading.enumerate()), _graphs_compiled()
    yield
    from pager.base.threads import not_a_user

    left = [
        t
        for t in threading.enumerate()
        if t not in before and not not_a_user(t) and not isinstance(t, threading._DummyThread)
    ]  # (a dummy thread stands for a thread not started by Python, autograd's device threads: none to join)
    for t in left:
        t.join(LEFT_THREAD_SECONDS / len(left))
    if any(t.is_alive() for t in left):
        names = sorted(t.name for t in left if t.is_alive())
        pytest.fail(f"the test left threads running: {names}; stop and join them in the test", pytrace=False)
    if _graphs_compiled() != graphs:
        sys.modules["torch._dynamo"].reset()


def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (0 before it is imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["stats"]["unique_graphs"] if utils is not None else 0


@pytest.fixture(autouse=True)
def _device_memory_for_the_next_test(request):
    """A CUDA test's budget covers its process by default, so what an earlier
    test left allocated on the device would count against it: garbage not yet
    collected, and cuBLAS's workspaces (one for each stream a matmul ran on,
    taken from torch's caching allocator and kept for the process). Both go
    after each CUDA test. With PAGER_TEST_MEMLOG=FILE, what is still
    allocated after it is written there, a line a test."""
    yield
    if "cuda" not in request.keywords or not torch.cuda.is_available():
        return
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    path = os.environ.get("PAGER_TEST_MEMLOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{torch.cuda.memory_allocated()} {request.node.nodeid}\n")


@pytest.fixture
def pager_log(caplog):
    caplog.set_level(logging.INFO, logger="pager")
    return caplog
