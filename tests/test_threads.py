"""Which threads put a pager in the shared mode ([Note: threads that are not
users] in base/threads.py): any thread that may run a user's code does;
pager's workers, tqdm's monitor and torch's compile and pin-memory threads do
not."""

import threading

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data._utils import pin_memory

import pager
from pager.base.threads import not_a_user, other_threads


class IdleThread(threading.Thread):
    """A thread that says it runs `target` (what classifies it) and waits until stopped."""

    def __init__(self, target, **kw):
        super().__init__(target=target, daemon=True, **kw)
        self.stop = threading.Event()

    def run(self):
        self.stop.wait()


def idle_thread(target, **kw):
    t = IdleThread(target, **kw)
    t.start()
    return t, t.stop


def test_threads_that_may_run_a_users_code_count_even_in_torchs_modules():
    lin = nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for target in (torch.save, opt.step, lin, lin.forward, F.linear, lambda: None, print):
        assert not not_a_user(threading.Thread(target=target)), target


def test_pagers_torchs_and_tqdms_own_threads_do_not_count():
    from torch._inductor.compile_worker import subproc_pool

    assert not_a_user(threading.Thread(target=pin_memory._pin_memory_loop))
    assert not_a_user(threading.Thread(target=subproc_pool.SubprocPool._read_thread))
    assert not_a_user(threading.Thread(name="pager-io_0"))


def test_a_users_thread_puts_a_wrapped_model_in_the_shared_mode_and_a_pin_memory_thread_does_not():
    def used(model):
        pager.wrap(model, budget=1 << 30, device="cpu")
        with torch.no_grad():
            model(torch.randn(2, 8))
        shared = pager.of(model).shared_mode
        pager.unwrap(model)
        return shared

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert not other_threads() and not used(model)
    t, stop = idle_thread(target=pin_memory._pin_memory_loop, name="pin_memory")
    try:
        assert not other_threads() and not used(model)
    finally:
        stop.set()
        t.join()
    t, stop = idle_thread(target=torch.save)
    try:
        assert other_threads() and used(model)
    finally:
        stop.set()
        t.join()
