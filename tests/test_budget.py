import pytest
import torch

from pager import parse_budget

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "text,expected",
    [(1234, 1234), ("10GiB", 10 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
     ("2k", 2048), (" 3 MB ", 3_000_000), ("100", 100)],
)
def test_sizes(text, expected, monkeypatch):
    import pager.base.budget as budget_mod

    monkeypatch.setattr(budget_mod, "device_memory", lambda device: (1 << 40, 1 << 40))  # (any host: 10GiB fits)
    assert parse_budget(text, CPU) == expected


def test_share_of_memory():
    import psutil

    assert parse_budget("50%", CPU) == int(psutil.virtual_memory().total * 0.5)


@pytest.mark.parametrize("bad", ["ten gigs", "-1GiB", 0, -5, "150%", "0%", "", "12 parsecs", 1.5, None, True])
def test_bad_budgets_name_the_value_and_the_fix(bad):
    with pytest.raises(ValueError) as e:
        parse_budget(bad, CPU)
    msg = str(e.value)
    assert repr(bad) in msg or "share" in msg
    assert "GiB" in msg or "%" in msg


def test_auto_is_free_memory_less_a_margin():
    import psutil

    got = parse_budget("auto", CPU)
    assert 0 < got < psutil.virtual_memory().available
