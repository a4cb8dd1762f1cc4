"""The tiers: every multi-process test says whether a torch release can change it, and --tier picks by that."""

from __future__ import annotations

import textwrap

import pytest

_TESTS = textwrap.dedent(
    """
    import pytest

    pytestmark = pytest.mark.release_independent

    def test_unit():
        pass

    @pytest.mark.multiprocess
    def test_ours():
        pass

    @pytest.mark.multiprocess
    @pytest.mark.torch_seam
    def test_through_dynamo():
        pass
    """
)


def _run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_example=source)
    return pytester.runpytest_inprocess("-p", "tests.tiers", "-p", "no:xdist", "-p", "no:cacheprovider", *args)


def test_an_unclassified_multiprocess_test_fails_collection_naming_it(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.multiprocess
            def test_starts_ranks():
                pass

            def test_unit():
                pass
            """
        ),
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*1 multi-process test(s) say neither*", "*test_example.py::test_starts_ranks*"])


def test_a_unit_test_needs_no_classification(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "def test_unit():\n    pass\n")
    result.assert_outcomes(passed=1)


def test_the_whole_suite_is_the_default_tier(pytester: pytest.Pytester) -> None:
    _run(pytester, _TESTS).assert_outcomes(passed=3)


def test_the_seam_tier_runs_the_unit_tests_and_the_seam_tests_whose_own_mark_beats_their_modules(
    pytester: pytest.Pytester,
) -> None:
    result = _run(pytester, _TESTS, "--tier", "seam", "-v")
    result.assert_outcomes(passed=2, deselected=1)
    result.stdout.fnmatch_lines_random(["*test_unit PASSED*", "*test_through_dynamo PASSED*"])


def test_the_unit_tier_and_fast_run_no_multiprocess_test(pytester: pytest.Pytester) -> None:
    _run(pytester, _TESTS, "--tier", "unit").assert_outcomes(passed=1, deselected=2)
    _run(pytester, _TESTS, "--fast").assert_outcomes(passed=1, deselected=2)


def test_a_test_in_the_unit_folder_that_starts_processes_fails_collection_naming_it(pytester: pytest.Pytester) -> None:
    folder = pytester.path / "tests" / "unit"  # not packages: the name ``tests`` is this suite's
    folder.mkdir(parents=True)
    (folder / "test_example.py").write_text(
        "import pytest\n\n@pytest.mark.multiprocess\n@pytest.mark.release_independent\ndef test_ranks():\n    pass\n"
    )
    result = pytester.runpytest_inprocess("-p", "tests.tiers", "-p", "no:xdist", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*1 test(s) in tests/unit/ start processes*", "*tests/unit/test_example.py::test_ranks*"]
    )
