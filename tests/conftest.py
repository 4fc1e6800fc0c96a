import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture
def pager_log(caplog):
    caplog.set_level(logging.INFO, logger="pager")
    return caplog
