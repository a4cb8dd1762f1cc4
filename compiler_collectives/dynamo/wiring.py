"""The runtime's wiring: every setter and registry below the seam, filled at install.

The package's ``runtime.install()`` (the composition root) runs
``dynamo.install``, which runs ``wire()`` once torch is patched. The layers
below (agreements, transport, health, store) have no import side effects:
each offers a setter or a registry, and ``wire()`` fills every one of them:

* the seams themselves: ``bound.moments`` (the runtime's moments, which our
  replacements of torch's reset and destroy run);
* agreements.failure: ``connect`` (transport's ``set_peer_report_handler``,
  what the heartbeat does with a peer's failure report, and the latch's
  explainer, how a peer's failure report names the absent ranks); wired
  before any heartbeat thread runs, since install runs at import and the
  heartbeat starts with our first group;
* transport: ``set_first_rendezvous`` (the setup check, ``agreements.scope``)
  and ``add_progress_source`` (what the heartbeat says of the compiler
  collective, the guard collective and the audit);
* agreements.setup: ``register_source`` (switches only known at run time);
* ``torch_view.adopt``: everything the layers below may see of torch, from
  the seam table's originals (the c10d store, ``no_python_dispatcher``, the
  compile id, the profiler's flag, torch's wrapper frames and Dynamo's output
  code, how a group is named, the operator types and ``normalize_function``);
* the ledger: ``add_reader`` (``tooling.read``: our artifacts in torch's
  structured trace, each written from the record the ledger adds).

``wire()`` is idempotent (a source registered twice is kept once).
``unwire()`` (uninstall) drops what only makes sense while we are patched
into torch: the artifacts' reader and how the audit names a group. Nothing
wired here is dropped by ``compiler_collectives.reset()``, a destroyed
default group or a fork: each is listed as wired in the runtime's ``STATE``,
and the ledger keeps its readers, so none of them wires again.
"""

from __future__ import annotations

import dataclasses
import functools

from .. import torch_view
from ..agreements import audit_verdict, compiler, failure, guard, guard_frames, scope, setup
from ..ledger import ledger
from ..transport import groups, set_first_rendezvous
from . import audit_seam, bound, compiler_seam, guard_seam, table, tooling


def wire(moments: bound.Moments) -> None:
    """Connect every setter and registry of the layers below (idempotent; after install's patching)."""
    bound.moments = moments
    # health and transport: no torch internal involved
    failure.connect()  # the heartbeat's handler of a peer's report, and the health layer's explainer
    set_first_rendezvous(scope.first_rendezvous)
    for source in (compiler.progress, guard.progress, audit_verdict.progress):
        groups.add_progress_source(source)
    setup.register_source(guard_seam.setup_items)
    torch_view.adopt(view())
    guard_frames.forget_code_kinds()  # classified against the view's wrapper frames from now on
    ledger.add_reader(tooling.read)


def view() -> torch_view.TorchView:
    """What the layers below may only see of torch, through the seam table."""
    originals = bound.originals
    orig_code_map = originals["orig_code_map"]
    profiler_enabled = torch_view.TorchView.profiler_enabled
    if table.holds("profiler_enabled"):
        owner, attr = table.place(table.named("profiler_enabled"))
        profiler_enabled = functools.partial(getattr, owner, attr)  # a plain read: the guard hook's path
    return torch_view.TorchView(
        default_store=originals["get_default_store"],
        enqueue_context=originals["no_python_dispatcher"],
        compile_id=compiler_seam.current_compile_id,
        profiler_enabled=profiler_enabled,
        wrapper_locals=guard_seam.wrapper_locals(),
        is_dynamo_output_code=lambda code: code in orig_code_map,
        resolve_group=audit_seam.group_text,
        op_overload=originals["OpOverload"],
        op_overload_packet=originals["OpOverloadPacket"],
        normalize=originals["normalize_function"] if table.holds("normalize_function") else None,
    )


def unwire() -> None:
    """Uninstall: drop what only holds while we are patched into torch."""
    torch_view.adopt(dataclasses.replace(torch_view.view, resolve_group=torch_view.TorchView.resolve_group))
    ledger.remove_reader(tooling.read)
