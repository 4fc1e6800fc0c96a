"""A fresh install passes its tests (issue 62): each example runs on its own,
copied out of the repository, with only pager, torch and what a user has;
`python -m pager --version` prints the installed version; the package carries
the C source it builds at first use.

CPU only: each example runs on the CPU device (CUDA hidden), at the small
size its docstring names, and checks itself bit for bit against the unpaged
model. The slowest is train_data_parallel.py, which starts two ranks (three
processes importing torch).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.resources
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
HF = all(importlib.util.find_spec(name) is not None for name in ("transformers", "peft"))
DIFFUSERS = all(importlib.util.find_spec(name) is not None for name in ("transformers", "diffusers"))

# Each example: the arguments of its quick CPU run, and the lines its output must hold.
RUNS = {
    "run_big_model.py": (["--layers", "4"], ["equal to the unpaged model, bit for bit: True"]),
    "nas_supernet.py": (["--steps", "5"], ["losses equal to unpaged training at every step, bit for bit: True"]),
    "serve.py": (["--demo", "4", "--layers", "2"], ["(equal to unwrapped: True)"] * 4 + ["pool: 2 model(s)"]),
    "train_data_parallel.py": (
        ["--steps", "1"],  # (two micro-steps, the first under no_sync)
        ["the same weights as DistributedDataParallel, bit for bit, on every rank"],
    ),
    "finetune_lora.py": (
        ["--steps", "2"],
        ["equal to the unwrapped model after 2 steps, bit for bit: True"]
        if HF
        else ["skipped: this example needs transformers and peft: pip install transformers peft"],
    ),
    "generate_image.py": (
        ["--steps", "2", "--out", "cat.png"],
        ["equal to the unwrapped pipeline, bit for bit: True", "saved cat.png"]
        if DIFFUSERS
        else ["skipped: this example needs diffusers and transformers: pip install diffusers transformers"],
    ),
}


def test_every_example_has_a_run_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_an_example_names_nothing_of_the_repository(name):
    source = (EXAMPLES / name).read_text()
    assert "benchmarks" not in source
    assert "sys.path" not in source
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or ".").split(".")[0] if node.level == 0 else ".")
    allowed = {"__future__", "argparse", "contextlib", "copy", "logging", "os", "queue", "random", "sys"}
    allowed |= {"tempfile", "threading", "time", "torch", "pager", "peft", "transformers", "diffusers", "PIL"}
    assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}, which a user of pager may not have"


@pytest.fixture
def elsewhere(tmp_path):
    """A folder outside the repository to run a copy in, and an environment in
    which CUDA is hidden and `benchmarks` and `tests` cannot be imported (a
    package of each name that fails comes first on the path, in spawned
    processes too)."""
    shadow = tmp_path / "shadow"
    for package in ("benchmarks", "tests"):
        (shadow / package).mkdir(parents=True)
        (shadow / package / "__init__.py").write_text(
            f"raise ImportError('an example imported {package}, which pager does not install')\n"
        )
    run = tmp_path / "run"
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=str(shadow), CUDA_VISIBLE_DEVICES="", OUT=str(run))
    assert ROOT not in run.resolve().parents
    return run, env


@pytest.mark.parametrize("name", sorted(RUNS))
def test_an_example_runs_from_a_folder_of_its_own(name, elsewhere):
    run, env = elsewhere
    args, expected = RUNS[name]
    shutil.copy(EXAMPLES / name, run / name)
    done = subprocess.run(
        [sys.executable, name, *args],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for line in set(expected):
        assert done.stdout.count(line) >= expected.count(line), (line, output[-4000:])
    if name == "finetune_lora.py" and HF:
        assert (run / "lora-adapter" / "adapter_config.json").is_file()
    if name == "generate_image.py" and DIFFUSERS:
        assert (run / "cat.png").stat().st_size > 0


def test_python_m_pager_version_prints_the_installed_version(tmp_path):
    import pager

    done = subprocess.run(
        [sys.executable, "-m", "pager", "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"pager {pager.__version__}"
    assert pager.__version__ == importlib.metadata.version("pager")  # (installed: the tests run on an install)


def test_the_plan_subcommand_is_still_there(capsys):
    from pager.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main(["plan", "--help"])
    assert stop.value.code == 0 and "--budget" in capsys.readouterr().out


def test_the_package_carries_the_master_pass_source():
    from pager.training import master_pass

    source = importlib.resources.files("pager") / "training" / "master_pass.c"
    assert source.is_file()
    assert "pager_adam_bf16" in source.read_text()
    assert pathlib.Path(master_pass.SOURCE).read_text() == source.read_text()  # the file it builds at first use
