"""The compiler collective's seam: where Dynamo's first trace of a frame meets the exchange.

* ``get_compile_pg`` (in ``convert_frame`` and ``distributed``): hands Dynamo
  our gloo compile group while compiler collectives are on.
* ``DistributedState``: Dynamo's constructor call for the per-compile box;
  ours also runs the input exchange (the frame's arguments, predicted).
* ``process_automatic_dynamic`` (``pgo``, also bound by name in
  ``variables.builder``): the first trace records what Dynamo observed; a
  restarted trace applies every rank's observations in rank order.
* ``run_compiler_collective``: the end-of-trace exchange and the restart
  decision (``agreements.compiler``).
* ``_compile``: raises the error the guard hook parked on this thread (the
  latch), refuses a thread other than the one that owns this rank's
  collectives (before any exchange: ``guard_owner.claim_for_compile``), opens the
  compile's scope (``agreements.compile_scope``) and raises our error latched
  there in place of whatever torch wrapped it in, and tells entry agreement
  which cache entries each frame's compiles add (bounded by Dynamo's
  ``accumulated_recompile_limit``).

Every seam here that torch calls leaves our code through
``compile_scope.boundary``.
* ``torch._dynamo.reset`` (what ``torch.compiler.reset()`` calls): Dynamo's
  caches go, and entry agreement's registry of them with them.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from .. import config, health
from ..agreements import compile_scope, compiler, entry, guard_owner, guard_paths
from ..ledger import ledger
from ..observations import DYNAMIC, DistributedState, FrameId, InferStride, LocalState, SizeEntry
from ..records import Restart
from . import bound, guard_seam
from .convert import entry_from_torch, entry_to_torch

log = logging.getLogger("compiler_collectives.dynamo")


def compiler_collectives_flag() -> bool:
    return bool(bound.current("enable_compiler_collectives"))


def set_compiler_collectives_flag(value: bool) -> None:
    bound.set_current("enable_compiler_collectives", value)


def frame_of(code: Any) -> FrameId:
    return FrameId(code.co_name, code.co_filename, code.co_firstlineno)


@compile_scope.boundary
def get_compile_pg() -> Any:
    if compiler_collectives_flag() and compiler.distributed():
        return compiler.group_for_compile()
    return None


@compile_scope.boundary
def process_automatic_dynamic(tx: Any, name: str, entry: Any, *, is_unspecialized_nn_module: bool = False) -> Any:
    st = tx.distributed_state
    if not isinstance(st, DistributedState):
        # No collective for this compile (or torch's own box): torch's logic.
        return bound.originals["process_automatic_dynamic"](
            tx, name, entry, is_unspecialized_nn_module=is_unspecialized_nn_module
        )
    update = bound.originals["update_automatic_dynamic"]
    if st.all_states is None:
        # First trace: record what Dynamo observed. A frame argument whose
        # entries every rank exchanged before the trace is decided now, from
        # the prior frame state joined with every rank's entry (on a copy:
        # the frame state itself is updated once, after the exchange). Any
        # other source is traced as static, as in torch's preflight.
        st.local_state.automatic_dynamic[name] = entry_from_torch(entry)
        st.origins[name] = tx
        if name in st.early_names:
            return _joined_early_entry(st, tx, name)
        return entry
    result = None
    for state in st.all_states:  # rank order; includes this rank's own state
        observed = state.automatic_dynamic.get(name)
        if observed is not None:
            result = update(tx, name, entry_to_torch(observed), is_unspecialized_nn_module=is_unspecialized_nn_module)
    if result is None:
        # No rank saw this source in its preflight (the trace went elsewhere
        # after the exchange); decide from this rank's observation alone.
        log.debug("source %s was not in any rank's preflight; using the local observation", name)
        result = update(tx, name, entry, is_unspecialized_nn_module=is_unspecialized_nn_module)
    return result


def _prior_entry(tx: Any, name: str) -> Any:
    torch_of = bound.originals
    code_state = torch_of["get_code_state"]().get(torch_of["CodeId.make"](tx.f_code, tx.closure))
    prior = None if code_state is None else code_state.automatic_dynamic.get(name)
    return torch_of["FrameStateSizeEntry"]() if prior is None else prior


def _joined_early_entry(ds: DistributedState, tx: Any, name: str) -> Any:
    """prior ⊔ every rank's exchanged entry for ``name``, in rank order, on a copy."""
    joined = copy.copy(_prior_entry(tx, name))
    assert ds.early_states is not None
    for state in ds.early_states:
        observed = state.automatic_dynamic.get(name)
        if observed is not None:
            joined |= entry_to_torch(observed)
    return joined


def predicted_entry(value: Any) -> SizeEntry | None:
    """What Dynamo's builder will record for a frame argument, or None if we cannot tell.

    Mirrors ``record_automatic_dynamic`` (tensors, with its stride inference)
    and ``make_scalar`` (ints). A wrong prediction costs a restart, never a
    wrong decision: the restart check compares it with what Dynamo recorded.
    """
    if type(value) is int:
        return SizeEntry(scalar=value, size=DYNAMIC, stride=DYNAMIC)
    if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.layout is not torch.strided:
        return None
    if value.is_nested or value.device.type == "meta":
        return None
    size = tuple(int(s) for s in value.size())
    ex_stride = value.stride()
    stride: list[Any] = [None] * len(size)
    candidates: dict[int, Any] = {}
    for i_stride, neg_i in sorted((ex_stride[i], -i) for i in range(len(size))):
        i = -neg_i
        stride[i] = candidates.get(i_stride, i_stride)
        candidates.setdefault(i_stride * size[i], InferStride(i))
    return SizeEntry(scalar=DYNAMIC, size=size, stride=tuple(stride))


@compile_scope.boundary
def new_distributed_state(compile_pg: Any, local_state: LocalState) -> DistributedState:
    """Dynamo's constructor call for the per-compile box; also runs the input exchange."""
    ds = DistributedState(compile_pg, local_state)
    scope = compile_scope.current()
    if scope is not None:
        scope.boxes.append(ds)  # ``_compile`` ends it
    pending = None if scope is None else scope.pending
    settings = config.settings
    if (
        pending is None
        or not settings.exchange_inputs_first
        or not settings.skip_needless_restart
        or not bound.current("automatic_dynamic_shapes")
    ):
        return ds
    code, frame_locals = pending
    predicted = LocalState(frame_state_fresh=True)
    for name, value in frame_locals.items():
        entry = predicted_entry(value)
        if entry is not None:
            source = f"L[{name!r}]"
            predicted.automatic_dynamic[source] = entry
            # Dynamo also fakifies a view's base, as the source "<view>._base".
            base = getattr(value, "_base", None) if isinstance(value, torch.Tensor) else None
            base_entry = None if base is None else predicted_entry(base)
            if base_entry is not None:
                predicted.automatic_dynamic[f"{source}._base"] = base_entry
    result = compiler.exchange(ds, frame_of(code), state=predicted)
    ds.early_states = result.states
    ds.early_names = frozenset(n for s in result.states for n in s.automatic_dynamic)
    return ds


def _frame_state_fresh(ds: DistributedState) -> bool:
    """True if this rank's frame state cannot change any preflight decision."""
    if not bound.current("automatic_dynamic_shapes"):
        return True  # update_automatic_dynamic overwrites: the entry itself wins
    for name, observed in ds.local_state.automatic_dynamic.items():
        if name in ds.early_names:
            continue  # decided from prior + every rank's entry already
        tx = ds.origins.get(name)
        if tx is None:
            return False
        prior_entry = entry_from_torch(_prior_entry(tx, name))
        if prior_entry == SizeEntry():
            continue  # all unset: the identity of the merge
        if not (
            prior_entry.same_decision_as(observed)
            and prior_entry.excluded_sizes is None
            and prior_entry.excluded_scalar is None
        ):
            return False
    return True


def _apply_without_restart(ds: DistributedState) -> None:
    """Do what the restarted trace's process_automatic_dynamic calls would have done."""
    update = bound.originals["update_automatic_dynamic"]
    assert ds.all_states is not None
    for name in ds.local_state.automatic_dynamic:
        tx = ds.origins[name]
        for state in ds.all_states:
            observed = state.automatic_dynamic.get(name)
            if observed is not None:
                update(tx, name, entry_to_torch(observed))


@compile_scope.boundary
def run_compiler_collective(self: Any) -> None:
    tx = self.root_tx
    ds = tx.distributed_state
    if ds is None or ds.all_states is not None:
        return
    if not isinstance(ds, DistributedState):
        bound.originals["run_compiler_collective"](self)
        return
    ds.local_state.frame_state_fresh = _frame_state_fresh(ds)
    with bound.originals["dynamo_timed"]("compiler_collective", log_pt2_compile_event=True):
        result = compiler.exchange(ds, frame_of(tx.f_code))
    ds.all_states = result.states
    if result.restart:
        ledger.add(Restart(taken=True))
        tx.speculation_log.clear()
        raise bound.originals["CompileCollectiveRestartAnalysis"]
    ledger.add(Restart(taken=False))
    ds.restart_skipped = True
    _apply_without_restart(ds)


def wrap_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo's ``_compile(code, globals, locals, ...)`` with our entry and exit around it."""

    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        health.latch.raise_parked()
        guard_paths.at_compile(sys._getframe(1))
        code = args[0] if args else kwargs.get("code")
        if compiler_collectives_flag() or guard_seam.hook_active():
            # This compile may exchange (compiler collective, audit) or add a cache entry the
            # guard collective and the entry check count on: only the owning thread may.
            guard_owner.claim_for_compile(str(frame_of(code)) if code is not None else "a frame")
        frame_locals = args[2] if len(args) > 2 else kwargs.get("locals")
        # Entry agreement: which cache entries this frame's compiles add, in order.
        building = entry.compile_started(code)
        kept = False
        result = None
        # The compile's scope: the frame for the input exchange, the DistributedState boxes (ended
        # with it, so that nothing of the compile that Dynamo leaves in reference cycles holds our
        # compile group), and our error on its way out.
        with compile_scope.opened((code, frame_locals) if isinstance(frame_locals, dict) else None) as scope:
            try:
                result = original(*args, **kwargs)
                kept = getattr(result, "guarded_code", None) is not None
                return result
            except Exception as e:
                # Ours left our code through a seam's boundary, into whatever torch wraps it in
                # (InternalTorchDynamoError, BackendCompilerFailed): the user gets ours.
                scope.raise_latched(e)
                raise
            finally:
                for box in scope.boxes:
                    box.end()
                if code is not None:
                    entry.compile_finished(
                        code,
                        frame_of(code),
                        building,
                        kept,
                        limit=int(bound.current("accumulated_recompile_limit")),
                        resumes=resume_calls(result) if kept else (),
                    )

    _compile.__compiler_collectives_wrapper__ = True  # type: ignore[attr-defined]  # marks our wrapper for install
    return _compile


def resume_calls(result: Any) -> tuple[str, ...]:
    """The resume functions an entry's code calls, by bytecode offset (``__resume_at_80``).

    Their names end in a process-wide counter, which would differ between ranks
    that compiled other frames in between: left out.
    """
    code = getattr(getattr(result, "guarded_code", None), "code", None)
    names = getattr(code, "co_names", ())
    return tuple(n.rsplit("_", 1)[0] for n in names if n.startswith("__resume_at_"))


def wrap_reset(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._dynamo.reset()``: every cache entry goes, so entry agreement forgets them too."""

    @functools.wraps(original)
    def reset(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            bound.moments.torch_reset()  # the runtime's moment, handed in at install

    return reset


def forget_entries() -> None:
    """``compiler_collectives.reset()``: entry agreement starts again from nothing.

    Frames whose entries ran different programs lose their Dynamo cache
    entries too (``reset_code``), on every rank, since every rank resets
    together: the registry must mirror the cache, and a frame whose old
    entries kept checking beside new ones that do not would desync. The
    registry itself goes in the runtime's ``reset()``, right after.
    """
    reset_code = bound.originals["reset_code"]
    for code in entry.mixed_codes():
        reset_code(code)


def current_compile_id() -> str | None:
    """The id of the compile in progress on this thread ("0/1"), None outside one."""
    try:
        compile_id = bound.originals["CompileContext"].current_compile_id()
    except Exception:  # noqa: BLE001 - outside Dynamo there is no compile id
        return None
    return None if compile_id is None else str(compile_id)
