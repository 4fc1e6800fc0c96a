"""Generate an image with a diffusers pipeline larger than the budget.

`pager.wrap(pipe, budget=...)` pages every model of the pipeline (the text
encoders, the transformer, the VAE) under one budget: the text encoders come
in for the prompt and give way, the transformer's blocks stay or stream
through the denoising steps, the VAE comes in at the end.

With `--folder`, a pipeline saved by diffusers' `save_pretrained` (a
`model_index.json` and a folder per component, e.g. a FLUX.1-dev download)
is loaded by `pager.from_pretrained`, each model paged from its own files.
Without it, a small Flux-shaped pipeline is built from configs with random
weights (and a stand-in byte tokenizer: nothing is downloaded): on the CPU
device its image is checked bit for bit against the unwrapped pipeline's.

    pip install diffusers transformers
    python examples/generate_image.py [--folder FLUX.1-dev] [--budget 8GiB] [--steps 28] [--out cat.png]

The file stands alone: after `pip install pager` it runs from any folder.
Without diffusers or transformers it says so and exits (status 0).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import pager


class ByteTokens:
    """A stand-in tokenizer for the random pipeline: a prompt's bytes, padded."""

    added_tokens_encoder: dict = {}

    def __init__(self, max_length: int):
        self.model_max_length = max_length

    def __call__(self, text, max_length=None, return_tensors=None, **_kw):
        from transformers import BatchEncoding

        text = [text] if isinstance(text, str) else list(text)
        n = max_length or self.model_max_length
        rows = [[b % 98 + 2 for b in t.encode()][:n] for t in text]
        ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
        return BatchEncoding({"input_ids": ids, "attention_mask": (ids != 0).long()})

    def tokenize(self, text):
        return list(text)

    def batch_decode(self, ids, **_kw):
        return ["" for _ in ids]


def small_flux():
    """A Flux-shaped pipeline built from configs, random weights (fp32)."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=4, num_single_layers=8, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=128, pooled_projection_dim=64, axes_dims_rope=[8, 12, 12],
    )  # fmt: skip
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=100, d_model=128, d_kv=32, d_ff=256, num_layers=4, num_heads=4)
    )
    clip = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
            projection_dim=64, bos_token_id=0, eos_token_id=2, pad_token_id=1,
        )
    )  # fmt: skip
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32,), layers_per_block=1,
        norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611,
    )  # fmt: skip
    models = dict(transformer=transformer, text_encoder_2=t5, text_encoder=clip, vae=vae)
    for m in models.values():
        m.eval()
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        tokenizer=ByteTokens(77),
        tokenizer_2=ByteTokens(64),
        **models,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", help="a diffusers pipeline folder (save_pretrained's)")
    ap.add_argument("--budget", help="the device memory for the whole pipeline (default: half its models' bytes)")
    ap.add_argument("--prompt", default="a photograph of a cat on a mat")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, help="height and width (default: 1024 from a folder, 32 otherwise)")
    ap.add_argument("--out", help="save the image here (a .png)")
    args = ap.parse_args()
    try:
        import diffusers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"skipped: this example needs diffusers and transformers: pip install diffusers transformers ({e})")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    call = dict(num_inference_steps=args.steps, guidance_scale=3.5, generator=torch.Generator().manual_seed(0))
    ref = None
    t0 = time.perf_counter()
    if args.folder:
        pipe = pager.from_pretrained(args.folder, budget=args.budget or "8GiB", device=device)
        size = args.size or 1024
    else:
        pipe = small_flux()
        size = args.size or 32
        call["max_sequence_length"] = 64
        models = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
        total = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
        if device == "cpu":
            ref = copy.deepcopy(pipe)  # (the unwrapped pipeline, to check the image against)
        pager.wrap(pipe, budget=args.budget or total // 2, device=device)
    print(f"wrapped in {time.perf_counter() - t0:.1f} s: {pager.of(pipe)!r}")
    t0 = time.perf_counter()
    image = pipe(args.prompt, height=size, width=size, output_type="np", **call).images
    print(f"{size}x{size}, {args.steps} steps in {time.perf_counter() - t0:.1f} s")
    print(pager.of(pipe).report())
    if ref is not None:
        call["generator"] = torch.Generator().manual_seed(0)
        want = ref(args.prompt, height=size, width=size, output_type="np", **call).images
        print(f"equal to the unwrapped pipeline, bit for bit: {bool((image == want).all())}")
    if args.out:
        from PIL import Image

        Image.fromarray((image[0] * 255).round().astype("uint8")).save(args.out)
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
