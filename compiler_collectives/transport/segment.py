"""One host's shared-memory segment: its layout and its lifecycle.

This module makes, checks and removes the file; what the ranks do in it per
call (publish, wait, the failure word, sleepers and wake-ups) is the wait
protocol, ``shm``.

Layout, in 64-bit words (eight words are one 64-byte cache line, so no two
ranks ever write the same line):

* line 0: header: magic, layout version, number of local ranks, failure word
  (``HDR_FAIL``, written by ``shm``), the creator's random token, the
  creator's pid namespace (inode of /proc/self/ns/pid);
* line 1 + i: local rank i's slot (``slot_word``): [0] its word for even
  calls, [1] for odd calls, [2] pid, [3] process start time, [4] global rank;
* line 1 + n: the host leader's result (``result_word``): [0] even calls,
  [1] odd calls (used only when the job spans several hosts);
* lines 2 + n onwards: one "may be asleep" byte per local rank, 64 to a line
  (``Segment.asleep``; ``sleeper_words`` covers them in 64-bit words).

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

**Processes.** Every rank registers its pid and start time in its slot
(``Segment.register``); ``process_identity`` reads both back from ``/proc``,
which is how the probe, the wait protocol's liveness checks and the
leaked-segment clean-up tell a live peer from a dead one or a reused pid.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import stat
import struct
import sys

MAGIC = 0x63635F73686D3031  # "cc_shm01"
LAYOUT_VERSION = 4  # 4: the failure word's kind bit (shm.FAIL_LEFT)
LINE = 8  # words per cache line
FLAGS_PER_LINE = 8 * LINE  # one byte per local rank

_HDR_MAGIC, _HDR_VERSION, _HDR_NRANKS, _HDR_TOKEN, _HDR_PIDNS = 0, 1, 2, 4, 5
HDR_FAIL = 3
"""Word offset of the header's failure word (its format is ``shm``'s: 0 until a rank publishes)."""
_SLOT_PID, _SLOT_START, _SLOT_RANK = 2, 3, 4

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "compiler_collectives-"
_SEGMENT_NAME = re.compile(r"compiler_collectives-[1-9][0-9]{0,9}-[0-9a-f]{16}\Z")
MAX_LOCAL_RANKS = 1 << 16  # a header claiming more is not ours


# ---------------------------------------------------------------------- layout


def slot_word(index: int) -> int:
    """Word offset of local rank ``index``'s slot; its call-parity words are +0 and +1."""
    return LINE * (1 + index)


def result_word(local_ranks: int) -> int:
    """Word offset of the host leader's result line; its call-parity words are +0 and +1."""
    return LINE * (1 + local_ranks)


def flag_lines(local_ranks: int) -> int:
    """Cache lines of "may be asleep" bytes for ``local_ranks`` ranks."""
    return -(-local_ranks // FLAGS_PER_LINE)


def segment_words(local_ranks: int) -> int:
    """The segment's size in 64-bit words."""
    return LINE * (local_ranks + 2 + flag_lines(local_ranks))


def sleeper_words(local_ranks: int) -> tuple[int, ...]:
    """Word offsets that cover every local rank's "may be asleep" byte."""
    first = LINE * (local_ranks + 2)
    return tuple(range(first, first + -(-local_ranks // 8)))


# ---------------------------------------------------------------------- names


def segment_path(pid: int, token: int) -> str:
    """The name of the segment a process with this pid and 63-bit token creates."""
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{pid}-{token:016x}")


def is_segment_path(path: str) -> bool:
    """Whether ``path`` has the form ``segment_path`` gives (nothing else is ever opened)."""
    return os.path.dirname(path) == SHM_DIR and _SEGMENT_NAME.match(os.path.basename(path)) is not None


# ---------------------------------------------------------------------- processes


def pid_namespace() -> int:
    """This process's pid namespace (an inode number), 0 if unknown: pids in /proc mean
    something only within one namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


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


def unavailable_reason() -> str | None:
    """Why this process cannot use a shared-memory segment, or None if it can."""
    if not sys.platform.startswith("linux"):
        return f"shared-memory guard transport needs Linux (this is {sys.platform})"
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return f"{SHM_DIR} is missing or not writable"
    if process_identity(os.getpid()) is None:
        return "/proc/<pid>/stat is not readable, so peers' liveness cannot be watched"
    return None


# ---------------------------------------------------------------------- the segment


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


class Segment:
    """One host's mapped segment: creation, verification, registration, removal of its name.

    What the ranks do in it per call is ``shm.LocalExchange``.
    """

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
        base = slot_word(index)
        self.words[base + _SLOT_RANK] = global_rank
        self.words[base + _SLOT_START] = ident[1] if ident else 0
        self.words[base + _SLOT_PID] = os.getpid()

    def peer(self, index: int) -> tuple[int, int, int]:
        """(pid, start time, global rank) a local rank registered; pid 0 if none."""
        base = slot_word(index)
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
    """Remove ``path``; already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------- leaked segments


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
