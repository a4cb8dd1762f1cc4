"""Zero-code activation at `import torch`, precedence of the switches, and `doctor` (issue: autoload)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures import clean_env, once_per_run
from tests.harness import free_port, run_ranks

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]

PY = sys.executable
OUR_VARS = (
    "TORCH_COMPILER_COLLECTIVES",
    "COMPILER_COLLECTIVES_GUARDS",
    "COMPILER_COLLECTIVES_TIMING",
    "COMPILER_COLLECTIVES_TRACE_DIR",
    "COMPILER_COLLECTIVES_AUTOLOAD",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in clean_env().items() if k not in OUR_VARS}
    env.update(extra)
    return env


def _python(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=_env(**env)
    )


def test_with_our_variables_unset_import_torch_loads_neither_us_nor_dynamo():
    proc = _python("""
        import sys, torch
        import compiler_collectives_autoload as a
        print(a.status, "compiler_collectives" in sys.modules, "torch._dynamo" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["inactive", "False", "False"]


@pytest.mark.timeout(180)
def test_the_torch_variable_alone_activates_our_implementation_at_import_torch():
    # One interpreter: what import torch switched on, before any other line ran. That a job so
    # started runs our compiler collective in its first compile (the sizes differ across ranks)
    # is the torchrun job's below, which never imports us either.
    proc = _python(
        """
        import sys, torch
        cc = sys.modules.get("compiler_collectives")
        at_import = cc is not None and cc.is_enabled()  # nothing but import torch has run
        print(at_import, cc.guards_enabled(), bool(torch._dynamo.config.enable_compiler_collectives))
    """,
        TORCH_COMPILER_COLLECTIVES="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "True"]


# A torch without one of our seams, simulated: a sitecustomize import hook
# removes OutputGraph.run_compiler_collective as soon as torch defines it.
STRIP_SEAM = """
import importlib.abc, importlib.machinery, sys

class _StripSeam(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo.output_graph":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            del module.OutputGraph.run_compiler_collective

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _StripSeam())
"""


def _torch_without_a_seam(tmp_path) -> str:
    (tmp_path / "sitecustomize.py").write_text(STRIP_SEAM)
    return str(tmp_path)


def test_a_broken_autoload_leaves_import_torch_working_with_one_warning(tmp_path):
    proc = _python(
        """
        import torch
        print(torch.ones(2).sum().item())
    """,
        TORCH_COMPILER_COLLECTIVES="1",
        PYTHONPATH=_torch_without_a_seam(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2.0"
    warnings = [line for line in proc.stderr.splitlines() if "autoload failed" in line]
    assert len(warnings) == 1, proc.stderr
    assert (
        "Dynamo seam(s) missing or changed: torch._dynamo.output_graph:OutputGraph.run_compiler_collective is missing"
        in warnings[0]
    )


IMPORT_TORCH = """
    import torch
    print("torch imported")
"""


# The variants of a bad variable (each value that does not parse, each misspelt name) are our
# parsing alone: the unit tier's ``test_config.py`` names each of them, as ``import torch``
# would. What ``import torch`` does with one is pinned here, once per route that reaches it.


@pytest.mark.release_independent  # our settings' parsing; an import torch that fails: the broken-autoload test
def test_a_bad_value_in_one_of_our_variables_alone_fails_import_torch_naming_it_and_the_accepted_values():
    expected = "COMPILER_COLLECTIVES_GUARDS='ture': expected 1/0, true/false, yes/no or on/off"
    proc = _python(IMPORT_TORCH, COMPILER_COLLECTIVES_GUARDS="ture")
    assert proc.returncode != 0 and "torch imported" not in proc.stdout, proc.stdout + proc.stderr
    assert f"ConfigError: {expected}" in proc.stderr, proc.stderr
    # one ERROR line of ours says what happens and what to do, besides torch's traceback
    ours = [line for line in proc.stderr.splitlines() if line.startswith("compiler_collectives: ")]
    assert len(ours) == 1 and expected in ours[0] and "Stopping this process" in ours[0], proc.stderr


@pytest.mark.release_independent  # our settings' names; autoload at import torch: the torch-variable test
def test_a_misspelt_guard_switch_alone_fails_import_torch_instead_of_being_ignored():
    proc = _python(IMPORT_TORCH, COMPILER_COLLECTIVES_GAURDS="1")
    assert proc.returncode != 0 and "torch imported" not in proc.stdout, proc.stdout + proc.stderr
    assert (
        "ConfigError: COMPILER_COLLECTIVES_GAURDS is not a compiler_collectives variable: "
        "did you mean COMPILER_COLLECTIVES_GUARDS?" in proc.stderr
    ), proc.stderr


# Our own variables' handling at torch's entry point, which the torch-variable test pins
# (``wanted``'s cases: the unit tier's test_config.py).
@pytest.mark.release_independent
def test_autoload_off_and_the_retired_log_level_variable_still_let_import_torch_through():
    off = _python(
        """
        import sys, torch
        print("compiler_collectives" in sys.modules)
    """,
        COMPILER_COLLECTIVES_AUTOLOAD="0",
        COMPILER_COLLECTIVES_GAURDS="1",
    )
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr
    retired = _python(
        """
        import sys, torch
        print(sys.modules["compiler_collectives"].is_enabled())
    """,
        TORCH_COMPILER_COLLECTIVES="1",
        COMPILER_COLLECTIVES_LOG_LEVEL="DEBUG",
    )
    assert retired.returncode == 0 and retired.stdout.strip() == "True", retired.stderr
    # the pointer to TORCH_LOGS: the package's install says it, whichever import runs it
    assert "COMPILER_COLLECTIVES_LOG_LEVEL is no longer read: set TORCH_LOGS=compiler_collectives" in retired.stderr


# The job below also walks the switches, after its training and without importing us: its
# environment (torch's switch and our guard switch on) is the initial value that walk starts
# from, in fresh interpreters as a job of its own would have them.
TRAINING_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
f = torch.compile(lambda x: x * 2 + 1, backend="eager")
for n in (3 + rank, 9, 4):
    f(torch.ones(n, 2))
cc = sys.modules.get("compiler_collectives")
stats = cc.stats() if cc else None
switches = []
if cc is not None:
    switches += [cc.is_enabled(), cc.guards_enabled()]         # from the environment
    cc.disable()
    switches += [cc.is_enabled(), cc.guards_enabled()]         # our API wins over the env
    torch._dynamo.config.enable_compiler_collectives = True
    torch.compiler.set_enable_guard_collectives(True)
    switches += [cc.is_enabled(), cc.guards_enabled()]         # torch's switches drive ours
    cc.enable(guards=False)
    switches += [cc.is_enabled(), cc.guards_enabled()]
with open(os.path.join(os.environ["RESULT_DIR"], f"result{rank}.json"), "w") as out:
    json.dump({"rank": rank, "loaded": cc is not None, "stats": stats, "switches": switches}, out)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """TRAINING_SCRIPT on two ranks under torchrun, configured by environment variables alone:
    one job per test run (``once_per_run``)."""
    return once_per_run(tmp_path_factory, "autoload-torchrun-job", _torchrun_job)


def _torchrun_job(tmp_path: Path) -> dict:
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    trace_dir = tmp_path / "traces"
    proc = subprocess.run(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env=_env(
            TORCH_COMPILER_COLLECTIVES="1",
            COMPILER_COLLECTIVES_GUARDS="1",
            COMPILER_COLLECTIVES_TRACE_DIR=str(trace_dir),
            OMP_NUM_THREADS="1",
            RESULT_DIR=str(tmp_path),
            TMPDIR=str(tmp_path),  # a module's fixture: set up before the test's own TMPDIR
        ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    return {"results": results, "traces": sorted(os.listdir(trace_dir))}


@pytest.mark.timeout(180)
def test_a_torchrun_script_that_never_imports_us_uses_our_implementation_from_env_vars(torchrun_job):
    for r in torchrun_job["results"]:
        assert r["loaded"]
        assert r["stats"]["compiler_collectives"] == 1  # sizes differ: one collective, dim dynamic
        assert r["stats"]["guard_collectives"] == 2
    assert torchrun_job["traces"] == ["rank0.json", "rank1.json"]


@pytest.mark.timeout(180)
def test_switches_follow_last_write_wins_with_the_environment_as_the_initial_value(torchrun_job):
    for r in torchrun_job["results"]:
        assert r["switches"] == [True, True, False, False, True, True, True, False]


def test_doctor_reports_healthy_and_exits_zero():
    proc = subprocess.run(
        [PY, "-m", "compiler_collectives", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(COMPILER_COLLECTIVES_GUARDS="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Dynamo seams: all present" in out
    assert "autoload: entry point registered" in out
    assert "guard collectives: ON (from env COMPILER_COLLECTIVES_GUARDS)" in out
    assert "compiler collectives: off (from default (off))" in out
    assert "OK: nothing needed is missing." in out


@pytest.mark.release_independent  # the seam is removed by the test; the real seams: doctor-healthy
def test_doctor_names_a_missing_seam_with_the_fix_and_exits_nonzero(tmp_path):
    proc = subprocess.run(
        [PY, "-m", "compiler_collectives", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(PYTHONPATH=_torch_without_a_seam(tmp_path)),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISSING torch._dynamo.output_graph:OutputGraph.run_compiler_collective" in proc.stdout
    assert "Fix: install a supported torch (torch 2.13 to 2.15" in proc.stdout


@pytest.mark.release_independent  # as the missing seam above
def test_importing_the_package_with_a_missing_seam_raises_naming_torch_version_and_seam(tmp_path):
    proc = _python("import compiler_collectives", PYTHONPATH=_torch_without_a_seam(tmp_path))
    assert proc.returncode != 0
    assert "UnsupportedTorchError" in proc.stderr
    assert "2.13" in proc.stderr and "OutputGraph.run_compiler_collective" in proc.stderr


def doctor_as_a_launched_rank(rank: int, world: int) -> dict:
    """``compiler-collectives doctor`` (what ``python -m compiler_collectives doctor`` runs) in a
    rank whose environment has the launcher's variables: its exit code and what it printed."""
    import contextlib
    import io

    from compiler_collectives.tools.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["doctor"])
    return {"code": code, "stdout": printed.getvalue()}


@pytest.mark.timeout(180)
@pytest.mark.release_independent  # doctor's report; torch's groups: doctor-healthy, torchrun: the script test
def test_doctor_under_a_launcher_reports_the_default_group_and_our_gloo_groups():
    # Doctor knows a launcher by its variables, here torchrun's for the two ranks of one host
    # (none of ours), and makes the default group itself (init=False). The ranks come from the
    # harness's forkserver, torch imported, instead of torchrun's agent and two fresh interpreters:
    # a launcher starts the ranks, and doctor reads what it left them (the torchrun script above
    # runs under a real agent).
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    local = {rank: {"LOCAL_RANK": str(rank)} for rank in range(2)}
    outcome = run_ranks(doctor_as_a_launched_rank, 2, env=env, rank_env=local, init=False, fresh=True, timeout=150)
    for r in outcome.results:
        assert r["code"] == 0, r["stdout"]
    stdout = "".join(r["stdout"] for r in outcome.results)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("process group:")]
    assert len(lines) == 2
    for line in lines:
        assert "default backend gloo" in line
        assert "ours: compile: gloo, guard: gloo" in line
    # both ranks on one host (one agent's), agreeing through shared memory
    assert stdout.count("guard collective transport: shm\n") == 2, stdout
