"""The runtime's wiring: every setter and registry below the seam, filled at install.

The package's ``runtime.install()`` (the composition root) runs
``dynamo.install``, which runs ``wire()`` once torch is patched. The layers
below (agreements, transport, health) have no import side effects: each
offers setters and registries, and ``wire()`` fills every one of them:

* the seams themselves: ``bound.moments`` (the runtime's moments, which our
  replacements of torch's reset and destroy run);
* agreements.failure: ``connect`` (transport's ``set_peer_report_handler``,
  what the heartbeat does with a peer's failure report, and health's
  ``set_explainer``, how a peer's failure report names the absent
  ranks (the transport's diagnosis); wired before any heartbeat thread runs,
  since install runs at import and the heartbeat starts with our first group;
* transport: ``set_first_rendezvous`` (the setup check, ``agreements.scope``)
  and ``add_progress_source`` (what the heartbeat says of the compiler
  collective, the guard collective and the audit);
* transport: ``set_enqueue_context`` (torch's ``no_python_dispatcher``: our
  gloo operations started inside a compile leave torch's Python dispatcher);
* store.calls: ``set_default_store_source`` (the c10d store);
* agreements.setup: ``register_source`` (switches only known at run time);
* agreements.compiler: ``set_compile_id_source``;
* agreements.guard: ``set_profiler_probe``; agreements.guard_frames:
  ``set_frame_sources``;
* the ledger: ``add_reader`` (``tooling.read``: our artifacts in torch's
  structured trace, each written from the record the ledger adds);
* agreements.fingerprint: ``set_group_resolver`` and ``set_operators``
  (torch's operator types and ``normalize_function``).

``wire()`` is idempotent (a source registered twice is kept once).
``unwire()`` (uninstall) drops what only makes sense while we are patched
into torch: the artifacts' reader and the audit's group resolver. Nothing
wired here is dropped by ``compiler_collectives.reset()``, a destroyed
default group or a fork: each setter below the seam is declared
``process_state.wired`` (``process_state.describe()`` lists what each moment
clears), and the ledger keeps its readers, so none of them wires again.
"""

from __future__ import annotations

import functools

from ..agreements import audit_verdict, compiler, failure, fingerprint, guard, guard_frames, scope, setup
from ..ledger import ledger
from ..store import calls as store_calls
from ..transport import groups, set_enqueue_context, set_first_rendezvous
from . import audit_seam, bound, compiler_seam, guard_seam, table, tooling


def wire(moments: bound.Moments) -> None:
    """Connect every setter and registry of the layers below (idempotent; after install's patching)."""
    originals = bound.originals
    bound.moments = moments
    # health and transport: no torch internal involved
    failure.connect()  # the heartbeat's handler of a peer's report, and the health layer's explainer
    set_first_rendezvous(scope.first_rendezvous)
    for source in (compiler.progress, guard.progress, audit_verdict.progress):
        groups.add_progress_source(source)
    setup.register_source(guard_seam.setup_items)
    # what the layers below may only see of torch through the seam table
    store_calls.set_default_store_source(originals["get_default_store"])
    set_enqueue_context(originals["no_python_dispatcher"])
    compiler.set_compile_id_source(compiler_seam.current_compile_id)
    orig_code_map = originals["orig_code_map"]
    guard_frames.set_frame_sources(guard_seam.wrapper_locals(), lambda code: code in orig_code_map)
    if table.holds("profiler_enabled"):
        owner, attr = table.place(table.named("profiler_enabled"))
        guard.set_profiler_probe(functools.partial(getattr, owner, attr))  # a plain read: the guard hook's path
    ledger.add_reader(tooling.read)
    fingerprint.set_group_resolver(audit_seam.group_text)
    fingerprint.set_operators(
        originals["OpOverload"],
        originals["OpOverloadPacket"],
        originals["normalize_function"] if table.holds("normalize_function") else None,
    )


def unwire() -> None:
    """Uninstall: drop what only holds while we are patched into torch."""
    fingerprint.set_group_resolver(None)
    ledger.remove_reader(tooling.read)
