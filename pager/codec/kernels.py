"""Pager's GPU kernels (Triton) for compressed pages (the row path's are in
rows/kernels.py).

Decoders ([Note: compressed pages] in codec/compress.py): each piece is decoded
by one kernel launch from its staged bytes into its range of the block's
device storage, bit for bit what the reference decoder in `codec/compress.py`
gives. Without Triton (or for fp8 on a GPU older than sm_89,
which has no fp8 conversion), the reference decoder runs on the device instead:
correct, slower, and with temporaries.
"""

from __future__ import annotations

import torch

from .compress import FP8_GROUP, INT4_GROUP, Encoded, Piece, decode_piece, decoded_copy

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch, or no Triton: the reference decoder, torch ops
    triton = None

BLOCK = 2048


def decode_on_device(src: torch.Tensor, piece: Piece, dst: torch.Tensor, fp8_kernels: bool | None = None) -> None:
    """Decode `piece` from `src` (its staged bytes on the device) into `dst`
    (its bytes of the storage), on the current stream. `fp8_kernels`: the
    device converts fp8 (sm_89 or later; None: ask it)."""
    if piece.kind == "fp8" and fp8_kernels is None:
        fp8_kernels = torch.cuda.get_device_capability(dst.device) >= (8, 9)
    if triton is None or (piece.kind == "fp8" and not fp8_kernels):
        decode_piece(src, piece, dst)
        return
    n = piece.n
    if piece.kind == "exp4":
        b_at, pos_at, val_at = piece.at
        main = triton.cdiv(n, BLOCK)
        _exp4[(main + triton.cdiv(piece.escapes, BLOCK),)](
            src, dst.view(torch.int16), n, piece.escapes, b_at, pos_at, val_at, main, BLOCK=BLOCK
        )
    elif piece.kind == "fp8":
        _fp8[(triton.cdiv(n, BLOCK),)](src, dst.view(piece.dtype), n, piece.at[0], GROUP=FP8_GROUP, BLOCK=BLOCK)
    elif piece.kind == "int4":
        _int4[(triton.cdiv(n, BLOCK),)](
            src, dst.view(piece.dtype), n, piece.at[0], piece.at[1], GROUP=INT4_GROUP, BLOCK=BLOCK
        )
    else:
        dst.copy_(src)


def decoded_copy_from(page: torch.Tensor, encoded: Encoded, device: torch.device) -> torch.Tensor:
    """The segment's plain bytes as a new CPU uint8 tensor, decoded on
    `device`: on a GPU a piece at a time (device memory for two pieces), on
    the current stream."""
    if device.type != "cuda":
        return decoded_copy(page, encoded)
    out = torch.zeros(encoded.plain_bytes, dtype=torch.uint8)
    for piece in encoded.pieces:
        staged = page[piece.src : piece.src + piece.src_bytes].to(device)
        decoded = torch.empty(piece.dst_bytes, dtype=torch.uint8, device=device)
        decode_on_device(staged, piece, decoded)
        out[piece.dst : piece.dst + piece.dst_bytes].copy_(decoded)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["n", "escapes", "b_at", "pos_at", "val_at", "main"])
    def _exp4(src, dst, n, escapes, b_at, pos_at, val_at, main, BLOCK: tl.constexpr):
        # Programs [0, main) decode words, skipping escapes; the rest write
        # the escapes' values (disjoint stores: no order between them needed).
        pid = tl.program_id(0)
        if pid < main:
            i = pid * BLOCK + tl.arange(0, BLOCK)
            inside = i < n
            a = tl.load(src + 16 + i, mask=inside, other=0).to(tl.int32)
            b = tl.load(src + b_at + (i >> 1), mask=inside, other=0).to(tl.int32)
            code = (b >> ((i & 1) * 4)) & 15
            exponent = tl.load(src + code).to(tl.int32)  # the table leads the piece
            word = ((a & 0x80) << 8) | (exponent << 7) | (a & 0x7F)
            tl.store(dst + i, word.to(tl.int16), mask=inside & (code != 15))
        else:
            j = (pid - main) * BLOCK + tl.arange(0, BLOCK)
            inside = j < escapes
            where = tl.load((src + pos_at).to(tl.pointer_type(tl.int32)) + j, mask=inside, other=0)
            value = tl.load((src + val_at).to(tl.pointer_type(tl.int16)) + j, mask=inside, other=0)
            tl.store(dst + where, value, mask=inside)

    @triton.jit(do_not_specialize=["n", "q_at"])
    def _fp8(src, dst, n, q_at, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        q = tl.load(src + q_at + i, mask=inside, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load(src.to(tl.pointer_type(tl.float32)) + i // GROUP, mask=inside, other=0.0)
        tl.store(dst + i, (q * scale).to(dst.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["n", "min_at", "q_at"])
    def _int4(src, dst, n, min_at, q_at, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        packed = tl.load(src + q_at + (i >> 1), mask=inside, other=0).to(tl.int32)
        code = ((packed >> ((i & 1) * 4)) & 15).to(tl.float32)
        scale = tl.load(src.to(tl.pointer_type(tl.bfloat16)) + i // GROUP, mask=inside, other=0.0).to(tl.float32)
        minimum = tl.load((src + min_at).to(tl.pointer_type(tl.bfloat16)) + i // GROUP, mask=inside, other=0.0).to(
            tl.float32
        )
        # code * scale is exact (4 bits times 8), so a fused multiply-add rounds as the reference does.
        tl.store(dst + i, (code * scale + minimum).to(dst.dtype.element_ty), mask=inside)
