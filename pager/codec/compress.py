"""Compressed pages: a block's weights stored encoded in its host page and
decoded on the device after the copy, so that fewer bytes cross the link.

[Note: compressed pages]
Streamed inference runs at the link's speed, so the only way to go faster is
to move fewer bytes. `wrap(..., compress=...)` encodes each block's weights
page once, at wrap, into pieces of at most `PIECE_BYTES`:

    raw    bytes copied as they are (small tensors, integer buffers, 1-D
           norms and biases, and any tensor that does not compress)
    exp4   lossless bf16: per 16-bit word, one byte of sign and mantissa
           (`A`) and a 4-bit code of its 8-bit exponent (`B`, two per byte);
           the 15 most frequent exponents of the tensor have codes 0-14 (a
           16-byte table leads the piece), and every other word is an escape:
           code 15, its position and its whole value listed at the end of the
           piece. Trained weights use few exponents (a normal distribution
           puts all but ~1e-4 of its values within 15 octaves), so a piece
           takes 12 bits a word and a few escapes: 0.75x plus ~0.1%.
    fp8    lossy: float8 e4m3 with one float32 scale per `FP8_GROUP`
           consecutive elements (amax / 448): ~0.52x of bf16
    int4   lossy: 4-bit codes with a bf16 scale and minimum per `INT4_GROUP`
           consecutive elements (FlexGen's group-wise scheme): ~0.28x of bf16

Coded are floating tensors of two or more dimensions (weight matrices):
bf16 ones under lossless (if their exponents compress: under
`TENSOR_KEEP_RATIO` of their bytes with their own table), and under the
lossy codecs those of bf16, fp16 or fp32 whose values are all finite; the
rest of the block (norms, biases, integer buffers, data without structure)
is raw. Consecutive coded tensors of one dtype are coded as one run, the
zeros between them included (one table, one set of pieces: each piece costs
host work at every fetch). Groups run over the storage order, so a
transposed weight is encoded as it lies. A block whose page is over
`BLOCK_KEEP_RATIO` of its bytes stays a plain page (and fetches as before).

Splitting a large block into parts ([Note: splitting large blocks] in
model/discover.py) pays a block use's host work (~0.5 ms on the H100 host) for
each part; a compressed part copies so fast that this becomes the bound (a
7B-shaped forward of int4 parts ran at 76 ms, host-bound, against 35 ms with
whole layers). So with `compress=` a part is split off only if its page,
at the codec's usual ratio, is at least `PART_MIN_PAGE_BYTES` (~0.6 ms of
copying at 55 GB/s).

Decoding is exact integer work for exp4, and for the lossy codecs one
float32 multiply (fp8) or a multiply whose product is exact followed by one
add (int4: a 4-bit code times a bf16 scale fits float32's mantissa, so a fused
multiply-add rounds the same) and one rounding to the weight's dtype: the
CUDA kernels (`codec/kernels.py`) and the reference here give the same bits. Scales
and minimums are kept at or above 2**-100 (or zero), so no decode produces a
float32 subnormal that a kernel might flush to zero.

A compressed page is read-only. A block whose weights change (an optimizer
step, `load_state_dict`, BatchNorm statistics) is written back to a new plain
page when it leaves, and stays plain from then on (`HostTier.down`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CODECS = ("lossless", "fp8", "int4")
PIECE_BYTES = 32 << 20  # encoded bytes per piece, about (the unit of staging and decoding)
PIECE_ALIGN = 64
TENSOR_KEEP_RATIO = 0.9  # a tensor whose exp4 encoding is larger than this share of its bytes stays raw
BLOCK_KEEP_RATIO = 0.95  # a block whose encoded page is larger than this share of its bytes stays plain
MIN_ENCODED_ELEMENTS = 1024  # smaller tensors stay raw: their bytes do not matter
FP8_GROUP = 128
INT4_GROUP = 64
FP8_MAX = 448.0
LEAST_SCALE = 2.0**-100  # scales and minimums at least this (or 0): no subnormal in a decode
LOSSY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
USUAL_RATIO = {"lossless": 0.75, "fp8": 0.52, "int4": 0.28}  # page bytes per plain byte of bf16 weights
PART_MIN_PAGE_BYTES = 32 << 20  # the least page a part split off a block has under compression


def page_bytes_estimate(codec: str, t: torch.Tensor) -> int:
    """About the bytes `t` takes in a page under `codec` (its usual ratio if
    the codec codes it, else its own bytes): for plans, before encoding."""
    nbytes = t.numel() * t.element_size()
    coded = (
        t.dim() >= 2
        and t.numel() >= MIN_ENCODED_ELEMENTS
        and (t.dtype == torch.bfloat16 if codec == "lossless" else t.dtype in LOSSY_DTYPES)
    )
    if not coded:
        return nbytes
    return int(t.numel() * 2 * USUAL_RATIO[codec])  # (the ratio is per byte of bf16: 2 bytes an element)


def min_part_bytes(codec: str) -> int:
    """The least plain bytes of a part split off a block (see the Note)."""
    return int(PART_MIN_PAGE_BYTES / USUAL_RATIO[codec])


@dataclass(frozen=True)
class Piece:
    """One run of a page that decodes into one range of the device storage.

    Offsets (`at`) are within the piece: exp4 (B, positions, values), fp8
    (codes), int4 (minimums, codes); scales of the lossy codecs and exp4's
    table start the piece."""

    kind: str  # "raw", "exp4", "fp8", "int4"
    src: int  # where its bytes start in the page
    src_bytes: int
    dst: int  # where its decoded bytes go in the segment's storage
    dst_bytes: int
    n: int = 0  # elements it decodes (16-bit words for exp4)
    dtype: torch.dtype = torch.uint8  # the decoded elements' dtype
    escapes: int = 0
    at: tuple = ()


@dataclass
class Encoded:
    """A segment's page as stored: its pieces, in page order."""

    pieces: list
    page_bytes: int
    plain_bytes: int

    @property
    def staging_bytes(self) -> int:
        """The largest piece that is decoded (it is staged on the device first)."""
        return max((p.src_bytes for p in self.pieces if p.kind != "raw"), default=0)


def check_codec(compress) -> None:
    if compress is not None and compress not in CODECS:
        raise ValueError(
            f'pager: compress={compress!r} is not a codec; use None (plain pages), "lossless" (bf16 weights '
            f'in about 0.75x the bytes, decoded exactly), "fp8" (about 0.52x, lossy) or "int4" (about '
            f"0.28x, lossy)."
        )


def _align(n: int, to: int = 16) -> int:
    return (n + to - 1) // to * to


# ------------------------------------------------------------------ encoding
def encode(codec: str, slots, plain: torch.Tensor, device=None, keep_plain: frozenset = frozenset()):
    """Encode a segment's `plain` bytes (uint8, on the CPU; zeros between
    tensors) laid out by `slots`, computing on `device` (default: the CPU;
    same bytes on any; a GPU takes the segment's bytes once, no more than
    the block takes when it runs). Consecutive coded tensors of one dtype are
    coded as one run (with the zeros between them): fewer pieces, fewer
    launches. Returns (Encoded, page as a CPU uint8 tensor), or None if the
    page would not be smaller than `BLOCK_KEEP_RATIO` of the plain one.
    Slots named in `keep_plain` stay raw (quantized weights' inner tensors)."""
    there = plain.to(device) if device is not None else plain
    parts: list = []  # (Piece without src, [(offset in the piece, CPU uint8 tensor)])
    raw = None  # [start, end) of the current run of raw bytes in the storage
    run: list = []  # the current run of coded tensors: (slot, its exponent counts under lossless)
    for slot in slots:
        coded = None if slot.name in keep_plain else _coded(codec, slot, there[slot.offset : slot.offset + slot.nbytes])
        if coded is not None and not (run and run[0][0].dtype == slot.dtype):
            parts += _encode_run(codec, there, run)
            run = []
        if coded is not None:
            if raw is not None:
                parts += _raw_pieces(plain, *raw)
                raw = None
            run.append((slot, coded))
            continue
        parts += _encode_run(codec, there, run)
        run = []
        raw = [slot.offset, slot.offset + slot.nbytes] if raw is None else [raw[0], slot.offset + slot.nbytes]
    parts += _encode_run(codec, there, run)
    if raw is not None:
        parts += _raw_pieces(plain, *raw)
    pieces, offset = [], 0
    for piece, _chunks in parts:
        offset = _align(offset, PIECE_ALIGN)
        pieces.append(_with_src(piece, offset))
        offset += piece.src_bytes
    if offset > BLOCK_KEEP_RATIO * plain.numel():
        return None
    page = torch.zeros(max(offset, 1), dtype=torch.uint8)
    for piece, (_p, chunks) in zip(pieces, parts):
        at = piece.src
        for offset_in_piece, chunk in chunks:
            page[at + offset_in_piece : at + offset_in_piece + chunk.numel()].copy_(chunk)
    return Encoded(pieces, offset, plain.numel()), page


def _with_src(piece: Piece, src: int) -> Piece:
    return Piece(
        piece.kind, src, piece.src_bytes, piece.dst, piece.dst_bytes, piece.n, piece.dtype, piece.escapes, piece.at
    )


def _raw_pieces(plain, start: int, end: int) -> list:
    out = []
    for a in range(start, end, PIECE_BYTES):
        b = min(end, a + PIECE_BYTES)
        out.append((Piece("raw", 0, b - a, a, b - a), [(0, plain[a:b])]))
    return out


def _coded(codec, slot, region):
    """None if one tensor stays raw, else what its coding needs (its exponent
    counts under lossless). Coded: a floating matrix (2 or more dimensions)
    of `MIN_ENCODED_ELEMENTS` or more; for lossless, bf16 whose exponents
    compress (under `TENSOR_KEEP_RATIO` with its own table); for the lossy
    codecs, with finite values."""
    n = slot.nbytes // slot.dtype.itemsize
    if n < MIN_ENCODED_ELEMENTS or len(slot.shape) < 2:
        return None
    if codec == "lossless":
        if slot.dtype != torch.bfloat16:
            return None
        counts = torch.bincount(_exponents(region.view(torch.int16)), minlength=256)
        escapes = n - int(counts.sort(descending=True).values[:15].sum())
        return counts if 1.5 * n + 6 * escapes <= TENSOR_KEEP_RATIO * slot.nbytes else None
    finite = slot.dtype in LOSSY_DTYPES and bool(torch.isfinite(region.view(slot.dtype)).all())
    return True if finite else None


def _exponents(words: torch.Tensor) -> torch.Tensor:
    return ((words >> 7) & 0xFF).to(torch.uint8)  # (16-bit operations: int32 ones are slower)


def _encode_run(codec, there, run: list) -> list:
    """Pieces of a run of coded tensors of one dtype (none for an empty run);
    `there`: the segment's bytes on the device that computes."""
    if not run:
        return []
    start, end = run[0][0].offset, run[-1][0].offset + run[-1][0].nbytes
    region = there[start:end]
    if codec == "lossless":
        # The zeros between the tensors are exponent 0: counted with them.
        counts = sum(c for _s, c in run)  # (a new tensor: the tensors' own stay as they are)
        gaps = (end - start) // 2 - sum(s.nbytes // 2 for s, _c in run)
        counts[0] += gaps
        pieces = _exp4(region.view(torch.int16), start, counts)
        if len(run) > 1 and sum(p.src_bytes for p, _c in pieces) > TENSOR_KEEP_RATIO * (end - start):
            # One table does not fit them all (exponent ranges apart): a table each.
            return [piece for one in run for piece in _encode_run(codec, there, [one])]
        return pieces
    x = region.view(run[0][0].dtype).float()
    return _fp8(x, run[0][0].dtype, start) if codec == "fp8" else _int4(x, run[0][0].dtype, start)


def _exp4(words: torch.Tensor, dst: int, counts: torch.Tensor) -> list:
    """Pieces of exp4 words; `counts`: how often each exponent occurs in them."""
    exponent = _exponents(words)
    often = counts.tolist()
    top = sorted(range(256), key=lambda e: (-often[e], e))[:15]
    code_of = torch.full((256,), 15, dtype=torch.uint8, device=words.device)
    code_of[torch.tensor(top, device=words.device)] = torch.arange(15, dtype=torch.uint8, device=words.device)
    table = torch.tensor(top + [0], dtype=torch.uint8)
    per_piece = PIECE_BYTES * 2 // 3 // 2 * 2  # words: 1.5 bytes each (even, so B bytes are whole)
    out = []
    for k0 in range(0, words.numel(), per_piece):
        w = words[k0 : k0 + per_piece]
        n = w.numel()
        codes = torch.index_select(code_of, 0, exponent[k0 : k0 + n].int())
        a = (((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8)
        padded = torch.cat([codes, codes.new_zeros(n % 2)])
        b = padded[0::2] | (padded[1::2] << 4)
        where = (codes == 15).nonzero().flatten()
        positions, values = where.to(torch.int32), w[where]
        e = where.numel()
        b_at = _align(16 + n)
        pos_at = _align(b_at + b.numel())
        val_at = _align(pos_at + 4 * e)
        size = _align(val_at + 2 * e)
        chunks = [
            (0, table),
            (16, a.cpu()),
            (b_at, b.cpu()),
            (pos_at, positions.cpu().view(torch.uint8)),
            (val_at, values.cpu().view(torch.uint8)),
        ]
        out.append((Piece("exp4", 0, size, dst + 2 * k0, 2 * n, n, torch.bfloat16, e, (b_at, pos_at, val_at)), chunks))
    return out


def _groups(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` (flat) as rows of `size`, the last row padded with its last value."""
    pad = -x.numel() % size
    if pad:
        x = torch.cat([x, x[-1:].expand(pad)])
    return x.view(-1, size)


def _pieces_of_groups(n: int, group: int, bytes_per_group: int):
    """(first element, elements) of each piece of `n` elements in groups of `group`."""
    per_piece = max(1, PIECE_BYTES // bytes_per_group) * group
    return [(k0, min(n, k0 + per_piece) - k0) for k0 in range(0, n, per_piece)]


def _fp8(x: torch.Tensor, dtype: torch.dtype, dst: int) -> list:
    g = _groups(x, FP8_GROUP)
    # (Multiplications by constants, never a division by a scalar: CUDA turns
    # that into a multiplication by its reciprocal, which rounds otherwise.)
    scale = (g.abs().amax(dim=1) * (1.0 / FP8_MAX)).clamp_min(LEAST_SCALE)
    q = (g / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten()
    out, size = [], dtype.itemsize
    for k0, n in _pieces_of_groups(x.numel(), FP8_GROUP, FP8_GROUP + 4):
        groups = -(-n // FP8_GROUP)
        s = scale[k0 // FP8_GROUP : k0 // FP8_GROUP + groups]
        q_at = _align(4 * groups)
        chunks = [(0, s.cpu().view(torch.uint8)), (q_at, q[k0 : k0 + n].cpu().view(torch.uint8))]
        out.append((Piece("fp8", 0, _align(q_at + n), dst + k0 * size, n * size, n, dtype, at=(q_at,)), chunks))
    return out


def _int4(x: torch.Tensor, dtype: torch.dtype, dst: int) -> list:
    g = _groups(x, INT4_GROUP)
    low, high = g.amin(dim=1), g.amax(dim=1)
    minimum = low.to(torch.bfloat16)
    minimum = torch.where(minimum.float().abs() < LEAST_SCALE, torch.zeros_like(minimum), minimum)
    scale = ((high - low) * (1.0 / 15)).to(torch.bfloat16)
    scale = torch.where(high == low, torch.ones_like(scale), scale.float().clamp_min(LEAST_SCALE).to(torch.bfloat16))
    codes = torch.round((g - minimum.float()[:, None]) / scale.float()[:, None]).clamp(0, 15).to(torch.uint8)
    codes = codes.flatten()[: x.numel()]
    padded = torch.cat([codes, codes.new_zeros(codes.numel() % 2)])
    packed = padded[0::2] | (padded[1::2] << 4)
    out, size = [], dtype.itemsize
    for k0, n in _pieces_of_groups(x.numel(), INT4_GROUP, INT4_GROUP // 2 + 4):
        groups = -(-n // INT4_GROUP)
        first = k0 // INT4_GROUP
        min_at = _align(2 * groups)
        q_at = _align(min_at + 2 * groups)
        chunks = [
            (0, scale[first : first + groups].cpu().view(torch.uint8)),
            (min_at, minimum[first : first + groups].cpu().view(torch.uint8)),
            (q_at, packed[k0 // 2 : k0 // 2 + (n + 1) // 2].cpu()),
        ]
        out.append(
            (
                Piece("int4", 0, _align(q_at + (n + 1) // 2), dst + k0 * size, n * size, n, dtype, at=(min_at, q_at)),
                chunks,
            )
        )
    return out


# ------------------------------------------------------------------ decoding
def decode(page: torch.Tensor, encoded: Encoded, out: torch.Tensor) -> None:
    """Decode the whole `page` into `out` (uint8, the segment's bytes), with
    the reference decoder (torch operations, on `out`'s device)."""
    for piece in encoded.pieces:
        decode_piece(page[piece.src : piece.src + piece.src_bytes], piece, out[piece.dst : piece.dst + piece.dst_bytes])


def decode_piece(src: torch.Tensor, piece: Piece, dst: torch.Tensor) -> None:
    """The reference decoder of one piece: `src` its bytes, `dst` the bytes it decodes to."""
    src = src.to(dst.device, non_blocking=True)
    if piece.kind == "raw":
        dst.copy_(src)
    elif piece.kind == "exp4":
        b_at, pos_at, val_at = piece.at
        n = piece.n
        a = src[16 : 16 + n].to(torch.int16)
        b = src[b_at : b_at + (n + 1) // 2]
        codes = torch.stack([b & 15, b >> 4], dim=1).flatten()[:n]
        exponent = torch.index_select(src[:16].to(torch.int16), 0, codes.int())
        words = dst.view(torch.int16)
        torch.bitwise_or(((a & 0x80) << 8) | (exponent << 7), a & 0x7F, out=words)
        if piece.escapes:
            positions = src[pos_at : pos_at + 4 * piece.escapes].view(torch.int32).long()
            words[positions] = src[val_at : val_at + 2 * piece.escapes].view(torch.int16)
    elif piece.kind == "fp8":
        (q_at,) = piece.at
        n, groups = piece.n, -(-piece.n // FP8_GROUP)
        scale = src[: 4 * groups].view(torch.float32).repeat_interleave(FP8_GROUP)[:n]
        q = src[q_at : q_at + n].view(torch.float8_e4m3fn).float()
        dst.view(piece.dtype).copy_((q * scale).to(piece.dtype))
    else:  # int4
        min_at, q_at = piece.at
        n, groups = piece.n, -(-piece.n // INT4_GROUP)
        scale = src[: 2 * groups].view(torch.bfloat16).float().repeat_interleave(INT4_GROUP)[:n]
        minimum = src[min_at : min_at + 2 * groups].view(torch.bfloat16).float().repeat_interleave(INT4_GROUP)[:n]
        packed = src[q_at : q_at + (n + 1) // 2]
        codes = torch.stack([packed & 15, packed >> 4], dim=1).flatten()[:n].float()
        dst.view(piece.dtype).copy_((codes * scale + minimum).to(piece.dtype))


def decoded_copy(page: torch.Tensor, encoded: Encoded) -> torch.Tensor:
    """The segment's plain bytes, decoded on the CPU (a new uint8 tensor;
    gaps between tensors are zeros)."""
    out = torch.zeros(encoded.plain_bytes, dtype=torch.uint8)
    decode(page, encoded, out)
    return out
