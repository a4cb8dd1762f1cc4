"""Helpers that run inside a rank process: a graph-recording backend and summaries.

Rank functions return plain data (lists, dicts, ints) so that the parent can
compare ranks without touching torch objects.
"""

from __future__ import annotations

from typing import Any

import torch

_patched: list[tuple[Any, str, Any, Any]] = []
_ABSENT = object()  # the name was not in the owner's own namespace (a class's inherited method)


def patch(owner: Any, name: str, value: Any) -> None:
    """In a rank: ``owner.name = value`` (a fault injected, a call watched), undone by
    ``undo_patches``, which a pool's rank runs after each test (``tests/pool.py``); a fresh
    rank's process ends with its test. Assigning directly instead leaves the patch to the
    next test in the pool, and fails this one."""
    # The owner's own entry, not getattr's: a class's staticmethod or a pybind method read
    # through getattr and set back would no longer bind as it did.
    _patched.append((owner, name, vars(owner).get(name, _ABSENT), value))
    setattr(owner, name, value)


def undo_patches() -> None:
    """Put back what ``patch`` replaced, last first.

    A patch of a function that one of the package's seams replaces once a compile needs it (its
    optional levels, ``dynamo/bound.py``: inductor's post-grad passes, say) may have been wrapped
    since: the package bound its seam over the test's function, which it now holds as torch's
    own. Its levels are put back first (the test's function is in place again, and the package
    binds them afresh at the next compile that needs them), then torch's function."""
    while _patched:
        owner, name, original, value = _patched.pop()
        if vars(owner).get(name, _ABSENT) is not value:
            from compiler_collectives.dynamo import bound

            bound.unbind_levels()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def init_gloo(rank: int, world: int, init_method: str, timeout_s: float = 60.0) -> None:
    """In a rank that starts its own default group (``run_ranks(..., init=False)``): gloo at ``init_method``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


class GraphRecorder:
    """A torch.compile backend that records every graph's inputs, then runs it.

    For every compiled graph it keeps, per tensor placeholder, the size with
    symbolic dims written as "s" (dynamic) and concrete ones as ints, and the
    number of symbolic-int placeholders. The graph runs eagerly, or through
    ``backend`` (e.g. "aot_eager", which functional collectives need).
    """

    def __init__(self, backend: str | None = None) -> None:
        self.graphs: list[list[Any]] = []  # per graph: tensor input shapes
        self.symbolic_ints: list[int] = []  # per graph: number of SymInt inputs
        self._backend = backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        shapes = []
        symbolic_ints = 0
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                shapes.append(["s" if isinstance(d, torch.SymInt) else int(d) for d in value.shape])
            elif isinstance(value, torch.SymInt):
                symbolic_ints += 1
        self.graphs.append(shapes)
        self.symbolic_ints.append(symbolic_ints)
        if self._backend is not None:
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend(self._backend)(gm, example_inputs)
        return gm.forward

    @property
    def count(self) -> int:
        return len(self.graphs)


def summary(recorder: GraphRecorder) -> dict[str, Any]:
    import compiler_collectives as cc

    s = cc.stats()
    return {
        "graphs": recorder.graphs,
        "symbolic_ints": recorder.symbolic_ints,
        "compiles": recorder.count,
        "collectives": s["compiler_collectives"],
        "input_exchanges": s["compiler_input_exchanges"],
        "restarts": s["restarts"],
        "restarts_skipped": s["restarts_skipped"],
        "guard_collectives": s["guard_collectives"],
        "forced_recompiles": s["forced_recompiles"],
        "bytes_sent": s["compiler_bytes_sent"],
        "audit_exchanges": s["audit_exchanges"],
        "audit_divergences": s["audit_divergences"],
    }


def caught(call: Any) -> dict[str, Any]:
    """Run ``call`` in a rank; describe what it raised (our error's type, message, ranks,
    level) and how long it took, as plain data for the parent to assert on."""
    import time

    import compiler_collectives as cc

    start = time.monotonic()
    try:
        call()
    except cc.CollectiveError as e:
        return {
            "type": type(e).__name__,
            "message": str(e),
            "ranks": list(e.ranks),
            "level": getattr(e, "level", None),
            "seconds": time.monotonic() - start,
        }
    return {"type": None, "seconds": time.monotonic() - start}


LEFT_RUNNING = 17  # exit code of a rank that still had our thread or groups when Python finalized


def nothing_of_ours_left_when_python_finalizes() -> None:
    """An exit handler: registered before the package's own (at its first group), it runs after
    it (last in, first out) and sees what finalization would meet. A thread or group of ours still
    there ends the process with ``LEFT_RUNNING``, saying what was left."""
    import os
    import sys
    import threading

    from compiler_collectives.transport import groups

    threads = [t.name for t in threading.enumerate() if t.name.startswith("compiler_collectives") and t.is_alive()]
    left = sorted(groups.existing())
    if threads or left:
        print(f"left running at exit: threads {threads}, groups {left}", file=sys.stderr, flush=True)
        os._exit(LEFT_RUNNING)


def on_host(rank: int, world: int, hosts: int) -> None:
    """In a rank, before our groups exist: put it on host ``rank * hosts // world`` of ``hosts``
    (``GROUP_RANK``, as torchrun's agents set it: consecutive ranks share a host). A pool's rank
    gets its environment back after the test."""
    import os

    os.environ["GROUP_RANK"] = str(rank * hosts // world)


def kept_logs(logger: str, level: str = "INFO") -> list[str]:
    """A list that fills with the messages ``logger`` (and its children) logs at ``level`` or above."""
    import logging

    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    logging.getLogger(logger).addHandler(Keep(level=getattr(logging, level)))
    return kept


def line_of(path: str, marker: str) -> int:
    """Line number in ``path`` of the line ending with ``# <marker>`` (what error messages cite)."""
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if line.rstrip().endswith(f"# {marker}"):
                return number
    raise AssertionError(marker)
