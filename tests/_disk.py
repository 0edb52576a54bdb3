"""A small real filesystem for fault tests: ``small_disk(size)`` mounts a tmpfs of ``size``
bytes and returns its path; ``fill(path, leave)`` fills it up. A full disk is then a real
ENOSPC from ``write`` (and a real SIGBUS for a store into a memory-mapped page it cannot back),
not a monkeypatched ``OSError``: that once hid that a full disk killed every rank.

Mounting needs root or CAP_SYS_ADMIN (CI runs as root): elsewhere the tests that use it are
skipped with that reason; where the ``CI`` variable is set they fail instead, so CI never
passes them by skipping."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

MNT_DETACH = 2


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def mount_tmpfs(path: str, size: int) -> None:
    """Mount a tmpfs of ``size`` bytes (rounded up to pages) on the directory ``path``; skip
    the test (fail it under CI) when this process may not mount."""
    libc = _libc()
    opts = f"size={int(size)},mode=0755".encode()
    if libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, opts) != 0:
        code = ctypes.get_errno()
        why = (
            f"mounting a tmpfs needs root or CAP_SYS_ADMIN ({errno.errorcode.get(code, code)}: "
            f"{os.strerror(code)}): the real full-disk tests run where CI runs them, as root"
        )
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


def unmount(path: str) -> None:
    """Detach the filesystem at ``path`` (lazily: a process still holding a file there cannot
    keep the mount)."""
    if _libc().umount2(os.fsencode(path), MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"umount {path}: {os.strerror(code)}")


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: str, leave: int = 0, name: str = "ballast") -> str:
    """Fill the filesystem of the directory ``path`` with the file ``path/name`` until ``leave``
    bytes (rounded down to blocks) are free; returns that file's path (remove it to free the
    space again). Another process writing there meanwhile is fine: what it took is measured
    again, and the file grows by what is left."""
    block = os.statvfs(path).f_frsize
    ballast = os.path.join(path, name)
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for _ in range(100):
            size = (free_bytes(path) - leave) // block * block
            if size <= 0:
                break
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, size)
            except OSError as e:  # (a block taken since it was measured)
                if e.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
    assert free_bytes(path) <= max(leave, 0) + block, (free_bytes(path), leave)
    return ballast


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size, name="disk")``: a tmpfs of ``size`` bytes mounted at
    ``tmp_path/name``, its path returned; unmounted when the test ends."""
    mounted: list[str] = []

    def mount(size: int, name: str = "disk") -> str:
        path = tmp_path / name
        path.mkdir()
        mount_tmpfs(str(path), size)
        mounted.append(str(path))
        return str(path)

    yield mount
    for path in reversed(mounted):
        unmount(path)
