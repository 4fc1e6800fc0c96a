"""pager: run and train PyTorch models larger than GPU memory on one GPU.

    model = pager.wrap(model, budget="10GiB")

The public API is what this module exports. The subpackages are the layers
beneath it, bottom up: codec, base, engine, then training, rows and observe,
then model, then api (docs/DESIGN.md).
"""

from .api.load import load, save
from .api.plan import Plan, plan
from .api.pretrained import from_pretrained
from .api.wrap import of, unwrap, wrap
from .base.budget import format_bytes, parse_budget
from .base.common import BudgetError
from .base.files import CheckpointError
from .model.pager import Pager
from .model.pool import Pool
from .observe.stats import BlockStats, PoolStats, Stats
from .training.attach import install_global_hook as _install_global_hook

_install_global_hook()


__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

__all__ = [
    "wrap",
    "unwrap",
    "of",
    "load",
    "save",
    "from_pretrained",
    "CheckpointError",
    "plan",
    "Plan",
    "Pager",
    "Pool",
    "Stats",
    "PoolStats",
    "BlockStats",
    "BudgetError",
    "parse_budget",
    "format_bytes",
]
