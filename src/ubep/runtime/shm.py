"""POSIX shared-memory segments: the global address space of the runtime.

Each rank creates one segment per object that needs shared memory (the group, each Buffer) and
maps every peer's. Creation is ``os.open`` on ``/dev/shm`` with ``O_CREAT | O_EXCL | O_NOFOLLOW``
and mode 0600 under an unguessable name ``ubep-<32 hex>``; a peer that maps it checks, on the
open file, that it is a regular file owned by this user with mode 0600 and exactly the size it
expects, and then the header (magic, version, group id, owner rank, size) before trusting any
byte. Every rank unlinks every name of an object (and its marker) as soon as every peer has
mapped it (after the barrier that follows the mapping; :func:`forget_segment`), so a crash
afterwards leaves nothing behind, whichever rank dies; before that, the name is recorded (with
the creating process) in a marker file in the (private) rendezvous directory, so that whoever
outlives the creator can remove it: the launcher, its reaper process
(:mod:`ubep.runtime.reaper`) or a peer rank, which sweeps the markers of dead creators while it
waits on the control plane, when a set-up fails and when it closes its group.

Header (first 256 bytes, little-endian)::

    0  magic    u64  b"UBEPSEG1"
    8  version  u32
    12 owner    u32  owner rank
    16 size     u64  total bytes of the segment
    24 pid      u64  owner process id
    32 group    16 bytes, the group id
    48 kind     16 bytes, ASCII, zero padded ("group", "buffer")
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError, UbepError
from ..plane.records import HEADER, HEADER_BYTES
from .reaper import (
    forget_segment,
    remove_dead_owners_segments,
    remove_marked_segments,
    valid_segment_name,
    write_marker,
)

__all__ = [
    "HEADER_BYTES",
    "SHM_DIR",
    "Segment",
    "forget_segment",
    "new_segment_name",
    "remove_dead_owners_segments",
    "remove_marked_segments",
]

SHM_DIR = "/dev/shm"
MAGIC = b"UBEPSEG1"
VERSION = 1
_PAGE = mmap.PAGESIZE
# Linux >= 5.14; populates page tables (and allocates) without writing a byte.
_MADV_POPULATE_WRITE = 23


def new_segment_name() -> str:
    """An unguessable segment name (128 random bits)."""
    return f"ubep-{secrets.token_hex(16)}"


@dataclass(frozen=True)
class _Header:
    owner: int
    size: int
    pid: int
    group: bytes
    kind: str


class Segment:
    """One mapped shared-memory segment (owned or a peer's).

    Attributes:
        name: the ``/dev/shm`` name (without the directory).
        size: bytes mapped.
        owner: the rank that created it.
        array: the whole mapping as a writable ``uint8`` numpy array.
        address: virtual address of byte 0 in this process.
    """

    def __init__(self, name: str, fd: int, size: int, owner: int, created: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self.created = created
        self.unlinked = not created
        self.markers: list[str] = []  # the files that name it until it is unlinked
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)

    # --- construction -------------------------------------------------------------------

    @classmethod
    def create(
        cls, size_bytes: int, *, group_id: bytes, owner_rank: int, kind: str,
        marker_dir: str | None = None, reaper_dir: str | None = None,
    ) -> Segment:
        """Create, size, stamp and pre-fault a new segment owned by this process; its name is
        recorded first in ``marker_dir`` (for the peers' sweeps) and in ``reaper_dir`` (the
        private directory of this process's own reaper, where a job may remove ``marker_dir``
        before anyone swept it)."""
        if size_bytes < HEADER_BYTES:
            raise InvalidArgumentError("size_bytes", size_bytes, f"must be >= {HEADER_BYTES}")
        size = -(-size_bytes // _PAGE) * _PAGE
        name = new_segment_name()
        # Record the name first: if this process dies before unlinking, others can.
        markers = [write_marker(d, name) for d in (marker_dir, reaper_dir) if d is not None]
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        seg = cls(name, fd, size, owner_rank, created=True)
        assert seg._mm is not None
        seg.markers = markers
        # Stamped before the pre-fault (which keeps every byte): a big segment takes a while to
        # fault in, and a reader of headers (a leak check of another job) must see its owner
        # all that time, not an ownerless segment to remove.
        HEADER.pack_into(
            seg._mm, 0, MAGIC, VERSION, owner_rank, size, os.getpid(), _pad(group_id, 16),
            _pad(kind.encode(), 16),
        )
        seg.prefault()
        return seg

    @classmethod
    def open_peer(
        cls, name: str, *, size_bytes: int, group_id: bytes, owner_rank: int, kind: str
    ) -> Segment:
        """Map a peer's segment after checking file ownership, mode, size and header."""
        if not _valid_name(name):
            raise UbepError(f"rank {owner_rank} published a malformed segment name {name!r}")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            size = -(-size_bytes // _PAGE) * _PAGE
            problem = _check_stat(st, size)
            if problem:
                raise UbepError(f"segment {name} of rank {owner_rank} rejected: {problem}")
        except BaseException:
            os.close(fd)
            raise
        seg = cls(name, fd, size, owner_rank, created=False)
        try:
            hdr = seg.header()
            want = _Header(owner_rank, size, hdr.pid, _pad(group_id, 16), kind)
            if hdr != want:
                raise UbepError(
                    f"segment {name} of rank {owner_rank} has header {hdr}, expected {want}"
                )
            seg.prefault()
        except BaseException:
            seg.close()
            raise
        return seg

    # --- use ----------------------------------------------------------------------------

    def header(self) -> _Header:
        assert self._mm is not None
        magic, version, owner, size, pid, group, kind = HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC or version != VERSION:
            raise UbepError(f"segment {self.name}: bad magic/version {magic!r}/{version}")
        return _Header(owner, size, pid, group, kind.rstrip(b"\0").decode("ascii", "replace"))

    def prefault(self) -> None:
        """Map every page now: a first touch inside an operation costs ~7x a warm copy."""
        assert self._mm is not None
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError, AttributeError):
            # Older kernels: touch one byte per page (reads would map the zero page only).
            view = self.array[::_PAGE]
            view[:] = view

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid in every process that has it)."""
        if not self.unlinked:
            self.unlinked = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))
            for marker in self.markers:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(marker)

    def close(self) -> None:
        """Unlink if still named, then unmap (views into the mapping must be gone by then;
        if some are still alive the mapping is left to the garbage collector)."""
        self.unlink()
        mm, self._mm = self._mm, None
        if mm is None:
            return
        self.array = np.zeros(0, dtype=np.uint8)
        # A caller may still hold a view (e.g. a recv_x): then it is unmapped when dropped.
        with contextlib.suppress(BufferError):
            mm.close()

    @property
    def closed(self) -> bool:
        return self._mm is None


def _pad(raw: bytes, width: int) -> bytes:
    if len(raw) > width:
        raise InvalidArgumentError("id", raw, f"must be at most {width} bytes")
    return raw.ljust(width, b"\0")


def _valid_name(name: str) -> bool:
    return valid_segment_name(name)


def _check_stat(st: os.stat_result, size: int) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not {os.getuid()}"
    if stat.S_IMODE(st.st_mode) != 0o600:
        return f"mode {stat.S_IMODE(st.st_mode):o}, expected 600"
    if st.st_size != size:
        return f"size {st.st_size}, expected {size}"
    return ""
