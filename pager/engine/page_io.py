"""Pages' bytes in files: where they lie (`Piece`), the open files
(`Files`), reading a range into a page (`read_range`) and writing a page
crash-safe (`write_page`).

[Note: direct reads]
With `O_DIRECT` a read bypasses the kernel's page cache: it runs at the
drive's rate and takes no host memory beyond the budget. It needs the file
offset, the memory address and the length aligned to the logical block
(`DIRECT_ALIGN` covers 512 and 4096). A checkpoint's tensors start anywhere:
safetensors packs them after a JSON header, so most start 8 bytes past a
16-byte boundary or so. Their pages must not keep that: a page's layout is its
device copy's, and GPU kernels given a weight that is not 16-byte aligned take
slower paths (cuBLAS, seen on an H200: a Flux-shaped transformer loaded from
its files computed 1.49x as long as the same one wrapped in memory, 1537 vs
1033 ms of kernels, for the same bytes moved). So every tensor lies on an
`ALIGN_BYTES` boundary of its page (`layout_for_files` in base/block.py).
Where its file offset is one too (`in_place`), it sits at that offset modulo
`DIRECT_ALIGN` with a gap before and after: the aligned range around it is
read straight into the page, the bytes around it landing in the gaps. Any
other is read direct into the reading thread's bounce buffer
(`_read_bounced`, `BOUNCE_BYTES` at a time) and copied into place: one memcpy
of the bytes, on the IO threads. Where the filesystem refuses `O_DIRECT`
(tmpfs), or a tensor is not aligned to its dtype in the file, the read is
buffered (and the page cache is told to drop what it read).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import cast

import torch

from ..base.block import DIRECT_ALIGN, align_up
from ..base.files import CheckpointError, fsync_folder
from .arena import aligned_empty
from .file_cache import CacheProbe

log = logging.getLogger("pager")

DIRECT_MIN_BYTES = 256 << 10  # smaller tensors are read buffered, packed without gaps
CHUNK_BYTES = 16 << 20  # one read or write call (the kernel splits it into many device requests)


@dataclass
class Piece:
    """Where `nbytes` of a page (from `page_offset`) come from: a range of a
    file (`path`, `file_offset`), or a tensor (`tensor`: in host memory, or
    mapped from the file `path`)."""

    page_offset: int
    nbytes: int
    path: str | None = None
    file_offset: int = 0
    tensor: torch.Tensor | None = None
    name: str = ""  # the tensor's name, for errors
    padded: bool = False  # the page has room around it for an aligned (direct) read

    @property
    def lead(self) -> int | None:
        """Its file offset modulo DIRECT_ALIGN, if a direct read can place it
        (None: a tensor source, a small tensor, or an offset not aligned to its dtype)."""
        if (
            self.path is None
            or self.tensor is not None
            or self.file_offset % self.itemsize
            or self.nbytes < DIRECT_MIN_BYTES
        ):
            return None
        return self.file_offset % DIRECT_ALIGN

    itemsize: int = 1


class Files:
    """Open files: a direct (O_DIRECT) and a buffered descriptor per path, and
    a probe of what the page cache holds of it where direct reads work
    ([Note: files already in the page cache] in engine/file_cache.py)."""

    def __init__(self):
        self._fds: dict = {}
        self._lock = threading.Lock()

    def fds(self, path: str) -> list:
        """[direct descriptor or None, buffered descriptor, CacheProbe or None] of `path`."""
        with self._lock:
            fds = self._fds.get(path)
            if fds is None:
                buffered = os.open(path, os.O_RDONLY)
                try:
                    direct = (
                        os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) if hasattr(os, "O_DIRECT") else None
                    )
                except OSError:  # the filesystem refuses O_DIRECT (tmpfs)
                    direct = None
                probe = None
                if direct is not None:
                    probe = CacheProbe(buffered)
                    # Buffered reads are then of small tensors or of cached bytes: no read ahead, which
                    # would pull the next tensor's bytes into the cache (read again by it, and probed as
                    # partly held: [Note: files already in the page cache]).
                    os.posix_fadvise(buffered, 0, 0, os.POSIX_FADV_RANDOM)
                fds = self._fds[path] = [direct, buffered, probe]
            return fds

    def forget(self, path: str) -> None:
        """Close `path`'s descriptors: the file was replaced (a new spill of its page)."""
        with self._lock:
            _close(self._fds.pop(path, ()))

    def no_direct(self, path: str) -> None:
        with self._lock:
            fds = self._fds[path]
            if fds[0] is not None:
                os.close(fds[0])
                fds[0] = None

    def close(self) -> None:
        with self._lock:
            for fds in self._fds.values():
                _close(fds)
            self._fds.clear()


def _close(fds) -> None:
    direct, buffered, probe = fds or (None, None, None)
    for fd in (direct, buffered):
        if fd is not None:
            os.close(fd)
    if probe is not None:
        probe.close()


def _buffer(t: torch.Tensor, offset: int, nbytes: int):
    """A writable memoryview of `nbytes` of uint8 tensor `t` from `offset`."""
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr() + offset)).cast("B")


class ReadPath(enum.Enum):
    """How a range of a file came into a page."""

    DIRECT = "direct"  # O_DIRECT, past the page cache ([Note: direct reads])
    CACHED = "cached"  # from the page cache, which held it ([Note: files already in the page cache])
    BUFFERED = "buffered"  # through the page cache, which is told to drop it


def read_range(files: Files, page: torch.Tensor, piece: Piece, start: int, end: int) -> tuple[int, ReadPath]:
    """Fill bytes [start, end) of `piece` (relative to the piece) into `page`;
    returns the bytes read from files, and how."""
    if piece.tensor is not None:
        flat = piece.tensor.detach().reshape(-1).view(torch.uint8)
        page[piece.page_offset + start : piece.page_offset + end].copy_(flat[start:end])
        return (end - start if piece.path is not None else 0), ReadPath.BUFFERED  # (a mapped file's pages were read)
    path = cast(str, piece.path)  # (a piece without a tensor is a range of a file)
    direct, buffered, probe = files.fds(path)
    file_at, page_at = piece.file_offset + start, piece.page_offset + start
    lead = file_at % DIRECT_ALIGN
    cached = probe is not None and probe.holds(file_at, file_at + end - start)
    if cached:
        # In the page cache already: copied from memory, and left there ([Note: files already in the page cache]).
        _check_length(piece, _pread(buffered, page, page_at, end - start, file_at), end - start, file_at)
        return end - start, ReadPath.CACHED
    if direct is not None and (piece.padded or piece.lead is not None):
        # The aligned range around [start, end): straight into the page where its gaps take the extra
        # bytes, else through this thread's bounce buffer, copied to the page ([Note: direct reads]).
        in_page = piece.padded and (page.data_ptr() + page_at) % DIRECT_ALIGN == lead
        try:
            if in_page:
                got = _pread(direct, page, page_at - lead, align_up(lead + end - start), file_at - lead) - lead
            else:
                got = _read_bounced(direct, page, page_at, file_at, end - start)
        except OSError as e:
            if e.errno != 22:  # EINVAL: O_DIRECT accepted at open, refused at read
                raise
            files.no_direct(path)
            log.info("pager: %s refuses direct reads; reading it through the page cache", path)
        else:
            _check_length(piece, got, end - start, file_at)
            return end - start, ReadPath.DIRECT
    got = _pread(buffered, page, page_at, end - start, file_at)
    _check_length(piece, got, end - start, file_at)
    os.posix_fadvise(buffered, file_at, end - start, os.POSIX_FADV_DONTNEED)  # keep the budget honest
    return end - start, ReadPath.BUFFERED


BOUNCE_BYTES = 4 << 20  # a direct read through a bounce buffer, at most (one such buffer per IO thread)
_bounces = threading.local()


def _read_bounced(fd: int, page: torch.Tensor, page_at: int, file_at: int, nbytes: int) -> int:
    """Direct reads of the file's [file_at, file_at + nbytes) into this
    thread's bounce buffer, `BOUNCE_BYTES` at a time, each copied to the
    page at `page_at`; the bytes read (fewer where the file ends)."""
    buffer = getattr(_bounces, "buffer", None)
    if buffer is None:
        base = torch.empty(BOUNCE_BYTES + 2 * DIRECT_ALIGN, dtype=torch.uint8)
        skip = -base.data_ptr() % DIRECT_ALIGN
        buffer = _bounces.buffer = base[skip : skip + BOUNCE_BYTES + DIRECT_ALIGN]
    lead, done = file_at % DIRECT_ALIGN, 0
    while done < nbytes:
        n = min(BOUNCE_BYTES, nbytes - done)  # (done is a multiple of DIRECT_ALIGN: each read starts aligned)
        got = min(n, _pread(fd, buffer, 0, align_up(lead + n), file_at + done - lead) - lead)
        if got > 0:
            ctypes.memmove(page.data_ptr() + page_at + done, buffer.data_ptr() + lead, got)
            done += got
        if got < n:
            break
    return done


def _pread(fd: int, page: torch.Tensor, page_at: int, length: int, file_at: int) -> int:
    done = 0
    while done < length:
        n = os.preadv(fd, [_buffer(page, page_at + done, length - done)], file_at + done)
        if n == 0:
            break
        done += n
    return done


def _check_length(piece: Piece, got: int, wanted: int, file_at: int) -> None:
    if got < wanted:
        raise CheckpointError(
            f"pager: {piece.path!r}: reading {piece.name!r} at offset {file_at} gave {max(got, 0)} of "
            f"{wanted} bytes: the file ends early (it was truncated after it was opened)."
        )


def write_page(page: torch.Tensor, nbytes: int, path: str) -> None:
    """Write `nbytes` of `page` to `path`, crash-safe ([Note: crash-safe writes])."""
    tmp = path + ".tmp"
    length = align_up(nbytes)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(tmp, flags | getattr(os, "O_DIRECT", 0))
        direct = hasattr(os, "O_DIRECT")
    except OSError:
        fd, direct = os.open(tmp, flags), False
    try:
        done = 0
        while done < length:
            step = min(CHUNK_BYTES, length - done)
            try:
                done += os.pwritev(fd, [_buffer(page, done, step)], done)
            except OSError as e:
                if not direct or e.errno != 22:
                    raise
                os.close(fd)
                fd, direct = os.open(tmp, os.O_WRONLY), False
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_folder(os.path.dirname(path))


def read_rate(files, pool, path: str, nbytes: int) -> float:
    """GB/s of a sequential read of the first `nbytes` of `path` (direct
    reads of CHUNK_BYTES on `pool`'s IO threads, the page cache of that range
    dropped first: the rest of the file stays cached as it was)."""
    size = min(nbytes, os.path.getsize(path))
    fd = files.fds(path)[1]
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    local = threading.local()  # a scratch buffer per IO thread

    def read(at):
        if not hasattr(local, "buffer"):
            local.buffer = aligned_empty(CHUNK_BYTES)[1]
        n = min(CHUNK_BYTES, size - at)
        read_range(files, local.buffer, Piece(0, n, path, at, padded=True), 0, n)

    t0 = time.perf_counter()
    list(pool.map(read, range(0, size, CHUNK_BYTES)))
    return size / (time.perf_counter() - t0) / 1e9
