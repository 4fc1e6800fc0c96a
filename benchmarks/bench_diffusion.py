"""A diffusers pipeline larger than its budget: pager against diffusers' own offloading.

`--model flux` (the default): a Flux-shaped `FluxPipeline` (random weights,
bf16): the transformer of FLUX.1-dev (19 double and 38 single blocks, hidden
3072: 23.8 GB), a T5-XXL-shaped text encoder (24 layers, d_model 4096: 9.5
GB), a CLIP-L-shaped one and Flux's VAE; `--double`/`--single` take a slice
of the transformer. One call makes a 1024x1024 image (4096 image tokens, 512
text tokens) in `--steps` denoising steps.

`--model wan`: a `WanPipeline` of Wan 2.1 T2V 14B's shapes: the transformer
(40 blocks of hidden 5120: 28.6 GB; `--layers`), a UMT5-XXL-shaped encoder
(11.4 GB), Wan's video VAE. One call makes `--frames` frames at 480x832 (33:
14040 tokens), the transformer twice a step (classifier-free guidance):
blocks of long compute, where the link has time to spare.

Each method is called once to warm up, then timed. Per method: ms per
denoising step (the mean of the steps after the first, each ended by a
sync), the whole call, its first call, the transformer's bytes moved per
step and the link's floor of them (pager), peak GPU memory (allocated) and
host RSS.

Methods: all on the GPU; pager at each of `--budgets` (`8GiB`, or `half` /
`fifth` / `tenth`: that share of the transformer's bytes; one below the
least the pipeline runs in is refused, and the row says so); diffusers'
`enable_model_cpu_offload`,
`enable_sequential_cpu_offload`, and `apply_group_offloading` with streams
at block and at leaf level (`--peers`; each skipped, saying why, where
diffusers is missing or it fails).

    python -m benchmarks.bench_diffusion [--steps 4] [--budgets 8GiB,half,fifth,tenth] [--peers model,sequential,block,leaf]
    python -m benchmarks.bench_diffusion --model wan --budgets 8GiB,tenth --peers block,leaf --latent
    python -m benchmarks.bench_diffusion --tiny [--model wan]   # a small pipeline on the CPU device: the code paths
    python -m benchmarks.bench_diffusion --budgets fifth --peers "" --latent --profile fifth   # a trace: profile_summary
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pager
from benchmarks.harness import GiB, Row, environment, free_cuda, host_rss_gib, out_path, pinned_h2d_gbps, profiled, save


class Tokens:
    """A stand-in tokenizer (the machine reaches no hub): a prompt's bytes, padded."""

    added_tokens_encoder: dict = {}

    def __init__(self, max_length: int = 77, vocab: int = 100):
        self.model_max_length, self.vocab = max_length, vocab

    def __call__(self, text, max_length=None, return_tensors=None, **_kw):
        from transformers import BatchEncoding

        text = [text] if isinstance(text, str) else list(text)
        n = max_length or self.model_max_length
        rows = [[b % (self.vocab - 2) + 2 for b in t.encode()][:n] for t in text]
        ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
        return BatchEncoding({"input_ids": ids, "attention_mask": (ids != 0).long()})

    def tokenize(self, text):
        return list(text)

    def batch_decode(self, ids, **_kw):
        return ["" for _ in ids]


def components(args, device: str) -> dict:
    """The pipeline's models, random, built on `device`."""
    with torch.device(device):
        models = (_wan_models if args.model == "wan" else _flux_models)(args, args.tiny)
    for m in models.values():
        m.to(torch.float32 if args.tiny else torch.bfloat16).eval()
    return models


def _flux_models(args, tiny: bool) -> dict:
    import diffusers
    import transformers

    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4 if tiny else 64, num_layers=args.double, num_single_layers=args.single,
        attention_head_dim=16 if tiny else 128, num_attention_heads=2 if tiny else 24,
        joint_attention_dim=32 if tiny else 4096, pooled_projection_dim=32 if tiny else 768,
        axes_dims_rope=[4, 4, 8] if tiny else [16, 56, 56], guidance_embeds=True,
    )  # fmt: skip
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=100 if tiny else 32128, d_model=32 if tiny else 4096, d_kv=8 if tiny else 64,
            d_ff=37 if tiny else 10240, num_layers=2 if tiny else 24, num_heads=4 if tiny else 64,
            feed_forward_proj="gated-gelu",
        )
    )  # fmt: skip
    clip = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            hidden_size=32 if tiny else 768, intermediate_size=37 if tiny else 3072, num_hidden_layers=2 if tiny else 12,
            num_attention_heads=4 if tiny else 12, vocab_size=100 if tiny else 49408, projection_dim=32 if tiny else 768,
        )
    )  # fmt: skip
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=1 if tiny else 16,
        block_out_channels=(4,) if tiny else (128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * (1 if tiny else 4),
        up_block_types=("UpDecoderBlock2D",) * (1 if tiny else 4), layers_per_block=1 if tiny else 2,
        norm_num_groups=1 if tiny else 32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.1159, scaling_factor=0.3611,
    )  # fmt: skip
    return dict(transformer=transformer, text_encoder_2=t5, text_encoder=clip, vae=vae)


def _wan_models(args, tiny: bool) -> dict:
    """Wan 2.1 T2V 14B's shapes: 40 blocks of hidden 5120 (28.6 GB), a
    UMT5-XXL-shaped encoder (11.4 GB), Wan's video VAE."""
    import diffusers
    import transformers

    transformer = diffusers.WanTransformer3DModel(
        num_attention_heads=2 if tiny else 40, attention_head_dim=12 if tiny else 128, text_dim=32 if tiny else 4096,
        ffn_dim=32 if tiny else 13824, num_layers=args.layers,
    )  # fmt: skip
    umt5 = transformers.UMT5EncoderModel(
        transformers.UMT5Config(
            vocab_size=100 if tiny else 256384, d_model=32 if tiny else 4096, d_kv=8 if tiny else 64,
            d_ff=37 if tiny else 10240, num_layers=2 if tiny else 24, num_heads=4 if tiny else 64,
            feed_forward_proj="gated-gelu",
        )
    )  # fmt: skip
    vae = diffusers.AutoencoderKLWan(**(dict(base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1) if tiny else {}))
    return dict(transformer=transformer, text_encoder=umt5, vae=vae)


def _pipeline_of(models: dict):
    """The pipeline of `models` (`components`), with stand-in tokenizers."""
    import diffusers

    if ARGS.model == "wan":
        tokenizer = Tokens(512, vocab=100 if ARGS.tiny else 256384)
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0)
        return diffusers.WanPipeline(scheduler=scheduler, tokenizer=tokenizer, **models)
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), tokenizer=Tokens(77), tokenizer_2=Tokens(512), **models
    )


def pipeline(host: dict):
    """The pipeline of the models' tensors `host` (name -> every parameter and
    buffer, non-persistent ones too), built on meta and given them (no copy)."""
    models = components(ARGS, "meta")
    for name, m in models.items():
        made: dict = {}  # (a tensor tied under two names, T5's embedding: one Parameter)
        for key, value in host[name].items():
            owner, _, leaf = key.rpartition(".")
            module = m.get_submodule(owner)
            if leaf in module._parameters:
                module._parameters[leaf] = made.setdefault(id(value), torch.nn.Parameter(value, requires_grad=False))
            else:
                module._buffers[leaf] = value
    return _pipeline_of(models)


def call(pipe, args, times: list):
    """One image; `times` gets the time at each step's end (synced)."""

    def at_step_end(_pipe, _i, _t, kwargs):
        if torch.cuda.is_available() and not args.tiny:
            torch.cuda.synchronize()
        times.append(time.perf_counter())
        return kwargs

    common = dict(
        num_inference_steps=args.steps, max_sequence_length=48 if args.tiny else 512,
        generator=torch.Generator().manual_seed(0), callback_on_step_end=at_step_end,
    )  # fmt: skip
    if args.model == "wan":  # (the transformer twice a step: with and without the prompt, guidance_scale > 1)
        height, width = (16, 16) if args.tiny else (480, 832)
        return pipe(
            "a cat walks on a mat", height=height, width=width, num_frames=5 if args.tiny else args.frames,
            guidance_scale=5.0, output_type="latent" if args.latent else "np", **common,
        )  # fmt: skip
    size = 16 if args.tiny else 1024
    return pipe(
        "a photograph of a cat on a mat", height=size, width=size, guidance_scale=3.5,
        output_type="latent" if args.latent else "pil", **common,
    )  # fmt: skip


def measure(pipe, args, before_timed=None) -> dict:
    """A warm-up call, then a timed one (`before_timed()` called between them)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not args.tiny else (lambda: None)
    out = {}
    for run in ("first", "timed"):
        sync()
        if run == "timed" and before_timed is not None:
            before_timed()
        if run == "timed" and not args.tiny:
            torch.cuda.reset_peak_memory_stats()
        times: list = []
        t0 = time.perf_counter()
        call(pipe, args, times)
        sync()
        t1 = time.perf_counter()
        steps = [b - a for a, b in zip(times, times[1:])]
        out[run] = {"call_s": t1 - t0, "step_ms": statistics.mean(steps) * 1e3 if steps else None}
    out["peak_gib"] = None if args.tiny else torch.cuda.max_memory_allocated() / GiB
    out["rss_gib"] = host_rss_gib()
    return out


def row(work: str, method: str, got: dict, ref_ms: float | None, note: str = "") -> Row:
    ms = got["timed"]["step_ms"]
    return Row(
        work, method, ms, got["peak_gib"], ms / ref_ms if ms and ref_ms else None, "all on the GPU" if ref_ms else "",
        f"call {got['timed']['call_s']:.2f} s; first call {got['first']['call_s']:.2f} s "
        f"({got['first']['step_ms'] or 0:.0f} ms/step); host RSS {got['rss_gib']:.1f} GiB" + (f"; {note}" if note else ""),
        got,
    )  # fmt: skip


def budget_of(spec: str, transformer_bytes: int) -> int | str:
    share = {"half": 0.5, "fifth": 0.2, "tenth": 0.1}.get(spec)
    return spec if share is None else int(share * transformer_bytes)


def room_short(host) -> str | None:
    """Why a method that copies the pipeline's tensors once more (pinned
    pages, a peer's copies) would not fit the host's free memory, or None."""
    import psutil

    need = sum(t.numel() * t.element_size() for s in host.values() for t in s.values()) * 1.2
    free = psutil.virtual_memory().available
    return None if free > need else f"skipped: {free / GiB:.0f} GiB of host memory free, {need / GiB:.0f} GiB needed"


def pager_row(host, args, spec, work, ref_ms, bw) -> Row:
    short = None if args.tiny else room_short(host)
    if short:
        return Row(work, f"pager {spec}", None, note=short)
    pipe = pipeline(host)
    transformer_bytes = sum(t.numel() * t.element_size() for t in pipe.transformer.state_dict().values())
    try:
        pager.wrap(pipe, budget=budget_of(spec, transformer_bytes), device="cpu" if args.tiny else "cuda")
    except ValueError as e:  # (a share below the least the pipeline runs in: refused, and said)
        return Row(work, f"pager {spec}", None, note=f"refused: {str(e)[:240]}")
    pool = pager.of(pipe)
    before = []
    got = measure(pipe, args, lambda: before.append(pool.stats()))
    after = pool.stats()
    if spec == args.profile and not args.tiny:
        profiled(lambda: call(pipe, args, []), out_path(f"diffusion_profile_{spec}.json.gz"))
    moved = (after.models["transformer"].h2d_bytes - before[0].models["transformer"].h2d_bytes) / args.steps
    floor_ms = moved / (bw * 1e9) * 1e3 if bw else None
    note = (
        f"budget {pool.budget_bytes / GiB:.2f} GiB ({spec}); transformer {moved / 1e9:.2f} GB a step"
        + (f", floor {floor_ms:.0f} ms ({got['timed']['step_ms'] / floor_ms:.2f}x)" if floor_ms else "")
        + f"; pool peak resident {after.peak_resident_bytes / GiB:.2f} GiB"
    )
    pager.unwrap(pipe)
    pipe = pool = None  # (let go before free_cuda)
    free_cuda() if not args.tiny else None
    return row(work, f"pager {spec}", got, ref_ms, note + f"; host RSS after unwrap {host_rss_gib():.1f} GiB")


def peer_row(host, args, kind: str, work: str, ref_ms) -> Row:
    method = {
        "model": "diffusers enable_model_cpu_offload",
        "sequential": "diffusers enable_sequential_cpu_offload",
        "block": "diffusers group offloading, block level, streams",
        "leaf": "diffusers group offloading, leaf level, streams",
    }[kind]
    if args.tiny:
        return Row(work, method, None, note="skipped: needs CUDA")
    short = room_short(host)
    if short:
        return Row(work, method, None, note=short)
    pipe = pipeline(host)
    try:
        if kind == "model":
            pipe.enable_model_cpu_offload()
        elif kind == "sequential":
            pipe.enable_sequential_cpu_offload()
        else:
            from diffusers.hooks import apply_group_offloading

            for name, module in pipe.components.items():
                if not isinstance(module, torch.nn.Module):
                    continue
                level = "block_level" if kind == "block" else "leaf_level"
                extra = {"num_blocks_per_group": 1} if kind == "block" else {}
                apply_group_offloading(
                    module,
                    onload_device=torch.device("cuda"),
                    offload_type=level,
                    use_stream=True,
                    **extra,
                )
        got = measure(pipe, args)
    except Exception as e:  # (a peer that fails is a figure too: say how)
        return Row(work, method, None, note=f"failed: {type(e).__name__}: {str(e)[:160]}")
    finally:
        del pipe
        free_cuda()
    return row(work, method, got, ref_ms)


def have_diffusers() -> bool:
    """Whether diffusers imports (else says so: nothing to measure)."""
    try:
        import diffusers  # noqa: F401
    except ImportError:
        print("diffusers is not installed: nothing to measure (pip install diffusers; on the GPU machine, .peers/)")
        return False
    return True


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("flux", "wan"), default="flux")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=40, help="wan: the transformer's blocks")
    ap.add_argument("--frames", type=int, default=33, help="wan: the video's frames (33 at 480x832: 14040 tokens)")
    ap.add_argument("--double", type=int, default=19)
    ap.add_argument("--single", type=int, default=38)
    ap.add_argument("--budgets", default="8GiB,half,fifth,tenth")
    ap.add_argument("--peers", default="model,sequential,block,leaf")
    ap.add_argument("--latent", action="store_true", help="no VAE decode")
    ap.add_argument("--profile", default="", help="a budget of --budgets: two more calls under torch.profiler")
    ap.add_argument("--tiny", action="store_true", help="a small pipeline on the CPU device (the code paths only)")
    args = ARGS = ap.parse_args()
    if args.tiny:
        args.double, args.single, args.layers = min(args.double, 2), min(args.single, 2), min(args.layers, 2)
    if not have_diffusers():
        return
    env = environment()
    print(env, flush=True)
    bw = None if args.tiny else pinned_h2d_gbps()
    torch.manual_seed(0)
    built = components(args, "cpu" if args.tiny else "cuda")
    host: dict = {}
    for n, m in built.items():
        copies: dict = {}  # (tied tensors stay one)
        named = [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]
        host[n] = {k: copies.setdefault(id(v), v.detach().to("cpu", copy=True)) for k, v in named}
    sizes = {n: sum(v.numel() * v.element_size() for v in s.values()) / 1e9 for n, s in host.items()}
    if args.model == "wan":
        frames, height, width = (5, 16, 16) if args.tiny else (args.frames, 480, 832)
        tokens = ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)
        work = (
            f"WanPipeline-shaped ({args.layers} blocks: transformer {sizes['transformer']:.1f} GB, "
            f"UMT5 {sizes['text_encoder']:.1f} GB), {height}x{width}x{frames} "
            f"({tokens} tokens), {args.steps} steps"
        )
    else:
        work = (
            f"FluxPipeline-shaped ({args.double}+{args.single} blocks: transformer {sizes['transformer']:.1f} GB, "
            f"T5 {sizes['text_encoder_2']:.1f} GB), {'16x16' if args.tiny else '1024x1024'}, {args.steps} steps"
        )
    rows = []
    ref = _pipeline_of(built)
    got = measure(ref, args)
    ref_ms = got["timed"]["step_ms"]
    rows.append(row(work, "all on the GPU", got, None))
    print(rows[-1], flush=True)
    del ref, built, got
    if not args.tiny:
        free_cuda()
    for spec in args.budgets.split(","):
        rows.append(pager_row(host, args, spec, work, ref_ms, bw))
        print(rows[-1], flush=True)
    for kind in filter(None, args.peers.split(",")):
        rows.append(peer_row(host, args, kind, work, ref_ms))
        print(rows[-1], flush=True)
    save(rows, "bench_diffusion", env)


ARGS: argparse.Namespace = argparse.Namespace()  # (the command line: `pipeline` builds its models from it)

if __name__ == "__main__":
    main()
