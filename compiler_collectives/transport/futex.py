"""Futex primitives: sleep in the kernel on a 32-bit word of a shared mapping, and wake its sleepers.

The wait protocol (``shm``) sleeps here once spinning and yielding did not
bring the word it waits for, and a publisher wakes the ranks asleep on a word
it stored. Only Linux on x86-64 and AArch64 (``Futex.available``); elsewhere
the wait protocol yields instead.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from typing import ClassVar


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """FUTEX_WAIT / FUTEX_WAKE on 32-bit words of a shared mapping.

    Not the private variants: the waiters are other processes. Each call is a
    ctypes call into libc's ``syscall``, which releases the GIL while it sleeps.
    """

    _NUMBERS: ClassVar[dict[str, int]] = {"x86_64": 202, "aarch64": 98}  # SYS_futex
    _WAIT, _WAKE = 0, 1

    def __init__(self, sleep_s: float) -> None:
        self._number = self._NUMBERS[platform.machine()]
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self._timeout = ctypes.byref(_Timespec(int(sleep_s), int((sleep_s % 1) * 1e9)))

    @classmethod
    def available(cls) -> bool:
        """Whether this platform has the futex system call this class makes."""
        return sys.platform.startswith("linux") and sys.byteorder == "little" and platform.machine() in cls._NUMBERS

    def wait(self, address: int, expected: int) -> None:
        """Sleep while the 32-bit word at ``address`` holds ``expected``, for the bounded time at most."""
        self._syscall(
            self._number, ctypes.c_void_p(address), self._WAIT, ctypes.c_uint32(expected), self._timeout, None, 0
        )

    def wake(self, address: int) -> None:
        """Wake every process asleep on the 32-bit word at ``address``."""
        self._syscall(self._number, ctypes.c_void_p(address), self._WAKE, 0x7FFFFFFF, None, None, 0)
