"""Compile once's seams: AOTAutograd's cache lookup, and what a compile reads and writes in torch's caches.

Rows of the seam table's optional level "once", bound with the audit's levels when a compile
first finds inductor imported (``audit_seam.ensure_backend_seams``):

* ``autograd_cache_key`` (replaced): AOTAutograd computes the cache key first thing in its
  lookup (``AOTAutogradCache.try_load``); right after, and before the lookup reads the cache,
  the ranks exchange keys (the machine's ``SettleKeys``), and a loading rank waits for the rank
  that compiles and installs its artifact, so the lookup that follows finds it. Our errors
  raised there leave through the compile scope's boundary, latched, and are raised after the
  lookup (which would otherwise take any exception for a cache bypass).
* ``AOTAutogradCache.try_load`` (replaced): marks the lookup, and after it has a loading rank
  report whether it hit.
* ``FxGraphCache._lookup_graph`` and ``codecache.write`` (replaced, pass-through): the FX graph
  cache keys and the kernel sources a compile (or a load) used, the parts of the artifact.
* ``AOTAutogradCache``, ``FxGraphCache`` and ``cache_dir`` (read): where those files live.
* torch's compile-time collective switches (read through the config module rows; a switch a
  release lacks is off there): ``_sync_decision_cross_ranks``, ``_sync_cache_decision_cross_ranks``
  (functorch), ``distributed_max_autotune_gemm`` (inductor) and
  ``runtime_estimations_align_across_all_distributed_ranks`` (inductor comms).

The AOTAutograd compile itself is wrapped here (``aot_compile``, called by the aot seam
``audit_seam.aot_module_simplified``): the backward lowered with the forward, the cache key
computed with the user's own lowering setting, and compile once's driver around it
(``around_aot``). Every seam here leaves our code through ``compile_scope.boundary``: our error
is latched in the compile's scope, and the seam around Dynamo's compile raises it in place of
the ``BackendCompilerFailed`` torch wraps it in.

What compile once costs shows in Dynamo's compile timings as three ``dynamo_timed`` events
(each a chromium event in ``TORCH_TRACE``, tlparse's trace view, and a key of
``torch._dynamo.utils.compile_times()``), each opened and closed in one function, so they nest
inside AOTAutograd's own events:

* ``compile_once`` (``EVENT``): the whole AOTAutograd compile under compile once, with this
  rank's role added at its end: on a compiling or serving rank, the compile it did for others.
* ``compile_once_wait`` (``EVENT_WAIT``): a loading rank waits for its source, takes the result
  exchange, receives and installs the artifact (at the key seam).
* ``compile_once_finish`` (``EVENT_FINISH``): every other rank's end of the graph: the serving
  rank collects and sends its artifact; then the result and load-report exchanges.

Each finished graph also writes a ``compile_once`` artifact (``tooling.read``, from its ledger record).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .. import config
from ..agreements import audit, compile_scope, compiler, once
from ..errors import CollectiveError, CompileOnceError
from ..observations import FrameId
from . import bound, table

log = logging.getLogger("compiler_collectives.dynamo")

T = TypeVar("T")

EVENT = "compile_once"
EVENT_WAIT = "compile_once_wait"
EVENT_FINISH = "compile_once_finish"

# (config module row, flag): torch's collectives that run inside a compile.
SWITCHES = (
    ("functorch_config", "_sync_decision_cross_ranks"),
    ("functorch_config", "_sync_cache_decision_cross_ranks"),
    ("inductor_config", "distributed_max_autotune_gemm"),
    ("inductor_config_comms", "runtime_estimations_align_across_all_distributed_ranks"),
)


class _Cache:
    """Torch's compile caches, through the seam table's rows."""

    def root(self) -> str:
        path: str = bound.originals["inductor_cache_dir"]()
        return path

    def aot_dir(self, key: str) -> str:
        path: str = bound.originals["AOTAutogradCache"]._get_tmp_dir_for_key(key)
        return path

    def fx_dir(self, key: str) -> str:
        path: str = bound.originals["FxGraphCache"]._get_tmp_dir_for_key(key)
        return path

    def compiler(self) -> str:
        return _compiler()


@functools.cache
def _compiler() -> str:
    """The C++ compiler inductor builds with and its version, once per process ("" where the seam
    table's rows are missing on this release)."""
    name_of, version_of = bound.originals.get("cpp_compiler"), bound.originals.get("compiler_version_info")
    if name_of is None or version_of is None:
        return ""
    try:
        name = str(name_of())
        return once.build.compiler_text(name, str(version_of(name)))
    except Exception as e:  # noqa: BLE001 - no compiler here: the fingerprint says so, no kernel is built anyway
        log.debug("compile once: no C++ compiler found for the build fingerprint: %s", e)
        return ""


CACHE = _Cache()


def set_frame(frame: FrameId | None) -> None:
    """The frame whose graph the backend compiles in this compile now (for messages)."""
    scope = compile_scope.current()
    if scope is not None:
        scope.frame = frame


@contextlib.contextmanager
def backward_lowered_with_forward() -> Iterator[None]:
    """AOTAutograd lowers the backward with the forward inside (the audit and compile once need
    it), while the cache key stays the one the user's own setting gives (``cache_key``)."""
    scope = compile_scope.current()
    if scope is None:  # outside a frame compile: no cache key of ours to keep
        with bound.config_patch("force_non_lazy_backward_lowering", True):
            yield
        return
    previous = scope.user_lowering
    scope.user_lowering = bool(bound.current("force_non_lazy_backward_lowering"))
    try:
        with bound.config_patch("force_non_lazy_backward_lowering", True):
            yield
    finally:
        scope.user_lowering = previous


def _key_as_the_user_set_it(original: Callable[..., T], args: Any, kwargs: Any) -> T:
    """AOTAutograd's cache key computed with the backward lowering the user chose.

    The setting is part of the key (the functorch config and the AOTConfig), so the eager
    lowering we set would give every graph another key than a run without the service: a cache
    warmed by a 1-rank run, or with the service off, would never serve a job with it on. The
    entry is the same either way: it is saved once the backward is compiled, lazily or not, and
    holds both compiles.
    """
    scope = compile_scope.current()
    user = None if scope is None else scope.user_lowering
    aot_config = args[2] if len(args) > 2 else kwargs.get("config")
    if user is None or user or not isinstance(aot_config, bound.originals["AOTConfig"]):
        return original(*args, **kwargs)
    # A frozen dataclass: the key is computed over a copy with the user's setting.
    as_set = dataclasses.replace(aot_config, force_non_lazy_backward_lowering=user)
    if len(args) > 2:
        args = (*args[:2], as_set, *args[3:])
    else:
        kwargs = {**kwargs, "config": as_set}
    with bound.config_patch("force_non_lazy_backward_lowering", user):
        return original(*args, **kwargs)


def aot_compile(compile: Callable[[], T], mod: Any, args: Any, *, sharing: bool) -> T:
    """One AOTAutograd compile of an audited graph or one compile once takes part in (the aot
    seam, ``audit_seam.aot_module_simplified``, calls it).

    The backward is lowered with the forward: its program is then part of this compile's one
    exchange, on every rank, and of the cache entry's program (``agreements/entry_program.py``). Lowered
    lazily, it would compile at its first backward only on the ranks that run it, maybe in
    another entry. Compile once needs it too: AOTAutograd saves a training graph's cache entry
    only once its backward is compiled, and the loading ranks wait for that entry."""
    with backward_lowered_with_forward():
        if sharing:
            return around_aot(compile, mod, args)
        return compile()


def applies() -> bool:
    """Whether this AOTAutograd compile takes part in compile once."""
    if not config.settings.compile_once:
        return False
    if not bound.current("enable_compiler_collectives") or not compiler.distributed():
        return False
    # A compile outside a frame compile (a backward compiled lazily at its first run) happens on
    # whichever ranks run it first: no exchange can pair up there.
    if bound.originals["CompileContext"].try_get() is None:
        return False
    return torch.distributed.get_world_size() > 1


def switches_on() -> list[str]:
    """The names of torch's compile-time collectives switched on in this process."""
    on = []
    for row, flag in SWITCHES:
        module = bound.originals.get(row)
        if module is not None and bool(getattr(module, flag, False)):
            on.append(flag)
    return on


def graph_digest(mod: Any, args: Any) -> str:
    """A digest of the graph handed to AOTAutograd, its inputs (dtype, shape, whether they need a
    gradient) and the grad mode: ranks with equal ones run the same inductor compiles in the same
    order (a forward and a backward, or an inference graph)."""
    # The graph's text, not ``gm.code``: reading that recompiles a lazy GraphModule now, which
    # moves the attributes AOTAutograd's cache key pickles into another order (another key than
    # a run without the service would compute).
    graph = getattr(getattr(mod, "gm", mod), "graph", None)
    if graph is None:
        return ""
    code = str(graph)
    h = hashlib.blake2b(code.encode(), digest_size=16)
    h.update(f"grad={torch.is_grad_enabled()}".encode())
    for a in args if isinstance(args, (list, tuple)) else ():
        if isinstance(a, torch.Tensor):
            h.update(f"|{a.dtype}{tuple(a.shape)}{a.requires_grad}".encode())
        else:
            h.update(f"|{type(a).__name__}".encode())
    return h.hexdigest()


def around_aot(compile: Callable[[], T], mod: Any = None, args: Any = ()) -> T:
    """One AOTAutograd compile under compile once (called by the aot seam), timed as ``EVENT``."""
    scope = compile_scope.current()
    frame = (None if scope is None else scope.frame) or FrameId("<unknown>", "<unknown>", 0)
    graph = once.begin(frame, CACHE, "aot", graph_digest(mod, args), SPANS)
    # Ours that leaves here goes into the backend's code (Dynamo wraps it in BackendCompilerFailed):
    # the aot seam that called this is a boundary, so the seam around Dynamo's compile raises it.
    with _timed(EVENT):
        try:
            result = _compiled(graph, compile, "")
        finally:
            # The role is known only after the key exchange, inside the compile: added at the end.
            _describe(EVENT, graph)
    return result


def _compiled(graph: once.Driver, compile: Callable[[], T], no_lookup: str) -> T:
    """Run ``compile`` and tell ``graph`` how it ended (``no_lookup``: why it took no lookup, if
    it took none)."""
    try:
        result = compile()
    except CollectiveError:
        graph.abandon()  # our exchanges failed: no further one can be trusted
        raise
    except BaseException as e:
        graph.compile_ended(audit.failure_text(e), no_lookup)
        raise
    if not no_lookup and bound.levels.get("once") is False:
        no_lookup = f"torch {torch.__version__} lacks compile once's seams (see the warning)"
    graph.compile_ended(None, no_lookup)
    return result


@contextlib.contextmanager
def _timed(event: str) -> Iterator[None]:
    """A ``dynamo_timed`` event: in Dynamo's compile timings, and a chromium event in ``TORCH_TRACE``."""
    with bound.originals["dynamo_timed"](event, log_pt2_compile_event=True):
        yield


def _describe(event: str, graph: once.Driver, **more: object) -> None:
    """Add what compile once knows of ``graph`` to ``event`` (in progress on this thread)."""
    if _can_describe():
        bound.originals["try_add_pt2_compile"](event, **graph.describe(), **more)


@functools.cache
def _can_describe() -> bool:
    """Whether torch can add data to an event in progress (a read of the seam table that degrades)."""
    return "try_add_pt2_compile" in bound.originals and table.holds("try_add_pt2_compile")


class _Spans:
    """The driver's runs of actions as Dynamo's timed events: a loader's fetch (``EVENT_WAIT``),
    any other rank's end of the graph (``EVENT_FINISH``)."""

    @contextlib.contextmanager
    def span(self, name: str, driver: once.Driver) -> Iterator[None]:
        event = EVENT_WAIT if name == "wait" else EVENT_FINISH
        with _timed(event):
            try:
                yield
            finally:
                times = driver.times
                more: dict[str, object] = {"waited_s": round(times.waited_s, 6)}
                if event == EVENT_WAIT:
                    more["bytes_received"] = times.bytes_in
                _describe(event, driver, **more)


SPANS = _Spans()


@compile_scope.boundary
def try_load(*args: Any, **kwargs: Any) -> Any:
    original = bound.originals["AOTAutogradCache.try_load"]
    graph = once.current()
    scope = compile_scope.current()
    if graph is None or graph.graph.level != "aot" or scope is None:
        return original(*args, **kwargs)
    # Our error that leaves the key seam below is latched in this compile's scope: AOTAutograd's
    # lookup takes any exception for a cache bypass, so it is raised here, after the lookup.
    graph.lookup_began()
    latched_before = scope.error
    try:
        result = original(*args, **kwargs)
    except BaseException as e:
        # Strict cache modes re-raise what the lookup hit (our refusal's bypass, say): ours first.
        if scope.error is not latched_before:
            scope.raise_latched(e)
        graph.lookup_ended(None, raised=True)  # a loader's peers wait for its report: a miss
        raise
    if scope.error is not latched_before:
        scope.raise_latched()
    graph.lookup_ended(result[0] is not None)
    return result


@compile_scope.boundary
def cache_key(*args: Any, **kwargs: Any) -> Any:
    original = bound.originals["autograd_cache_key"]
    graph = once.current()
    if graph is None or graph.graph.level != "aot":
        return _key_as_the_user_set_it(original, args, kwargs)
    try:
        key_and_lines = _key_as_the_user_set_it(original, args, kwargs)
    except Exception as e:
        try:
            graph.key(None, f"{type(e).__name__}: {str(e).strip()[:300]}", switches_on)
        except CollectiveError as ours:
            compile_scope.leave(ours)  # raised after the lookup (try_load), which takes e for a bypass
        raise
    try:
        refused = graph.key(key_and_lines[0], None, switches_on)
    except Exception as e:  # noqa: BLE001 - named and re-raised past AOTAutograd's catch-all
        # AOTAutograd's lookup takes any exception for a bypass: ours is latched, and raised after
        # the lookup (try_load).
        named = e if isinstance(e, CollectiveError) else _unexpected(e, graph)
        compile_scope.leave(named)
        raise bound.originals["BypassAOTAutogradCache"](str(named)) from named
    if refused:
        raise bound.originals["BypassAOTAutogradCache"](
            "compiler_collectives compile once: this rank refused the artifact another rank compiled; "
            "it compiles the graph itself"
        )
    return key_and_lines


def _unexpected(error: Exception, graph: once.Driver) -> CollectiveError:
    """Something that is not ours failed during our exchange or install: named, never a silent bypass."""
    return CompileOnceError(
        f"compile once #{graph.graph.seq} of {graph.graph.frame}: {type(error).__name__}: {error}",
        kind="compile_once",
        seq=graph.graph.seq,
        frame=str(graph.graph.frame),
    )


@compile_scope.boundary
def compile_fx_inner(*args: Any, **kwargs: Any) -> Any:
    """Inductor's compile of one FX graph: shared at the FX graph cache (the fallback level) when
    its AOTAutograd compile could not be shared by any rank."""
    original = bound.originals["_compile_fx_inner"]
    outer = once.current()
    if outer is None or not outer.nests_fx():
        return original(*args, **kwargs)
    graph = once.begin(outer.graph.frame, CACHE, "fx", spans=SPANS)
    return _compiled(
        graph,
        lambda: original(*args, **kwargs),
        "inductor did not look this graph up in its FX graph cache",
    )


@compile_scope.boundary
def prepare_key(*args: Any, **kwargs: Any) -> Any:
    original = bound.originals["FxGraphCache.prepare_key"]
    graph = once.current()
    if graph is None or graph.graph.level != "fx":
        return original(*args, **kwargs)
    key_info, cache_info = original(*args, **kwargs)
    key = key_info[0] if isinstance(key_info, tuple) and isinstance(key_info[0], str) else None
    why = None if key is not None else str((cache_info or {}).get("cache_bypass_reason", "no FX graph cache key"))
    graph.lookup_began()
    if graph.key(key, why[:300] if why else None, switches_on):
        graph.lookup_ended(None)  # before compiling: the others then wait for its post
        return None, {"cache_state": "bypass", "cache_bypass_reason": "compiler_collectives refused the artifact"}
    return key_info, cache_info


@compile_scope.boundary
def load_with_key(*args: Any, **kwargs: Any) -> Any:
    graph = once.current()
    if graph is None or graph.graph.level != "fx":
        return bound.originals["FxGraphCache.load_with_key"](*args, **kwargs)
    try:
        result = bound.originals["FxGraphCache.load_with_key"](*args, **kwargs)
    except BaseException:
        graph.lookup_ended(None, raised=True)  # a loader's peers wait for its report: a miss
        raise
    graph.lookup_ended(isinstance(result, tuple) and result[0] is not None)
    return result


@compile_scope.boundary
def lookup_entry(*args: Any, **kwargs: Any) -> Any:
    """AOTAutograd's lookup of one key's entries: which one hit (its pickle's digest is the
    entry file's), so a loading rank knows whether it runs the entry it was sent."""
    result = bound.originals["AOTAutogradCache._lookup"](*args, **kwargs)
    graph = once.current()
    if graph is not None and isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], bytes):
        graph.note_hit(result[1])
    return result


@compile_scope.boundary
def lookup_graph(key: Any, *args: Any, **kwargs: Any) -> Any:
    graph = once.current()
    if graph is not None and isinstance(key, str):
        graph.note_fx_key(key)
    return bound.originals["FxGraphCache._lookup_graph"](key, *args, **kwargs)


@compile_scope.boundary
def write_source(*args: Any, **kwargs: Any) -> Any:
    result = bound.originals["codecache.write"](*args, **kwargs)
    graph = once.current()
    if graph is not None and isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], str):
        graph.note_source(result[1])
    return result
