"""Which bytes of a file the kernel's page cache holds now: `CacheProbe`.

[Note: files already in the page cache]
Pages are read from checkpoint files past the page cache (`O_DIRECT`,
[Note: direct reads] in engine/page_io.py), so that a model larger than host
RAM is read at the drive's rate and leaves no second copy in the cache. But
the files a user has just downloaded, saved or loaded are usually in the page
cache already. A direct read of those goes back to the drive for bytes that
memory already holds: a 6.5 GB folder just written took 5.3 s to read
(1.2 GB/s) on the H100's host, while a buffered read copies cached bytes at
memory speed.

So before each chunk is read, `mincore` over a mapping of its file asks
whether the cache holds every page of the chunk. If it does, the chunk is
read buffered and left in the cache as it was found; if not, it is read
direct. The mapping is never touched (no faults, no resident memory). The
answer is for the moment of asking: a page evicted between the question and
the read is read from the drive through the cache, which is still correct.

Where the answer is not available the chunk is read direct, as before: not
Linux, a file that cannot be mapped, or a file the process may not write. For
the last case, Linux (since 5.0) answers only for files the caller owns or
may write, and otherwise reports just the pages of its own mappings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

_PAGE_BYTES = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc: ctypes.CDLL | bool | None = None  # (False: looked for and not there)


def _c_library():
    """libc with `mmap`, `mincore` and `munmap` typed, or None (not Linux)."""
    global _libc
    if _libc is None:
        path = ctypes.util.find_library("c") if os.name == "posix" else None
        lib = ctypes.CDLL(path, use_errno=True) if path else None
        if lib is None or not hasattr(lib, "mincore"):
            _libc = False
        else:
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _libc = lib
    return _libc if isinstance(_libc, ctypes.CDLL) else None


class CacheProbe:
    """A read-only mapping of one file, used only to ask which of its bytes
    the page cache holds ([Note: files already in the page cache]).

    Args:
        fd: a descriptor open on the file for reading.
    """

    def __init__(self, fd: int):
        self.size_bytes = os.fstat(fd).st_size
        self._address: int | None = None
        libc = _c_library()
        if libc is None or not self.size_bytes:
            return
        address = libc.mmap(None, self.size_bytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address not in (None, _MAP_FAILED):
            self._address = address

    def holds(self, start: int, end: int) -> bool:
        """The cache holds every page of bytes [start, end) of the file now."""
        if self._address is None or not 0 <= start < end <= self.size_bytes:
            return False
        first = start - start % _PAGE_BYTES
        pages = -(-(end - first) // _PAGE_BYTES)
        resident = bytearray(pages)
        libc = _c_library()
        if libc is None or libc.mincore(
            self._address + first, end - first, (ctypes.c_ubyte * pages).from_buffer(resident)
        ):
            return False
        return bool(np.all(np.frombuffer(resident, dtype=np.uint8) & 1))  # (bit 0: resident; the rest reserved)

    def close(self) -> None:
        libc = _c_library()
        if self._address is not None and libc is not None:
            libc.munmap(self._address, self.size_bytes)
        self._address = None
