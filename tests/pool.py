"""Ranks reused across tests: pools of 2 or 4 rank processes, a few per pytest worker.

A multi-rank test in ``tests/ranks/`` runs its function in a pool's ranks instead of fresh
processes (``run_ranks`` sends it here; ``tests/ranks/conftest.py`` switches that on). The
ranks start once, from the harness's forkserver, with the pool's environment in place, and
import the package there: each test then saves a rank the package's install (0.4-0.5 CPU-s
on this machine), torch's first compile's warm-up (0.2-0.3 CPU-s) and its process start.

One test on a pool's rank, in order:

1. the job's own variables (``HARNESS_JOB_DIR``, ``TMPDIR``, the inductor cache dir);
2. a default group of its own (gloo over a FileStore in the job's directory): joining it
   starts a new generation of ours, as in any job;
3. the test's function; its result (or its error) goes to the parent;
4. the tidy-up, every rank alone: ``destroy_process_group()`` (our generation ends),
   ``compiler_collectives.reset()``, Dynamo's reset, inductor's in-process caches cleared
   (so compile once's tests meet cold ones, as in a fresh process), and what a job may set
   and leave put back: what the test patched through ``rankside.patch``, torch's Dynamo,
   inductor and functorch configs and our two switches, as they were before the test;
5. the leak check: nothing of ours may be left (a thread named ``compiler_collectives-*``,
   a ``/dev/shm`` segment this rank made, a process group, a setting whose value differs
   from the pool's, a value of our modules other than the global state ``runtime.STATE``
   declares, or a function of torch's Dynamo, inductor, functorch or c10d replaced by one the
   test wrote: a fault injected and not undone; a seam the package binds at a compile, its
   optional levels, dropped, displaced, or holding a test's function as torch's own). A rank
   reports what it found; the test
   fails, naming it, and the pool is replaced. The environment is put back as the job found it
   (a rank may set ``GROUP_RANK`` to make hosts of one machine; inductor sets variables of its
   own), which leaves nothing of it behind.

A pool is keyed on its world size and its environment (less the job's own variables), so a
rank never runs a test under settings it did not start with. A worker keeps its last
``MAX_POOLS`` pools, the one used least recently closed for a new key: tests that alternate
two environments (a parametrized transport, 2 and 4 ranks) reuse the ranks of both instead
of starting a pool per test (about 2 CPU-s for 2 ranks). An idle pool's ranks hold no group
and run no thread of ours: they wait on their inboxes. A test that times out, or whose rank
dies or leaks, poisons its pool: its ranks are killed and the next test starts a fresh one,
so a failure never reaches the next test's result; should a pool's rank fail to join the next
test's group all the same (gloo's connect fails now and then: "Connection closed by peer"),
its pool is replaced and the test tried once more on the new one, then on processes of its
own (``run_ranks``), never failing for the pool's sake. One test at a time uses the pool: a test that runs two jobs at
once (from threads) runs the second on processes of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import pickle
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import cc_launch as launch

# Set per test, not per pool: the rank reads them again for each job.
JOB_VARIABLES = ("HARNESS_JOB_DIR", "TMPDIR", "TORCHINDUCTOR_CACHE_DIR")
SIZES = (2, 4)  # the world sizes a pool serves
THREAD_PREFIX = "compiler_collectives-"
SEGMENT_GLOB = "/dev/shm/compiler_collectives-{pid}-*"
# Where a test may patch torch inside its ranks (a fault injected, a call watched): a callable
# of these modules replaced by one the test wrote, and not put back, is a leak (``watched``).
TORCH_WATCHED = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.distributed")
THREADS_END_S = 5.0  # how long a rank waits for our threads to end after the tidy-up (probes end on their own)
TIDY_S = 30.0  # how long the parent waits for every rank's tidy-up and check after the test's results
# Pools a worker keeps: enough for a file that alternates two environments with a pool of the
# other size beside them. A pool rank's RSS is ~300-360 MB, much of it shared with the forkserver.
MAX_POOLS = 3


@dataclasses.dataclass(frozen=True)
class Key:
    """What a pool's ranks were started with: a test with another key gets another pool."""

    world_size: int
    env: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, world_size: int, env: dict[str, str]) -> Key:
        return cls(world_size, tuple(sorted((k, v) for k, v in env.items() if k not in JOB_VARIABLES)))


# ------------------------------------------------------------------ the rank's side


@dataclasses.dataclass
class _Saved:
    """What a job may change and the pool puts back, taken before the job."""

    dynamo: dict[str, Any]
    inductor: dict[str, Any]
    functorch: dict[str, Any]
    compiler: bool
    guards: bool


def _save() -> _Saved:
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import compiler_collectives as cc

    return _Saved(
        dynamo_config.get_config_copy(),
        inductor_config.get_config_copy(),
        functorch_config.get_config_copy(),
        cc.is_enabled(),
        cc.guards_enabled(),
    )


def _settings() -> dict[str, Any]:
    from compiler_collectives import config

    return {row.attr: getattr(config.settings, row.attr) for row in config.SETTINGS_TABLE}


def _tidy(saved: _Saved) -> None:
    """The end of a test on this rank: our generation ends, and what the job set goes back."""
    import torch
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.utils
    import torch.distributed as dist

    import compiler_collectives as cc
    from tests.rankside import undo_patches

    undo_patches()  # the test's faults and watches (``rankside.patch``), before anything runs again
    if dist.is_initialized():
        dist.destroy_process_group()
    cc.reset()
    torch._dynamo.reset()
    # Inductor's in-process caches (compiled modules, loaded kernels) as a fresh process has
    # them: empty. A job's compiles must reach its own cache dir, not the last job's modules.
    torch._inductor.utils.clear_caches()
    torch._dynamo.utils.counters.clear()
    for module, before in (
        (dynamo_config, saved.dynamo),
        (inductor_config, saved.inductor),
        (functorch_config, saved.functorch),
    ):
        now = module.get_config_copy()
        changed = {k: v for k, v in before.items() if now.get(k) != v}
        if changed:  # only those: setting a deprecated one again would warn
            module.load_config(changed)
    cc.disable()
    if saved.compiler or saved.guards:
        cc.enable(compiler=saved.compiler, guards=saved.guards)
    cc.reset_stats()


def watched() -> dict[tuple[str, str], Any]:
    """What a test must leave as the pool's ranks hold it, by (module or class, name): every
    value of our modules but the global state ``runtime.STATE`` declares (which a generation
    renews), the methods of our classes, and the callables of torch's Dynamo, inductor,
    functorch and c10d modules (24 ms per look)."""
    import sys
    import warnings

    from compiler_collectives import runtime

    held = {(f"compiler_collectives.{h.module}", name) for h in runtime.STATE for name in h.names}
    found: dict[tuple[str, str], Any] = {}
    with warnings.catch_warnings():  # a deprecated attribute warns when looked at (c10d's reduce_op)
        warnings.simplefilter("ignore")
        _watch(sys.modules, held, found)
    return found


def _watch(modules: dict[str, Any], held: set[tuple[str, str]], found: dict[tuple[str, str], Any]) -> None:
    import types

    for name, module in list(modules.items()):
        ours = name.startswith("compiler_collectives")
        if module is None or not (ours or name.startswith(TORCH_WATCHED)):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType) or (name, attr) in held or not (ours or callable(value)):
                continue
            found[(name, attr)] = value
            if ours and isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    if callable(cvalue):
                        found[(f"{name}.{value.__qualname__}", cattr)] = cvalue


def _origin(value: Any) -> str:
    """Where a callable was written: its code's file, or its module's name (a class, a builtin)."""
    code = getattr(value, "__code__", None) or getattr(getattr(value, "__func__", None), "__code__", None)
    return code.co_filename if code is not None else str(getattr(value, "__module__", None) or "")


def _changed(before: dict[tuple[str, str], Any]) -> list[str]:
    """What ``watched`` holds now that it did not before: a value of ours replaced, or a callable
    of torch's replaced by one written outside torch and the package (a test's patch; the package
    itself swaps its seams in and out as inductor's modules are imported and its generations
    end, ``dynamo/bound.py``: those are torch's or ours)."""
    now = watched()
    changed = []
    for (owner, attr), value in before.items():
        new = now.get((owner, attr))
        if new is value:
            continue
        if not owner.startswith("compiler_collectives") and not _written_elsewhere(new):
            continue
        changed.append(f"{owner}.{attr}")
    return sorted(changed)


def _written_elsewhere(value: Any) -> bool:
    """Whether ``value`` was written outside torch and the package (a test's function)."""
    import torch

    import compiler_collectives

    own = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, compiler_collectives))
    origin = _origin(value)
    return not (origin.startswith(own) or origin.startswith(("torch", "compiler_collectives")))


def _dropped_levels() -> list[str]:
    """The optional levels of the package's seams (``dynamo/bound.py``) it dropped for this
    process as missing on this torch, whose rows pass their checks on what is in place now: a
    test's function whose parameters are not torch's stood there when a compile bound them."""
    from compiler_collectives.dynamo import bound, table

    return sorted(
        level for level, ok in bound.levels.items() if ok is False and not any(table.check(table.optional_rows(level)))
    )


def _bound_rows() -> list[Any]:
    """The seam rows of the package's optional levels bound in this process (``dynamo/bound.py``)."""
    from compiler_collectives.dynamo import bound, table

    return [row for level, ok in bound.levels.items() if ok for row in table.optional_rows(level)]


def _displaced_seams() -> list[str]:
    """The package's seams that it bound at a compile and that no longer stand in torch's place:
    a test put back torch's function over ours (a restore of its own patch, made before ours
    wrapped it). Every later compile of the rank would skip them."""
    import compiler_collectives
    from compiler_collectives.dynamo import table

    ours = os.path.dirname(compiler_collectives.__file__ or "") + os.sep
    return sorted(
        row.name
        for row in _bound_rows()
        if row.replace is not None and not _origin(getattr(*table.place(row), None)).startswith(ours)
    )


def _held_as_torchs() -> list[str]:
    """The package's seams that hold a test's function as torch's own: a test patched torch's
    function directly, and a seam the package binds at a compile wrapped it. The attribute then
    holds the package's seam again, which the look at values takes for torch's state; every
    later compile of the rank would still run the test's fault."""
    import tests
    from compiler_collectives.dynamo import bound

    written = os.path.dirname(tests.__file__ or "") + os.sep
    return sorted(row.name for row in _bound_rows() if _origin(bound.originals.get(row.name)).startswith(written))


def left_behind(settings: dict[str, Any], held: dict[tuple[str, str], Any]) -> list[str]:
    """What of ours this rank still holds after a test's tidy-up, in words (empty: nothing)."""
    import torch.distributed as dist

    left = []
    replaced = _changed(held)
    if replaced:
        shown = ", ".join(replaced[:8]) + (f" and {len(replaced) - 8} more" if len(replaced) > 8 else "")
        left.append(f"values replaced and not put back ({shown}): undo the patch, or mark the test fresh_ranks")
    dropped = _dropped_levels()
    if dropped:
        left.append(
            f"our seams' level(s) {dropped} dropped, though torch's functions now in place pass their checks: "
            "a test's function stood there when a compile bound them (give a fault torch's signature: "
            "functools.wraps)"
        )
    displaced = _displaced_seams()
    if displaced:
        left.append(
            f"our seams bound at a compile and no longer in torch's place ({', '.join(displaced)}): patch "
            "torch's function with rankside.patch, which puts it back from under ours"
        )
    wrapped = _held_as_torchs()
    if wrapped:
        left.append(
            f"a test's function held by our seams as torch's own ({', '.join(wrapped)}): patch it with "
            "rankside.patch, which puts it back, or mark the test fresh_ranks"
        )
    deadline = time.monotonic() + THREADS_END_S
    while True:  # a probe's thread ends once its receive did: give them their moment
        ours = sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive())
        if not ours or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if ours:
        left.append(f"threads {ours} still running {THREADS_END_S:.0f}s after the test's group was destroyed")
    segments = sorted(glob.glob(SEGMENT_GLOB.format(pid=os.getpid())))
    if segments:
        left.append(f"shared-memory segments {segments}")
        for path in segments:  # the next pool must not meet them
            os.unlink(path)
    if dist.is_initialized():
        left.append("a default process group (destroy_process_group() did not end it)")
    changed = {k: (v, now) for k, v in settings.items() if (now := _settings()[k]) != v}
    if changed:
        said = ", ".join(f"{k}: {was!r} -> {now!r}" for k, (was, now) in changed.items())
        left.append(f"settings changed and not put back ({said})")
    return left


def _put_back(environ: dict[str, str]) -> None:
    """The environment as the job found it: a test may set a variable in its rank (``GROUP_RANK``
    to make hosts of one machine), and inductor sets some of its own."""
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


def _rank(rank: int, world_size: int, env: dict[str, str], inbox: Any, results: Any) -> None:
    """A pool's rank: the pool's environment, the package installed, then one job after another."""
    import importlib

    os.environ.update(env)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    from tests.harness import join_default_group, read_again_what_the_forkserver_read

    read_again_what_the_forkserver_read(env)
    import compiler_collectives  # noqa: F401  - installed once, with the pool's environment

    settings, held = _settings(), watched()
    while True:
        job = inbox.get()
        if job is None:
            return
        number, target, args, init_method, job_env = job
        os.environ.update(job_env)
        tempfile.tempdir = None  # the job's TMPDIR is its own
        environ = dict(os.environ)
        saved = _save()
        try:
            join_default_group(init_method, rank, world_size)
        except BaseException:  # noqa: BLE001 - the pool's fault, not the test's: the parent runs it afresh
            results.put(("setup", rank, number, traceback.format_exc()))
            return
        try:
            module_name, qualname = target
            fn = getattr(importlib.import_module(module_name), qualname)
            value = fn(rank, world_size, *args)
            results.put(("ok", rank, number, pickle.dumps(value)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put(("err", rank, number, traceback.format_exc()))
        try:
            _tidy(saved)
            _put_back(environ)
            left = left_behind(settings, held)
        except BaseException:  # noqa: BLE001
            left = [f"the tidy-up raised:\n{traceback.format_exc()}"]
        results.put(("tidy", rank, number, left))
        if left:
            return  # this process is no longer as the pool started it: the parent replaces the pool


# ------------------------------------------------------------------ the parent's side


class Pool:
    """``world_size`` ranks started with ``env``, serving one test at a time."""

    def __init__(self, key: Key, preload: Sequence[str]) -> None:
        self.key, self.jobs, self.poisoned = key, 0, False
        self.served: list[str] = []  # the tests this pool ran, in order (said when one fails)
        ctx = launch.context("forkserver", preload)
        self.inboxes = [ctx.Queue() for _ in range(key.world_size)]
        self.ranks = launch.start_ranks(
            _rank,
            key.world_size,
            lambda rank, results: (rank, key.world_size, dict(key.env), self.inboxes[rank], results),
            preload=preload,
            name="pool",
        )

    @property
    def procs(self) -> list[Any]:
        return self.ranks.procs

    def send(
        self, target: tuple[str, str], args: Sequence[Any], init_method: str, job_envs: Sequence[dict[str, str]]
    ) -> int:
        """Job ``target(rank, world_size, *args)`` to every rank, each with its own ``job_envs[rank]``."""
        self.jobs += 1
        for inbox, job_env in zip(self.inboxes, job_envs, strict=True):
            inbox.put((self.jobs, target, tuple(args), init_method, job_env))
        return self.jobs

    def receive(self, number: int, timeout: float) -> tuple[str, int, Any] | None:
        """The next message of job ``number`` (older jobs' stragglers are dropped)."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            message = self.ranks.receive(timeout=remaining)
            if message is None:
                return None
            status, rank, job, value = message
            if job == number:
                return status, rank, value
        return None

    def close(self, grace_s: float = 5.0) -> list[int]:
        """Stop the ranks (the pill, then SIGKILL after ``grace_s``); the indices of those killed."""
        if not self.poisoned:
            for inbox in self.inboxes:
                inbox.put(None)
        killed = launch.reap(self.procs, 0.0 if self.poisoned else grace_s)
        self.ranks.close()
        for inbox in self.inboxes:
            inbox.close()
            inbox.join_thread()
        return killed


_pools: dict[Key, Pool] = {}  # this worker's, least recently used first
_in_use = threading.Lock()


@contextlib.contextmanager
def claimed() -> Iterator[bool]:
    """Whether this worker's pool is free for one test (True inside, until it ends); False where
    another job of this process holds it (a test running two jobs at once, from threads)."""
    free = _in_use.acquire(blocking=False)
    try:
        yield free
    finally:
        if free:
            _in_use.release()


def pool_for(key: Key, preload: Sequence[str]) -> Pool:
    """This worker's pool for ``key``: the one it has, or a new one (closing the least recently
    used where it holds ``MAX_POOLS`` already)."""
    held = _pools.pop(key, None)
    if held is not None and (held.poisoned or not all(p.is_alive() for p in held.procs)):
        held.close()
        held = None
    if held is None:
        while len(_pools) >= MAX_POOLS:
            _pools.pop(next(iter(_pools))).close()
        held = Pool(key, preload)
    _pools[key] = held  # now the most recently used
    return held


def drop(poisoned: Pool) -> None:
    """Close ``poisoned`` (a test timed out in it, or a rank died, leaked or failed to join):
    the next test of its key starts a new one."""
    poisoned.poisoned = True
    if _pools.get(poisoned.key) is poisoned:
        del _pools[poisoned.key]
    poisoned.close()


def close_pools() -> None:
    """The worker is done (``tests/conftest.py`` at the session's end)."""
    while _pools:
        _pools.popitem()[1].close()


def eligible(world_size: int, init: bool, start_method: str, store: str, expect_signals: Any, rank_env: Any) -> bool:
    """Whether a ``run_ranks`` call can run in a pool: a default group over a FileStore, from the
    forkserver, no rank expected to die by a signal, the same environment on every rank but for
    the job's own variables (an inductor cache dir per rank or per host)."""
    return (
        world_size in SIZES
        and init
        and start_method == "forkserver"
        and store == "file"
        and not expect_signals
        and all(set(env) <= set(JOB_VARIABLES) for env in (rank_env or {}).values())
    )
