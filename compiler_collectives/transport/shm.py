"""The shared-memory mechanism: ranks of one host agree through one mapped segment.

Layout, in 64-bit words (eight words are one 64-byte cache line, so no two
ranks ever write the same line):

* line 0: header: magic, layout version, number of local ranks, failure word,
  the creator's random token, the creator's pid namespace (inode of
  /proc/self/ns/pid). The failure word is 0 until a local rank publishes
  (``failure_word``): its rank + 1 in the low 32 bits, and the kind bit
  ``FAIL_LEFT`` (bit 32) when that rank left the job (its own code raised while
  it waited) rather than failed, so that peers say which;
* line 1 + i: local rank i's slot: [0] its word for even calls, [1] for odd
  calls, [2] pid, [3] process start time, [4] global rank;
* line 1 + n: the host leader's result: [0] even calls, [1] odd calls
  (used only when the job spans several hosts);
* lines 2 + n onwards: one "may be asleep" byte per local rank, 64 to a line.

**One word carries everything.** A call's word is
``1<<63 | tag<<47 | key<<1 | hit`` with ``tag = 0x10000 | (n & 0xFFFF)`` for
the channel's call number ``n``. A reader accepts a word only when its tag is
the call it waits for, so it can never combine a fresh tag with stale data:
an aligned 64-bit store is seen whole or not at all on x86-64 and AArch64,
and no second store has to become visible in order with it. Weak memory
ordering needs nothing more.

**No overwrites.** Words are double-buffered by call parity. A rank reaches
call n+2 (the parity of call n) only after every rank wrote call n+1, which
each does only after reading all of call n.

**Waiting** spins briefly, yields the core (``os.sched_yield``) for a
while, then sleeps in the kernel on the awaited word itself (a futex on the
high half of that 64-bit word, which every new call's tag changes). With a
core per rank it spins 400 reads first, with more local ranks than cores
only 8, so that the rank being waited on gets the core. After 1 ms of
yielding it sleeps: the usual small skew never reaches a futex (a wake-up
costs an inter-processor interrupt, dear in a VM: sleeping at once made 4
ranks on 2 cores 1.7x slower), and a rank that waits long (a peer still in
its data loader) stops burning a core. A sleeper raises its byte in the
"asleep" lines first and checks the word once more; a publisher reads those
lines after its store (one 64-bit read for up to 8 local ranks) and makes a
``FUTEX_WAKE`` only when one is raised. Neither side can fence from Python,
so a store and a load can cross and a wake-up be missed: every sleep is
therefore bounded (2 ms), which is also how a sleeper notices its deadline
and its poisoned state. Between sleeps or yields the waiter watches the
failure word (publishing a failure wakes every sleeper), this process's own
poisoned state (set by the heartbeat thread when a rank on another host
reports a failure), its deadline, and every 50 ms whether the ranks it waits
for still exist, read from ``/proc`` and checked against their start time,
so a SIGKILLed peer is noticed within tens of milliseconds and a SIGSTOPped
one is named at the deadline. Where futexes are not available (not Linux on
x86-64 or AArch64) waiting yields until the word arrives.

**Names and trust.** A segment is ``/dev/shm/compiler_collectives-<pid>-<token>``
(the creator's pid, 16 hex digits of its random token); a name is computed
from what the ranks all-gathered, never taken from the store as given.
``Segment.open`` opens only such names, with ``O_NOFOLLOW``, and uses the file
only if it is a regular file of this user, mode 0600, of the exact size, whose
header carries our magic, layout version, rank count and the creator's token.
Only a rank that created or so verified a segment unlinks its name, and only
while the name still holds that very file. The creator writes the header and
registers itself before the name appears (``O_TMPFILE``, then a link), so
``remove_leaked_segments`` can tell a segment of a job whose every rank died
before unlinking it (all registered owners gone from ``/proc``) from one
being set up.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import platform
import re
import stat
import struct
import sys
import time
from collections.abc import Callable

from .. import health
from ..errors import CollectiveTimeoutError, PeerFailureError

log = logging.getLogger("compiler_collectives.transport.shm")

MAGIC = 0x63635F73686D3031  # "cc_shm01"
LAYOUT_VERSION = 4  # 4: the failure word's kind bit (FAIL_LEFT)
LINE = 8  # words per cache line
FLAGS_PER_LINE = 8 * LINE  # one byte per local rank

_HDR_MAGIC, _HDR_VERSION, _HDR_NRANKS, _HDR_FAIL, _HDR_TOKEN, _HDR_PIDNS = 0, 1, 2, 3, 4, 5
_SLOT_PID, _SLOT_START, _SLOT_RANK = 2, 3, 4

WRITTEN = 1 << 63
TAG_SHIFT = 47
KEY_MASK = (1 << 46) - 1
TAG_BIT = 0x10000

FAIL_LEFT = 1 << 32  # kind bit of the failure word: the rank left the job, it did not fail
_FAIL_RANK = (1 << 32) - 1

SPIN_READS = 400  # about 20-40 µs of reads before the first yield, with a core per rank
SPIN_READS_OVERSUBSCRIBED = 8  # more local ranks than cores: give the core up almost at once
YIELD_S = 1e-3  # then yield this long before sleeping in the kernel (measured: sleeping
# sooner cost 4 ranks on 2 cores 1.7x, each wake-up an IPI in a VM)
SLEEP_S = 0.002  # one futex sleep at most: bounds a missed wake-up
LIVENESS_PERIOD_S = 0.05

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "compiler_collectives-"
_SEGMENT_NAME = re.compile(r"compiler_collectives-[1-9][0-9]{0,9}-[0-9a-f]{16}\Z")
MAX_LOCAL_RANKS = 1 << 16  # a header claiming more is not ours


def segment_path(pid: int, token: int) -> str:
    """The name of the segment a process with this pid and 63-bit token creates."""
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{pid}-{token:016x}")


def is_segment_path(path: str) -> bool:
    """Whether ``path`` has the form ``segment_path`` gives (nothing else is ever opened)."""
    return os.path.dirname(path) == SHM_DIR and _SEGMENT_NAME.match(os.path.basename(path)) is not None


def pid_namespace() -> int:
    """This process's pid namespace (an inode number), 0 if unknown: pids in /proc mean
    something only within one namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _link_tmpfile(fd: int, path: str) -> None:
    """Give an ``O_TMPFILE`` file its name. CPython calls link(2), which does not follow
    the /proc/self/fd symlink, unless a dir fd is passed: then linkat(AT_SYMLINK_FOLLOW)."""
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", path, src_dir_fd=root, follow_symlinks=True)
    finally:
        os.close(root)


def _refusal(st: os.stat_result, size: int) -> str | None:
    """Why an open file is not one of our segments of ``size`` bytes, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}"
    if stat.S_IMODE(st.st_mode) != 0o600:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600"
    if st.st_size != size:
        return f"it holds {st.st_size} bytes, not the {size} its ranks need"
    return None


def tag(n: int) -> int:
    """The tag of call ``n``: never zero, so an unwritten word matches no call."""
    return TAG_BIT | (n & 0xFFFF)


def failure_word(rank: int, left: bool = False) -> int:
    """The failure word a rank publishes: never zero (zero means no failure)."""
    return (rank + 1) | (FAIL_LEFT if left else 0)


def read_failure_word(word: int) -> tuple[int, bool] | None:
    """(global rank that published, whether it left rather than failed), or None if none did."""
    if not word:
        return None
    return (word & _FAIL_RANK) - 1, bool(word & FAIL_LEFT)


def flag_lines(local_ranks: int) -> int:
    return -(-local_ranks // FLAGS_PER_LINE)


def segment_words(local_ranks: int) -> int:
    return LINE * (local_ranks + 2 + flag_lines(local_ranks))


def sleeper_words(local_ranks: int) -> tuple[int, ...]:
    """Word offsets that cover every local rank's "may be asleep" byte."""
    first = LINE * (local_ranks + 2)
    return tuple(range(first, first + -(-local_ranks // 8)))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """FUTEX_WAIT / FUTEX_WAKE on 32-bit words of a shared mapping.

    Not the private variants: the waiters are other processes. Each call is a
    ctypes call into libc's ``syscall``, which releases the GIL while it sleeps.
    """

    _NUMBERS = {"x86_64": 202, "aarch64": 98}  # SYS_futex
    _WAIT, _WAKE = 0, 1

    def __init__(self, sleep_s: float) -> None:
        self._number = self._NUMBERS[platform.machine()]
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self._timeout = ctypes.byref(_Timespec(int(sleep_s), int((sleep_s % 1) * 1e9)))

    @classmethod
    def available(cls) -> bool:
        return sys.platform.startswith("linux") and sys.byteorder == "little" and platform.machine() in cls._NUMBERS

    def wait(self, address: int, expected: int) -> None:
        """Sleep while the 32-bit word at ``address`` holds ``expected``, for the bounded time at most."""
        self._syscall(
            self._number, ctypes.c_void_p(address), self._WAIT, ctypes.c_uint32(expected), self._timeout, None, 0
        )

    def wake(self, address: int) -> None:
        self._syscall(self._number, ctypes.c_void_p(address), self._WAKE, 0x7FFFFFFF, None, None, 0)


def unavailable_reason() -> str | None:
    """Why this process cannot use a shared-memory segment, or None if it can."""
    if not sys.platform.startswith("linux"):
        return f"shared-memory guard transport needs Linux (this is {sys.platform})"
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return f"{SHM_DIR} is missing or not writable"
    if process_identity(os.getpid()) is None:
        return "/proc/<pid>/stat is not readable, so peers' liveness cannot be watched"
    return None


def process_identity(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[19])
    except (IndexError, ValueError):
        return None


class Segment:
    """One host's mapped segment. Creation and mapping only; the protocol is ``LocalExchange``."""

    def __init__(self, path: str, local_ranks: int, fd: int) -> None:
        self.path = path
        self.local_ranks = local_ranks
        size = segment_words(local_ranks) * 8
        try:
            st = os.fstat(fd)
            self.file_id = (st.st_dev, st.st_ino)  # what unlink_name checks the name still holds
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.words = (ctypes.c_uint64 * segment_words(local_ranks)).from_buffer(self._map)
        self.address = ctypes.addressof(self.words)
        first = LINE * (local_ranks + 2) * 8
        self.asleep = (ctypes.c_uint8 * (flag_lines(local_ranks) * FLAGS_PER_LINE)).from_buffer(self._map, first)

    @classmethod
    def create(cls, path: str, local_ranks: int, token: int, global_rank: int) -> Segment:
        """Create ``path`` (``segment_path(os.getpid(), token)``) with its header written and
        this process registered in slot 0 before the name appears."""
        size = segment_words(local_ranks) * 8
        flags = os.O_RDWR | os.O_CLOEXEC
        try:  # unnamed until complete, so no one ever sees a half-made segment
            fd = os.open(SHM_DIR, flags | os.O_TMPFILE, 0o600)
            named = False
        except (AttributeError, OSError):  # no O_TMPFILE here: the name exists from the start
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            named = True
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, size)
            seg = cls(path, local_ranks, os.dup(fd))
            seg.words[_HDR_NRANKS] = local_ranks
            seg.words[_HDR_TOKEN] = token
            seg.words[_HDR_PIDNS] = pid_namespace()
            seg.words[_HDR_VERSION] = LAYOUT_VERSION
            seg.words[_HDR_MAGIC] = MAGIC
            seg.register(0, global_rank)
            if not named:
                _link_tmpfile(fd, path)
                named = True
        except BaseException:
            if named:
                unlink(path)
            raise
        finally:
            os.close(fd)
        return seg

    @classmethod
    def open(cls, path: str, local_ranks: int, token: int) -> Segment:
        """Map the segment another local rank created, after checking it is one: our name
        pattern, no symlink, a regular file of this user, mode 0600, exact size, our header
        with the creator's ``token``. Raises ``OSError`` saying why not; never unlinks."""
        if not is_segment_path(path):
            raise OSError(
                errno.EINVAL,
                f"{path!r} is not a compiler_collectives segment name "
                f"({SHM_DIR}/{SEGMENT_PREFIX}<pid>-<16 hex digits>); not opening it",
            )
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            why = _refusal(os.fstat(fd), segment_words(local_ranks) * 8)
        except BaseException:
            os.close(fd)
            raise
        if why is not None:
            os.close(fd)
            raise OSError(errno.EINVAL, f"segment {path}: {why}; not using it")
        seg = cls(path, local_ranks, fd)
        words = seg.words
        if (
            words[_HDR_MAGIC] != MAGIC
            or words[_HDR_VERSION] != LAYOUT_VERSION
            or words[_HDR_NRANKS] != local_ranks
            or words[_HDR_TOKEN] != token
        ):
            raise OSError(
                errno.EINVAL,
                f"segment {path} does not carry the header its creator wrote "
                f"(compiler_collectives layout {LAYOUT_VERSION}, {local_ranks} ranks, its token); "
                "not using it",
            )
        return seg

    def unlink_name(self) -> None:
        """Remove this segment's name, if it still names this very file (the mapping stays)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self.file_id:
            unlink(self.path)

    def register(self, index: int, global_rank: int) -> None:
        """Publish this process in its slot, for the probe and for peers' liveness checks."""
        ident = process_identity(os.getpid())
        base = LINE * (1 + index)
        self.words[base + _SLOT_RANK] = global_rank
        self.words[base + _SLOT_START] = ident[1] if ident else 0
        self.words[base + _SLOT_PID] = os.getpid()

    def peer(self, index: int) -> tuple[int, int, int]:
        """(pid, start time, global rank) a local rank registered; pid 0 if none."""
        base = LINE * (1 + index)
        return self.words[base + _SLOT_PID], self.words[base + _SLOT_START], self.words[base + _SLOT_RANK]

    def probe(self, global_ranks: list[int]) -> str | None:
        """After every local rank registered: None if this segment is really shared with them."""
        for index, rank in enumerate(global_ranks):
            pid, start, registered_rank = self.peer(index)
            if pid == 0 or registered_rank != rank:
                return (
                    f"rank {rank}'s slot in {self.path} stays empty: /dev/shm is not shared "
                    "between these ranks (a container with a private /dev/shm?)"
                )
            ident = process_identity(pid)
            if ident is None or ident[1] != start:
                return (
                    f"rank {rank} registered pid {pid}, which this process cannot see in /proc "
                    "(another pid namespace?), so its liveness cannot be watched"
                )
        return None


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _owner_alive(pid: int, start: int) -> bool:
    ident = process_identity(pid)
    return ident is not None and ident[0] not in ("Z", "X") and ident[1] == start


def _remove_if_leaked(path: str, namespace: int) -> bool:
    """Unlink ``path`` if it is our segment and every process registered in it is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        header = os.pread(fd, LINE * 8, 0)
        if len(header) != LINE * 8:
            return False
        magic, version, n, _, _, owner_ns = struct.unpack("=6Q", header[:48])
        if (
            magic != MAGIC
            or version != LAYOUT_VERSION
            or owner_ns != namespace
            or not 1 <= n <= MAX_LOCAL_RANKS
            or _refusal(st, segment_words(n) * 8) is not None
        ):
            return False  # not one of ours, another layout, or pids we cannot judge
        owners = []
        for i in range(n):
            slot = os.pread(fd, LINE * 8, LINE * 8 * (1 + i))
            pid, start = struct.unpack_from("=2Q", slot, 8 * _SLOT_PID)
            if pid:
                owners.append((pid, start))
        # The creator registers before the name appears: no owner at all is not ours to judge.
        if not owners or any(_owner_alive(pid, start) for pid, start in owners):
            return False
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def remove_leaked_segments() -> list[str]:
    """Unlink the segments of dead jobs; the paths removed.

    A job whose every local rank died between creating its segment and
    unlinking the name leaves the file behind. Removed: only names of our
    pattern, regular files of this user with our header, created in this pid
    namespace, whose every registered process (pid and start time, from
    /proc) is gone. Never raises.
    """
    namespace = pid_namespace()
    removed: list[str] = []
    if not namespace:
        return removed
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(SHM_DIR, name)
        if not is_segment_path(path):
            continue
        try:
            if _remove_if_leaked(path, namespace):
                removed.append(path)
        except (OSError, struct.error):
            continue
    return removed


@dataclasses.dataclass(frozen=True)
class Arrival:
    """Rank numbers the exchange needs for its messages."""

    rank: int  # this process's global rank
    local_ranks: tuple[int, ...]  # global rank of each local index
    leader_index: int = 0


class LocalExchange:
    """The protocol over one ``Segment`` beyond the fast path: waiting, results, failures.

    The fast path itself (one store of this rank's word, one load of each
    peer's) is inlined in ``hierarchy.ShmGuardChannel.agree``.
    """

    __slots__ = (
        "_address",
        "_asleep",
        "_describe",
        "_futex",
        "_monotonic",
        "_pids",
        "_result",
        "_spin",
        "_starts",
        "_waker",
        "_yield",
        "_yield_s",
        "index",
        "n",
        "ranks",
        "sleepers",
        "timeout_s",
        "words",
    )

    def __init__(
        self, segment: Segment, index: int, arrival: Arrival, timeout_s: float, describe: Callable[[int], str]
    ) -> None:
        self.words = segment.words
        self.index = index
        self.n = segment.local_ranks
        self.ranks = arrival
        self.timeout_s = timeout_s
        self._result = LINE * (1 + self.n)
        peers = [segment.peer(j) for j in range(self.n)]
        self._pids = tuple(p[0] for p in peers)
        self._starts = tuple(p[1] for p in peers)
        self._describe = describe  # call number -> "guard collective #s on rank r" prefix
        self._yield = getattr(os, "sched_yield", lambda: time.sleep(0))
        # Spinning only pays when the rank we wait for has a core of its own.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._spin = SPIN_READS if self.n <= cores else SPIN_READS_OVERSUBSCRIBED
        self._yield_s = YIELD_S
        self._monotonic = time.monotonic
        self._futex = Futex(SLEEP_S) if Futex.available() else None  # this rank's sleeps
        self._waker = self._futex  # wakes peers whatever ``tune`` does to this rank's own sleeps
        self._asleep = segment.asleep
        self._address = segment.address
        self.sleepers = sleeper_words(self.n)  # a publisher reads these after its store

    def tune(
        self,
        *,
        spin: int | None = None,
        yield_s: float | None = None,
        sleep: bool | None = None,
        sleep_s: float = SLEEP_S,
    ) -> None:
        """Change how this rank waits: benchmarks compare policies side by side, and tests
        lengthen the bound on one sleep to show that a wake-up, not the bound, ends it."""
        if spin is not None:
            self._spin = spin
        if yield_s is not None:
            self._yield_s = yield_s
        if sleep is not None:
            self._futex = Futex(sleep_s) if sleep and Futex.available() else None

    # ------------------------------------------------------------------ per call

    @staticmethod
    def slot_word(index: int) -> int:
        """Word offset of local rank ``index``'s slot; its call-parity words are +0 and +1."""
        return LINE * (1 + index)

    def publish_result(self, n: int, in_step: bool, all_hit: bool) -> None:
        index = self._result + (n & 1)
        self.words[index] = WRITTEN | (tag(n) << TAG_SHIFT) | (2 if in_step else 0) | (1 if all_hit else 0)
        if self.anyone_asleep():
            self.wake(index)

    def publish_failed_result(self, n: int, failed_rank: int) -> None:
        index = self._result + (n & 1)
        self.words[index] = WRITTEN | (tag(n) << TAG_SHIFT) | ((failed_rank + 1) << 3) | 4
        self.wake(index)

    def anyone_asleep(self) -> bool:
        words = self.words
        for i in self.sleepers:
            if words[i]:
                return True
        return False

    def wake(self, index: int) -> None:
        """After a store to word ``index``: wake the local ranks asleep on it."""
        if self._waker is not None:
            self._waker.wake(self._address + 8 * index + 4)

    def wait_result(self, n: int) -> tuple[bool, bool]:
        """Non-leaders on a multi-host job: the leader's (all hit, in step) for call ``n``."""
        index = self._result + (n & 1)
        want = tag(n)
        w = self.words[index]
        if w >> TAG_SHIFT != want:
            w = self.wait(index, want, n)
        if w & 4:
            raise self.failed_elsewhere(n, ((w >> 3) & 0xFFFFFFFF) - 1)
        return bool(w & 2) and bool(w & 1), bool(w & 2)

    def failed_elsewhere(self, n: int, failed_rank: int) -> PeerFailureError:
        # Not marked as a report: the rank named may be one that died without reporting
        # (its host's leader saw it gone); the diagnosis finds out.
        return PeerFailureError(
            f"{self._describe(n)}: rank {failed_rank}, on another host, failed during this guard "
            "collective (its host's leader reported it); that rank's log names the cause.",
            kind="guard",
            rank=self.ranks.rank,
            ranks=(failed_rank,),
        )

    # ------------------------------------------------------------------ waiting

    def wait(self, index: int, want: int, n: int) -> int:
        """Until word ``index`` carries tag ``want``: spin, then yield while watching for failures."""
        words = self.words
        for _ in range(self._spin):
            w = words[index]
            if w >> TAG_SHIFT == want:
                return w
        return self._wait_long(index, want, n)

    def _wait_long(self, index: int, want: int, n: int) -> int:
        words = self.words
        monotonic = self._monotonic
        yield_ = self._yield
        start = monotonic()
        deadline = start + self.timeout_s
        next_check = start + LIVENESS_PERIOD_S
        sleep_from = start + self._yield_s if self._futex is not None else deadline
        now = start
        while True:
            if now < sleep_from:
                yield_()
            else:
                self._sleep(index, want)
            w = words[index]
            if w >> TAG_SHIFT == want:
                return w
            if words[_HDR_FAIL]:
                raise self._peer_reported(n)
            if health.poisoned() is not None:
                raise self._poisoned(n)
            now = monotonic()
            if now >= next_check:
                next_check = now + LIVENESS_PERIOD_S
                self._check_waited(index, n)
            if now >= deadline:
                raise self._timed_out(index, n)

    def _sleep(self, index: int, want: int) -> None:
        """One bounded futex sleep on the high half of word ``index``, unless it arrived meanwhile."""
        asleep = self._asleep
        asleep[self.index] = 1  # before the last look, so that a publisher after it wakes us
        w = self.words[index]
        if w >> TAG_SHIFT != want and not self.words[_HDR_FAIL]:
            self._futex.wait(self._address + 8 * index + 4, w >> 32)
        asleep[self.index] = 0

    def _slot_owner(self, index: int) -> int | None:
        """Local index of the slot holding word ``index``; None for the result line (the leader's)."""
        line = index // LINE - 1
        return line if line < self.n else None

    def _check_waited(self, index: int, n: int) -> None:
        owner = self._slot_owner(index)
        waited = [owner] if owner is not None else [self.ranks.leader_index]
        for j in range(self.n):  # a dead rank anywhere on the host stalls us too, via the leader
            if j != self.index and j not in waited:
                waited.append(j)
        for j in waited:
            ident = process_identity(self._pids[j])
            if ident is None or ident[0] in ("Z", "X") or ident[1] != self._starts[j]:
                raise self._dead(j, n)

    # ------------------------------------------------------------------ failures

    def publish_failure(self, rank: int, left: bool = False) -> None:
        """Tell every local rank that this one failed (or, ``left``, left the job): they stop
        waiting at once. The first word published stays: it is what the others raise."""
        if not self.words[_HDR_FAIL]:
            self.words[_HDR_FAIL] = failure_word(rank, left)
        for j in range(self.n + 1):  # every slot and the result line: wherever a rank may sleep
            for parity in (0, 1):
                self.wake(LINE * (1 + j) + parity)

    def _peer_reported(self, n: int) -> PeerFailureError:
        # A report: the failure procedure replaces these words by the rank's own store report.
        failed, left = read_failure_word(self.words[_HDR_FAIL]) or (-1, False)
        if left:
            what = f"rank {failed} left the job (its own code raised while it waited in a guard collective)"
        else:
            what = f"rank {failed} reported a failure on this host's shared-memory channel"
        return PeerFailureError(
            f"{self._describe(n)}: {what} while this rank waited; that rank's own error names the cause.",
            kind="guard",
            rank=self.ranks.rank,
            ranks=(failed,),
            reported_by=(failed,),
            left=left,
        )

    def _poisoned(self, n: int) -> PeerFailureError:
        first = health.poisoned()
        return PeerFailureError(
            f"{self._describe(n)}: stopped waiting: {first}",
            kind="guard",
            rank=self.ranks.rank,
            ranks=first.ranks if first is not None else (),
            reported_by=first.reported_by if first is not None else (),
            left=getattr(first, "left", False),
        )

    def _dead(self, j: int, n: int) -> PeerFailureError:
        rank = self.ranks.local_ranks[j]
        return PeerFailureError(
            f"{self._describe(n)}: rank {rank} (pid {self._pids[j]}, same host) exited or was "
            "killed while this rank waited for it; check that rank's log and exit status "
            "(SIGKILL often means the out-of-memory killer).",
            kind="guard",
            rank=self.ranks.rank,
            ranks=(rank,),
        )

    def _timed_out(self, index: int, n: int) -> CollectiveTimeoutError:
        owner = self._slot_owner(index)
        missing = []
        for j in range(self.n):
            if j == self.index:
                continue
            if self.words[LINE * (1 + j) + (n & 1)] >> TAG_SHIFT != tag(n):
                missing.append(j)
        if owner is None and not missing:
            missing = [self.ranks.leader_index]
        notes = []
        for j in missing:
            ident = process_identity(self._pids[j])
            state = "stopped (SIGSTOP or a debugger)" if ident and ident[0] in ("T", "t") else "running"
            notes.append(f"rank {self.ranks.local_ranks[j]} (pid {self._pids[j]}): {state}")
        ranks = tuple(self.ranks.local_ranks[j] for j in missing)
        return CollectiveTimeoutError(
            f"{self._describe(n)} timed out after {self.timeout_s:.0f}s waiting on this host's "
            f"shared-memory channel for {'; '.join(notes) or 'the host leader'}. A rank is stuck, "
            "much slower, or took another code path. Raise COMPILER_COLLECTIVES_TIMEOUT if ranks "
            "legitimately run at very different speeds.",
            kind="guard",
            rank=self.ranks.rank,
            ranks=ranks,
        )
