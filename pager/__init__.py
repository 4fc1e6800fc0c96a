"""pager: run and train PyTorch models larger than GPU memory on one GPU.

    model = pager.wrap(model, budget="10GiB")
"""

from ._api import of, unwrap, wrap
from ._budget import parse_budget
from ._files import CheckpointError
from ._load import load, save
from ._common import BudgetError
from ._pager import Pager
from ._plan import Plan, plan
from ._pool import Pool
from ._optim import install_global_hook as _install_global_hook
from ._stats import BlockStats, PoolStats, Stats

_install_global_hook()

__all__ = ["wrap", "unwrap", "of", "load", "save", "CheckpointError", "plan", "Plan", "Pager", "Pool", "Stats", "PoolStats", "BlockStats", "BudgetError",
           "parse_budget"]
__version__ = "0.1.0"
