"""The docs' code runs: every ```python block of README.md and docs/*.md.

Each block runs as its own test, on the CPU device, as on a machine without
a GPU: `torch.cuda.is_available()` is False while it runs (so pager's device
defaults to "cpu", and Trainer's too), `Tensor.cuda()` leaves a tensor where
it is, and the working folder is a temporary one (checkpoint folders, saved
adapters). Blocks are fragments of a user's program: the names a page's
blocks use without defining them (`model`, `x`, `data`, a checkpoint folder)
come from that page's preamble below, built from the tests' small models;
a block gets only the names it uses. A block that cannot run here says so
in the page, on the line before its fence, with the reason:

    <!-- docs-test: skip (needs several GPUs) -->

and is reported skipped with it (`pytest -rs`). Blocks that need
transformers (or peft) skip without it, as the other tests do.
"""

from __future__ import annotations

import ast
import dataclasses
import random
import re
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import SuperNet, TinyLM

import pager
from pager.base.common import _PAGERS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!--\s*docs-test:(.*?)-->\s*$")  # a line of its own
SKIP = re.compile(r"\s*skip\s*\((.+)\)\s*$")
MOST_SKIPPED = 1 / 3  # at most this share of the blocks may be marked to skip
# The test extra's packages: a block that imports one skips without it.
OPTIONAL = {"transformers", "peft", "accelerate", "torchao", "diffusers"}


@dataclasses.dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    code: str
    skip: str | None  # the reason, where the page marks the block to skip

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(path: Path) -> tuple[list[Block], list[str]]:
    """The ```python blocks of a page, and the problems of its markers (a
    marker that is not right before a python block, or says something else)."""
    page, lines = str(path.relative_to(ROOT)), path.read_text().splitlines()
    blocks, problems, marker, i = [], [], None, 0
    while i < len(lines):
        line = lines[i]
        found = MARKER.match(line)
        if found:
            skip = SKIP.match(found.group(1))
            if skip is None:
                problems.append(f"{page}:{i + 1}: a docs-test marker says {found.group(1).strip()!r}, not 'skip (why)'")
            marker = (i + 1, skip.group(1).strip() if skip else None)
        elif line.strip().startswith("```"):
            start, fence = i, line.strip()
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            if fence == "```python":
                blocks.append(Block(page, start + 1, "\n".join(lines[start + 1 : i]), marker[1] if marker else None))
            elif marker:
                problems.append(f"{page}:{marker[0]}: a docs-test marker before a {fence} block")
            marker = None
        elif line.strip() and marker:
            problems.append(f"{page}:{marker[0]}: a docs-test marker not on the line before a ```python block")
            marker = None
        i += 1
    return blocks, problems


BLOCKS = [b for path in PAGES for b in blocks_of(path)[0]]


def names_used(code: str) -> set[str]:
    """The names a block reads before it binds them (roughly: an assignment's
    value is read before its targets are bound; a loop's or a `with`'s names
    count as bound for its body)."""
    used, bound = set(), set()

    def reads(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound:
                used.add(n.id)

    def binds(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                bound.add(n.id)
            elif isinstance(n, ast.alias):
                bound.add((n.asname or n.name).split(".")[0])
            elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                bound.add(n.name)

    def statements(body):
        for s in body:
            if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                if s.value is not None:
                    reads(s.value)
                for t in s.targets if isinstance(s, ast.Assign) else [s.target]:
                    binds(t)
            elif isinstance(s, ast.For):
                reads(s.iter)
                binds(s.target)
                statements(s.body + s.orelse)
            elif isinstance(s, ast.With):
                for item in s.items:
                    reads(item.context_expr)
                    if item.optional_vars is not None:
                        binds(item.optional_vars)
                statements(s.body)
            else:
                reads(s)
                binds(s)

    statements(ast.parse(code).body)
    return used


def strings_in(code: str) -> set[str]:
    """The string constants of a block (the files and folders it names)."""
    return {n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


# The preambles: per page, the names its blocks use and how to build each,
# and the files and folders they name (made in the working folder where a
# block's strings name them); `ctx[key]` builds another. Tiny stand-ins for
# the pages' big models.


class Context:
    def __init__(self, makers: dict, tmp: Path):
        self.makers, self.tmp, self.made = makers, tmp, {}

    def __getitem__(self, name: str):
        if name not in self.made:
            self.made[name] = self.makers[name](self)
        return self.made[name]


def transformers_():
    return pytest.importorskip("transformers")


def llama_config(ctx):
    return transformers_().LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


def llama(ctx):
    torch.manual_seed(0)
    return transformers_().LlamaForCausalLM(ctx["config"]).eval()


def llama_folder(name: str):
    """A `save_pretrained` folder of a tiny Llama, in the working folder."""

    def make(ctx):
        llama(ctx).save_pretrained(ctx.tmp / name)
        return name

    return make


def moe_folder(name: str):
    """A `save_pretrained` folder of a tiny Qwen3-MoE (8 experts, 2 routed), in the working folder."""

    def make(ctx):
        config = transformers_().Qwen3MoeConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=128,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers_().Qwen3MoeForCausalLM(config).save_pretrained(ctx.tmp / name)
        return name

    return make


def token_batches(ctx):
    """Batches for a causal LM: input ids and labels."""
    ids = torch.randint(0, 128, (4, 2, 16))
    return [{"input_ids": i, "labels": i} for i in ids]


def token_samples(ctx):
    """A dataset for `Trainer`: samples of input ids and labels."""
    return [{"input_ids": i, "labels": i} for i in torch.randint(0, 128, (8, 16))]


def tokenizer(ctx):
    """A stand-in for a tokenizer: `tokenizer(text, return_tensors="pt").input_ids`."""

    def tokenize(text, return_tensors=None):
        return transformers_().BatchEncoding({"input_ids": torch.tensor([[1 + ord(c) % 100 for c in text]])})

    return tokenize


def lm_data(ctx):
    return [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(3)]


def lm_loss(ctx):
    return lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())


class Recommender(nn.Module):
    """An embedding table beside a small MLP: the model of rows.md."""

    def __init__(self, rows=1000, dim=16):
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)  # (for SparseAdam)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids, offsets, y):
        return F.mse_loss(self.mlp(self.table(ids, offsets)).squeeze(-1), y)


def row_batches(ctx):
    """((ids, offsets, y), the next batch's ids) for a few steps of 4 bags of 3 ids."""
    ids = [torch.randint(0, 1000, (12,)) for _ in range(4)]
    batches = [(i, torch.arange(0, 12, 3), torch.randn(4)) for i in ids]
    return [(batch, ids[(k + 1) % len(ids)]) for k, batch in enumerate(batches)]


def supernet(ctx):
    return pager.wrap(SuperNet(), budget="1GiB")


def sample_path(ctx):
    rng = random.Random(0)
    return lambda: [rng.randrange(4) for _ in range(4)]


def flux_pipeline(ctx):
    """A small Flux pipeline (tests/test_diffusion.py), its default image 8x8 (the page's call is a real one's)."""
    from test_diffusion import _pipeline

    pipe, _call = _pipeline("flux")
    pipe.default_sample_size = 8
    return pipe


PREAMBLES = {
    "README.md": {
        "build_big_model": lambda ctx: TinyLM,
        "x": lambda ctx: torch.randint(0, 64, (2, 16)),
        "ids": lambda ctx: torch.tensor([[1, 2, 3]]),
        "Llama-3-8B/": llama_folder("Llama-3-8B"),
        "config": llama_config,
    },
    "docs/hugging-face.md": {
        "Llama-3-8B/": llama_folder("Llama-3-8B"),
        "tokenizer": tokenizer,
        "config": llama_config,
        "AutoModelForCausalLM": lambda ctx: transformers_().AutoModelForCausalLM,
        "model": llama,
        "name": llama_folder("tiny-llama"),
        "Trainer": lambda ctx: transformers_().Trainer,
        "TrainingArguments": lambda ctx: transformers_().TrainingArguments,
        "data": token_samples,
    },
    "docs/adapters.md": {
        "config": llama_config,
        "path": llama_folder("tiny-llama"),
        "data": token_batches,
    },
    "docs/compile.md": {"model": llama, "config": llama_config},
    "docs/compression.md": {"model": lambda ctx: TinyLM().to(torch.bfloat16)},
    "docs/diffusion.md": {"pipe": flux_pipeline},
    "docs/moe.md": {"Qwen3-30B-A3B/": moe_folder("Qwen3-30B-A3B"), "ids": lambda ctx: torch.tensor([[1, 2, 3]])},
    "docs/rows.md": {
        "model": lambda ctx: Recommender(),
        "loader_with_next_ids": row_batches,
    },
    "docs/serving.md": {
        "config": llama_config,
        "chat": llama,
        "embed": lambda ctx: TinyLM().eval(),
        "ids": lambda ctx: torch.tensor([[1, 2, 3]]),
        "ids2": lambda ctx: torch.randint(0, 64, (2, 8)),
    },
    "docs/training.md": {
        "model": lambda ctx: TinyLM(),
        "data": lm_data,
        "loss_fn": lm_loss,
        "AutoModelForCausalLM": lambda ctx: transformers_().AutoModelForCausalLM,
        "config": llama_config,
        "name": llama_folder("tiny-llama"),
        "supernet": supernet,
        "sample_path": sample_path,
        "x": lambda ctx: torch.randint(0, 64, (2, 16)),
        "y": lambda ctx: torch.randint(0, 64, (2, 16)),
    },
}


@pytest.fixture
def as_without_a_gpu(monkeypatch, tmp_path):
    """The block's surroundings: no CUDA, `.cuda()` a no-op, a temporary working folder."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    memory = psutil.virtual_memory()  # (the pages' budgets are a large machine's; the models are tiny)
    large = memory._replace(total=max(memory.total, 1 << 40), available=max(memory.available, 1 << 40))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: large)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for model in list(_PAGERS.keys()):  # (before conftest's check of threads left running)
        pager.unwrap(model)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block, as_without_a_gpu):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    ctx = Context(PREAMBLES.get(block.page, {}), as_without_a_gpu)
    namespace = {"__name__": "__docs__", "torch": torch, "pager": pager}  # (the imports a page assumes)
    for key in sorted(strings_in(block.code) & ctx.makers.keys()):
        ctx[key]
    for name in sorted(names_used(block.code) & ctx.makers.keys()):
        namespace[name] = ctx[name]
    # (compiled with the page's line numbers: a traceback points into the page)
    code = compile("\n" * block.line + block.code, str(ROOT / block.page), "exec")
    try:
        exec(code, namespace)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
        pytest.skip(f"{block.id}: needs {e.name}")


def test_markers_are_well_placed():
    problems = [p for path in PAGES for p in blocks_of(path)[1]]
    assert not problems, "\n".join(problems)


def test_most_blocks_run():
    fences = sum(line.strip() == "```python" for path in PAGES for line in path.read_text().splitlines())
    assert len(BLOCKS) == fences > 0
    skipped = [f"{b.id}: {b.skip}" for b in BLOCKS if b.skip]
    assert len(skipped) <= MOST_SKIPPED * len(BLOCKS), "too many blocks skip:\n" + "\n".join(skipped)


def test_every_preamble_is_of_a_page():
    pages = {b.page for b in BLOCKS}
    assert set(PREAMBLES) <= pages, f"preambles of pages without python blocks: {set(PREAMBLES) - pages}"
