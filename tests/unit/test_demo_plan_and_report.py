"""`scripts/dev demo`'s plan and report, without a rank (scripts/demo*.py): its options and the runs
they choose, the length schedule that makes ranks diverge, what a compile run sets up, where a
stuck rank was and what it raised (read from its log), and the report's cost and compile-once
tables. Its --help text. The demo run end to end: ``tests/ranks/test_demo.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

import compiler_collectives

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
# scripts/demo*.py: the demo is not part of the library.
import demo  # noqa: E402  (the command line)
import demo_launch  # noqa: E402  (starting the ranks, what they came to)
import demo_report  # noqa: E402  (the report's text)
import demo_training  # noqa: E402  (the training a user copies)


def test_bad_options_are_rejected(capsys):
    parser = demo.build_parser()
    for bad in (["--runs", "off,nope"], ["--nproc", "0"], ["--timeout", "-1"], ["--steps", "x"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(bad)
        assert e.value.code == 2, bad
    # Values argparse accepts but the demo cannot use: refused before any rank starts.
    for bad in (["--nproc", "1"], ["--steps", "1"]):
        args = parser.parse_args(bad)
        assert args.func(args) == 2, bad
    assert "--runs" in capsys.readouterr().err


def test_the_length_schedule_makes_ranks_diverge_at_different_steps():
    world, steps = 4, 30
    firsts = []
    for rank in range(world):
        lengths = [demo_training.sequence_length(rank, s, world, steps, 32) for s in range(steps)]
        assert lengths[0] == 32  # the first compile is the same on every rank
        changed = [s for s in range(steps) if lengths[s] != 32]
        firsts.append(changed[0] if changed else None)
    assert firsts[0] is None  # rank 0 never leaves the common bucket
    assert firsts[1:] == sorted(set(firsts[1:])), firsts  # the others leave one after another
    assert all(f < steps // 2 + 1 for f in firsts[1:]), firsts
    assert [demo_training.batch_size(r, steps - 1, world, steps, 4) for r in range(world)] == [4, 4, 4, 3]


def test_stuck_at_names_the_innermost_frame_the_service_and_the_training_line():
    pkg = os.path.dirname(demo_training.__file__)
    svc = os.path.dirname(compiler_collectives.__file__)
    log_text = (
        "some warning\n"
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 4287 in all_gather\n'
        f'  File "{svc}/transport/gloo.py", line 187 in all_gather_bytes\n'
        f'  File "{svc}/agreements/compiler.py", line 70 in exchange\n'
        '  File "/x/torch/_dynamo/convert_frame.py", line 9 in _compile\n'
        f'  File "{pkg}/demo_training.py", line 306 in train\n'
        f'  File "{pkg}/demo_launch.py", line 400 in _rank_main\n'
        "\n"
    )
    assert demo_launch.stuck_at(log_text) == (
        "all_gather (distributed_c10d.py:4287) <- all_gather_bytes (gloo.py:187) <- train (demo_training.py:306)"
    )
    in_backward = (
        "Stack (most recent call first):\n"
        '  File "/x/torch/autograd/graph.py", line 979 in _engine_run_backward\n'
        f'  File "{pkg}/demo_training.py", line 307 in train\n'
        f'  File "{pkg}/demo_launch.py", line 408 in _rank_main\n'
    )
    assert demo_launch.stuck_at(in_backward) == "_engine_run_backward (graph.py:979) <- train (demo_training.py:307)"
    assert demo_launch.stuck_at("no stack here") is None


def test_stuck_at_and_exception_text_read_a_python_traceback():
    pkg = os.path.dirname(demo_training.__file__)
    svc = os.path.dirname(compiler_collectives.__file__)
    tb = (
        "Traceback (most recent call last):\n"
        f'  File "{pkg}/demo_launch.py", line 620, in _rank_main\n'
        "    result = train(\n"
        "             ^^^^^^\n"
        f'  File "{pkg}/demo_training.py", line 411, in train\n'
        "    loss = ddp(tokens, targets)\n"
        f'  File "{svc}/agreements/compiler.py", line 98, in exchange\n'
        "    gathered = gather(payload)\n"
        f'  File "{svc}/agreements/exchange.py", line 96, in gather\n'
        "    raise err\n"
        "compiler_collectives.errors.CollectiveDesyncError: compiler collective #3 on rank 1 timed out\n"
        "Rank(s) [0] are alive but did not enter this collective\n"
        "  rank 0: alive but not in this collective\n"
    )
    assert (
        demo_launch.stuck_at(tb)
        == "gather (exchange.py:96) <- exchange (compiler.py:98) <- train (demo_training.py:411)"
    )
    text = demo_launch.exception_text(tb)
    assert text.startswith("CollectiveDesyncError: compiler collective #3") and text.startswith(demo_launch.HANG_ERRORS)
    assert text.endswith("rank 0: alive but not in this collective")
    assert demo_launch.exception_text("RuntimeError: boom") == "RuntimeError: boom"
    # A stack faulthandler wrote after the traceback wins: it is where the rank is now.
    later = (
        tb + 'Stack (most recent call first):\n  File "/x/torch/autograd/graph.py", line 979 in _engine_run_backward\n'
    )
    assert demo_launch.stuck_at(later) == "_engine_run_backward (graph.py:979)"


def _finished_outcome(run_name, results, elapsed=10.0, compile_once=None):
    ranks = [demo_launch.RankOutcome(r, "finished", res, 7) for r, res in enumerate(results)]
    return demo_launch.RunOutcome(demo_launch.RUNS[run_name], ranks, elapsed, steps=8, compile_once=compile_once)


def _result(rank, **extra):
    base = {
        "rank": rank,
        "backend": "aot_eager",
        "train_time_s": 8.0,
        "guard_collectives": 29,
        "guard_per_call_s": 20e-6 * (rank + 1),
        "guard_time_s": 0.002,
        "compiler_collectives": 3,
        "audit_exchanges": 3,
        "reason_exchanges": 2,
        "exchanges": 8,
        "exchange_time_s": 0.4,
        "forced_recompiles": 2 if rank == 0 else 0,
        "forced_extra_cpu_s": 1.5 if rank == 0 else 0.0,
        "compile_cpu_s": 20.0,
        "compile_children_cpu_s": 12.0,
    }
    base.update(extra)
    return base


def test_the_cost_names_oversubscription_only_with_more_ranks_than_cores():
    on = _finished_outcome("on", [_result(r) for r in range(4)])
    crowded = "\n".join(demo_report.format_cost(on, cores=2))
    assert "4 ranks share 2 CPU cores, so most of this cost is CPU oversubscription" in " ".join(crowded.split())
    assert "aot_eager keeps no cache" in " ".join(crowded.split())
    assert "29 x 20 µs, 2 ms" in crowded and "8 (3 compiler, 3 audit, 2 reasons), 0.40s" in crowded
    assert "2, 1.5 CPU-s" in crowded
    roomy = " ".join(demo_report.format_cost(on, cores=8))
    assert "oversubscription" not in roomy and "a CPU core of its own" in roomy
    assert "(20 µs here)" in roomy  # the rank that arrives last: the collective's own cost


def test_the_compile_once_table_gives_cpu_seconds_per_rank_and_in_total():
    each = _finished_outcome("compile-each", [_result(0), _result(1)], 30.0, compile_once=False)
    once = _finished_outcome(
        "compile-once", [_result(0), _result(1, compile_cpu_s=2.0, compile_children_cpu_s=0.0)], 25.0, True
    )
    lines = demo_report.format_compile_once([each, once], 2)
    row_each = next(line for line in lines if "COMPILER_COLLECTIVES_COMPILE_ONCE=0" in line)
    row_once = next(line for line in lines if "default (compile once)" in line)
    assert row_each.split()[1:] == ["20.0", "20.0", "40.0", "24.0", "30s"], row_each
    assert row_once.split()[3:] == ["20.0", "2.0", "22.0", "12.0", "25s"], row_once
    assert not any("has no COMPILER_COLLECTIVES_COMPILE_ONCE" in line for line in lines)
    unknown = _finished_outcome("compile-once", [_result(0), _result(1)], 25.0, None)
    assert any(
        "has no COMPILER_COLLECTIVES_COMPILE_ONCE" in line for line in demo_report.format_compile_once([unknown], 2)
    )


def test_part_four_is_opt_in_and_follows_backend_inductor():
    parser = demo.build_parser()
    assert demo.selected_runs(parser.parse_args([]), under_torchrun=False) == ("compiler-only", "on")
    assert demo.selected_runs(parser.parse_args([]), under_torchrun=True) == ("on",)
    with_part4 = ("compiler-only", "on", "compile-each", "compile-once")
    assert demo.selected_runs(parser.parse_args(["--compile-once"]), under_torchrun=False) == with_part4
    assert demo.selected_runs(parser.parse_args(["--backend", "inductor"]), under_torchrun=False) == with_part4
    assert demo.selected_runs(parser.parse_args(["--runs", "off,on"]), under_torchrun=False) == ("off", "on")
    # Part 4 always compiles with inductor, for --compile-steps steps.
    cfg = demo_training.DemoConfig(compile_steps=2)
    assert demo_launch.run_config(demo_launch.RUNS["compile-once"], cfg).backend == "inductor"
    assert demo_launch.run_config(demo_launch.RUNS["compile-once"], cfg).steps == 2
    assert demo_launch.run_config(demo_launch.RUNS["on"], cfg) == cfg
    assert demo_launch.collective_timeout(demo_launch.RUNS["compiler-only"], cfg) == cfg.hazard_timeout
    assert demo_launch.collective_timeout(demo_launch.RUNS["on"], cfg) == cfg.timeout
    # Each rank has its own inductor cache in the run's (the default), or they share the run's.
    assert demo_launch.rank_cache_dir("/c", 1, cfg) == os.path.join("/c", "rank1")
    assert demo_launch.rank_cache_dir("/c", 1, demo_training.DemoConfig(compile_cache="shared")) == "/c"


def test_prepare_compile_run_sets_a_fresh_cache_one_thread_and_compile_once(tmp_path, monkeypatch):
    import torch._inductor.config as inductor_config

    config = compiler_collectives.config
    monkeypatch.setattr(inductor_config, "compile_threads", inductor_config.compile_threads)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS", demo_launch.COMPILE_ONCE_ENV):
        monkeypatch.delenv(name, raising=False)
    row = next((r for r in config.SETTINGS_TABLE if r.env == demo_launch.COMPILE_ONCE_ENV), None)
    saved = {row.attr: getattr(config.settings, row.attr)} if row else {}
    with config.override(**saved):
        off = demo_launch.prepare_compile_run(demo_launch.RUNS["compile-each"], str(tmp_path))
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
        assert inductor_config.compile_threads == 1
        if row is None:  # this version has no compile once: nothing to set
            assert off is None and demo_launch.COMPILE_ONCE_ENV not in os.environ
        else:
            assert off is False and os.environ[demo_launch.COMPILE_ONCE_ENV] == "0"
            assert demo_launch.prepare_compile_run(demo_launch.RUNS["compile-once"], str(tmp_path)) is True
            assert demo_launch.COMPILE_ONCE_ENV not in os.environ


def _demo_parser():
    return demo.build_parser()


def test_demo_help_lists_and_explains_every_option():
    """The parser the command line prints with --help (the command itself runs in
    tests/ranks/test_demo.py's story)."""
    demo_parser = _demo_parser()
    help_text = demo_parser.format_help()
    options = [a for a in demo_parser._actions if a.option_strings and a.dest != "help"]
    expected = {
        "--nproc",
        "--steps",
        "--backend",
        "--timeout",
        "--hazard-timeout",
        "--runs",
        "--compile-once",
        "--compile-steps",
        "--compile-cache",
        "--batch-size",
        "--seed",
        "--log-every",
        "--json",
    }
    assert expected <= {s for a in options for s in a.option_strings}
    for action in options:
        for flag in action.option_strings:
            assert flag in help_text, flag
        assert action.help and len(action.help) > 15, f"{action.option_strings} has no real help"
    for name in demo_launch.RUNS:  # every run --runs accepts is explained
        assert f"'{name}'" in " ".join(help_text.split()), name
