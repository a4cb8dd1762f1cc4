"""Installing the service into torch and taking it out, in this process: every seam patched once
and put back at uninstall, the guard hook's slot handed back, an install that finds a torch
internal changed or a release outside the supported range refusing to patch anything (or
warning, where a read only coarsens a feature), the wiring of setters and registries made once
and kept through a reset, and ``enabled()`` restoring the previous state.

How the service is switched on in live ranks, and what a forked child keeps:
``tests/ranks/test_activation.py``.
"""

from __future__ import annotations

import pytest
import torch


def _seams_now() -> dict[str, object]:
    """What torch holds at every place we patch, by the name of its row in the seam table."""
    import torch._C._dynamo.eval_frame as c_eval_frame
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.distributed as dynamo_distributed
    import torch._dynamo.eval_frame as eval_frame
    import torch._dynamo.output_graph as output_graph
    import torch._dynamo.pgo as pgo
    import torch._dynamo.variables.builder as builder

    return {
        "get_compile_pg": convert_frame.get_compile_pg,
        "distributed_get_compile_pg": dynamo_distributed.get_compile_pg,
        "get_guard_pg": dynamo_distributed.get_guard_pg,
        "DistributedState": convert_frame.DistributedState,
        "LocalState": convert_frame.LocalState,
        "compile": convert_frame._compile,
        "run_compiler_collective": output_graph.OutputGraph.run_compiler_collective,
        "process_automatic_dynamic": pgo.process_automatic_dynamic,
        "builder_process_automatic_dynamic": builder.process_automatic_dynamic,
        "guard_collectives_hook": eval_frame.guard_collectives_hook,
        "set_guard_complete_hook": c_eval_frame.set_guard_complete_hook,
        "get_and_maybe_log_recompilation_reasons": convert_frame.get_and_maybe_log_recompilation_reasons,
        "call_user_compiler": output_graph.OutputGraph.call_user_compiler,
        "destroy_process_group": torch.distributed.destroy_process_group,
        "c10d_destroy_process_group": torch.distributed.distributed_c10d.destroy_process_group,
        "dynamo_reset": torch._dynamo.reset,
    }


def _guard_slot() -> object:
    """The C++ guard-complete hook slot (tests only: reading it means swapping it)."""
    import torch._C._dynamo.eval_frame as c_eval_frame

    current = c_eval_frame.set_guard_complete_hook(None)
    c_eval_frame.set_guard_complete_hook(current)
    return current


def test_uninstall_puts_back_every_torch_original_and_install_is_idempotent():
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.eval_frame as eval_frame

    import compiler_collectives as cc
    from compiler_collectives import dynamo
    from compiler_collectives.agreements import guard as guard_collective

    cc.install()
    cc.install()
    assert eval_frame.guard_collectives_hook is guard_collective.hook
    patched = {row.name for row in dynamo.table.patched_rows()}
    assert patched == set(_seams_now()), "the seam table's patched rows are not the places we patch"
    originals = {name: dynamo.torch_original(name) for name in patched}
    ours = _seams_now()
    cc.uninstall()
    try:
        now = _seams_now()
        for key, original in originals.items():
            assert now[key] is original, f"{key} is not torch's original after uninstall"
            assert now[key] is not ours[key], key
        assert not cc.is_enabled() and not cc.guards_enabled()
    finally:
        cc.install()
    assert convert_frame._compile is not originals["compile"]


def test_uninstall_hands_the_guard_hook_slot_back_to_torch_own_hook():
    import compiler_collectives as cc
    from compiler_collectives import dynamo
    from compiler_collectives.agreements import guard as guard_collective

    torch_hook = dynamo.torch_original("guard_collectives_hook")
    cc.enable(compiler=False, guards=True)
    try:
        assert _guard_slot() is guard_collective.hook
        cc.uninstall()
        assert _guard_slot() is torch_hook  # guard collectives stay on, as torch's own
        cc.install()
        assert _guard_slot() is guard_collective.hook  # and ours again once reinstalled
        cc.enable(compiler=False, guards=False)
        cc.uninstall()
        assert _guard_slot() is None
    finally:
        cc.install()
        cc.disable()


def test_a_changed_torch_internal_leaves_torch_unpatched(monkeypatch):
    import torch._dynamo.convert_frame as convert_frame

    import compiler_collectives as cc
    from compiler_collectives import dynamo
    from compiler_collectives.errors import UnsupportedTorchError

    cc.uninstall()
    before = _seams_now()
    slot_before = _guard_slot()

    # A torch whose _compile takes its arguments in another order: a fragile read fails.
    def _compile(globals, code, locals, *rest, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(convert_frame, "_compile", _compile)
    try:
        with pytest.raises(UnsupportedTorchError, match="Nothing was patched") as info:
            cc.install()
        assert "torch._dynamo.convert_frame:_compile no longer takes (code, globals, locals" in str(info.value)
        after = _seams_now()
        for key, value in before.items():
            if key != "compile":
                assert after[key] is value, f"{key} was patched although install failed"
        assert convert_frame._compile is _compile
        assert _guard_slot() is slot_before
        assert not dynamo.installed()
    finally:
        monkeypatch.undo()
        cc.install()


def test_every_problem_with_torch_internals_is_reported_in_one_error(monkeypatch):
    import torch._dynamo.output_graph as output_graph
    import torch._dynamo.pgo as pgo

    from compiler_collectives import dynamo
    from compiler_collectives.errors import UnsupportedTorchError

    monkeypatch.delattr(output_graph.OutputGraph, "run_compiler_collective")
    monkeypatch.setattr(pgo, "update_automatic_dynamic", lambda tx, name, entry: entry)
    with pytest.raises(UnsupportedTorchError) as info:
        dynamo.check_seams()
    message = str(info.value)
    assert "2 Dynamo seam(s)" in message
    assert "torch._dynamo.output_graph:OutputGraph.run_compiler_collective is missing" in message
    assert (
        "torch._dynamo.pgo:update_automatic_dynamic no longer takes (tx, name, entry, *, "
        "is_unspecialized_nn_module)" in message
    )


def test_a_read_that_only_coarsens_a_feature_warns_at_install_and_install_goes_on(monkeypatch, caplog):
    import functools
    import logging

    import torch._dynamo.eval_frame as eval_frame

    import compiler_collectives as cc
    from compiler_collectives import dynamo

    cc.uninstall()
    # A torch whose compile wrapper is no longer a plain function: the guard
    # collective can no longer see which function torch.compile wraps.
    monkeypatch.setattr(eval_frame._TorchDynamoContext, "__call__", functools.partial(print))
    try:
        with caplog.at_level(logging.WARNING, logger="compiler_collectives.dynamo"):
            cc.install()
        assert dynamo.installed()
        assert any("names torch.compile'd functions by their caller" in r.getMessage() for r in caplog.records)
    finally:
        cc.uninstall()
        monkeypatch.undo()
        cc.install()


def test_a_missing_dynamo_seam_fails_with_the_torch_version_and_the_seam(monkeypatch):
    import torch._dynamo.output_graph as output_graph

    from compiler_collectives import dynamo
    from compiler_collectives.errors import UnsupportedTorchError

    monkeypatch.delattr(output_graph.OutputGraph, "run_compiler_collective")
    with pytest.raises(UnsupportedTorchError) as info:
        dynamo.check_seams()
    message = str(info.value)
    assert torch.__version__ in message
    assert "torch._dynamo.output_graph:OutputGraph.run_compiler_collective" in message


@pytest.mark.parametrize("version", ["2.12.1", "2.16.0", "2.16.0a0+git1234567", "3.0.0"])
def test_a_torch_outside_the_supported_releases_fails_naming_them(monkeypatch, version):
    from compiler_collectives import dynamo
    from compiler_collectives.errors import UnsupportedTorchError

    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(UnsupportedTorchError) as info:
        dynamo.check_seams()
    message = str(info.value)
    assert version in message
    assert "torch 2.13 to 2.15 (tested: 2.13.0, 2.14.1, 2.15.0)" in message


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.14.1+cu130", "2.15.0", "2.15.3"])
def test_every_release_in_the_supported_range_passes_the_version_check(monkeypatch, version):
    from compiler_collectives import dynamo

    monkeypatch.setattr(torch, "__version__", version)
    dynamo.check_seams()


def test_enabled_context_manager_restores_the_previous_state():
    import compiler_collectives as cc

    cc.disable()
    with cc.enabled(guards=True):
        assert cc.is_enabled() and cc.guards_enabled()
    assert not cc.is_enabled() and not cc.guards_enabled()


def _wired() -> dict[str, object]:
    """What ``dynamo/wiring.py`` connected, as the layers below hold it."""
    import sys

    from compiler_collectives import dynamo, health, torch_view
    from compiler_collectives.agreements import audit_verdict, compiler, failure, guard, scope, setup
    from compiler_collectives.dynamo import audit_seam, compiler_seam, guard_seam, tooling
    from compiler_collectives.ledger import ledger
    from compiler_collectives.transport import groups

    transport_groups = sys.modules["compiler_collectives.transport.groups"]  # the module, not the instance
    view = torch_view.view
    sources = groups.progress_sources
    return {
        "explainer": health.latch.explainer is failure.explain_report,
        "peer_reports": vars(transport_groups)["_peer_report_handler"] is failure.peer_reported,
        "first_rendezvous": vars(transport_groups)["_first_rendezvous"] is scope.first_rendezvous,
        "progress": [sources.count(s) for s in (compiler.progress, guard.progress, audit_verdict.progress)],
        "setup": vars(setup)["_sources"].count(guard_seam.setup_items),
        "store": view.default_store is dynamo.torch_original("get_default_store"),
        "compile_id": view.compile_id is compiler_seam.current_compile_id,
        "frames": sorted(view.wrapper_locals.values()),
        "profiler": view.profiler_enabled(),
        "artifacts_reader": ledger.readers().count(tooling.read),
        "group_resolver": view.resolve_group is audit_seam.group_text,
        "operators": (view.op_overload, view.op_overload_packet),
        "normalize": view.normalize is torch.fx.operator_schemas.normalize_function,
    }


EVERYTHING_WIRED_ONCE = {
    "explainer": True,
    "peer_reports": True,
    "first_rendezvous": True,
    "progress": [1, 1, 1],
    "setup": 1,
    "store": True,
    "compile_id": True,
    "frames": ["fn", "forward_call"],
    "profiler": False,
    "artifacts_reader": 1,
    "group_resolver": True,
    "operators": (type(torch.ops.aten.add.Tensor), type(torch.ops.aten.add)),
    "normalize": True,
}


def test_install_wires_every_setter_and_registry_once_however_often_it_runs():
    import compiler_collectives as cc

    assert _wired() == EVERYTHING_WIRED_ONCE  # at import
    cc.install()
    cc.install()
    assert _wired() == EVERYTHING_WIRED_ONCE
    cc.uninstall()
    try:
        unwired = _wired()
        # only what holds while we are patched into torch goes with uninstall
        assert not unwired["artifacts_reader"] and not unwired["group_resolver"]
    finally:
        cc.install()
    assert _wired() == EVERYTHING_WIRED_ONCE


def test_reset_and_a_destroyed_default_group_keep_the_wiring():
    import compiler_collectives as cc
    from compiler_collectives import runtime

    cc.reset()
    assert _wired() == EVERYTHING_WIRED_ONCE
    runtime.default_group_destroyed()
    assert _wired() == EVERYTHING_WIRED_ONCE


def test_the_optional_audit_levels_are_patched_through_the_table_and_put_back_at_uninstall():
    import torch._dynamo.backends.common as common

    import compiler_collectives as cc
    from compiler_collectives import dynamo
    from compiler_collectives.dynamo import audit_seam, bound

    torch_own = common.aot_module_simplified
    if "aot" in bound.levels:
        torch_own = dynamo.torch_original("aot_module_simplified")
    audit_seam.ensure_backend_seams()
    try:
        assert bound.levels["aot"] and bound.levels["audit-groups"]
        assert common.aot_module_simplified is audit_seam.aot_module_simplified
        assert dynamo.torch_original("aot_module_simplified") is torch_own
        assert dynamo.missing_audit_backend_seams() == []  # reads are about torch's object, not ours
        cc.uninstall()
        assert common.aot_module_simplified is torch_own and bound.levels == {}
    finally:
        cc.install()


def test_a_level_bound_again_checks_the_function_now_in_torchs_place_not_the_one_it_wrapped_before():
    import torch._inductor.compile_fx as cfx

    from compiler_collectives.dynamo import audit_seam, bound

    torchs = cfx._recursive_post_grad_passes
    bound.unbind_levels()
    audit_seam.ensure_backend_seams()  # over torch's own: bound
    assert bound.levels["inductor"] is True
    bound.unbind_levels()
    try:
        # Another library's wrapper whose parameters are not torch's: the seam's read must see it.
        cfx._recursive_post_grad_passes = lambda *args, **kwargs: torchs(*args, **kwargs)
        audit_seam.ensure_backend_seams()
        assert bound.levels["inductor"] is False
    finally:
        bound.unbind_levels()
        cfx._recursive_post_grad_passes = torchs
    audit_seam.ensure_backend_seams()
    assert bound.levels["inductor"] is True and cfx._recursive_post_grad_passes is not torchs
    assert bound.originals["recursive_post_grad_passes"] is torchs
