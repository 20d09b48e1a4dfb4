"""The e2e launch helpers' retry rule (tests/dist_utils.py, bench/e2e_bands.py): retry a failed launch
only when every rank wrote its "finished" marker, and say so; never a launch killed mid-run (also by a
native abort without a Python traceback) or a passing one."""

from __future__ import annotations

import pytest

from tests.dist_utils import finished_ranks, may_retry


def test_retry_only_after_every_rank_finished(tmp_path):
    assert finished_ranks(tmp_path / "none") == set()
    assert not may_retry(-9, tmp_path, 4, "x", "")  # no rank finished: killed mid-run
    for rank in (0, 1, 2):
        (tmp_path / f"rank{rank}").touch()
    assert not may_retry(1, tmp_path, 4, "x", "")  # rank 3 died before it finished
    (tmp_path / "rank3").touch()
    assert not may_retry(0, tmp_path, 4, "x", "")  # nothing to retry
    with pytest.warns(UserWarning, match="retrying the launch: it exited -6 after all 4 ranks had finished"):
        assert may_retry(-6, tmp_path, 4, "the launch", "terminate called without an active exception")


def _launch_with(tmp_path, outcome) -> list[dict]:
    """``bench/e2e_bands.launch`` with ``subprocess.run`` replaced by ``outcome(env)`` -> (rc, output);
    returns the environments of the launches it made."""
    import subprocess
    from unittest import mock

    import bench.e2e_bands as bands

    calls = []

    def run(cmd, env, **kwargs):
        calls.append(env)
        rc, output = outcome(env)
        return subprocess.CompletedProcess(cmd, rc, output, "")

    args = bands.parse_args(["--out", str(tmp_path)])
    with mock.patch.object(bands.subprocess, "run", run):
        bands.launch(args, "u2r2", 4, 2, "u2r2_rerun", 2, 0)
    return calls


def test_e2e_bands_never_retries_a_rank_that_aborted_mid_run(tmp_path):
    # Issue 46: a heap check aborted one rank mid-run (no Python traceback, the others then lost their
    # connection); the bench must report it, not launch again and keep the second attempt's result.
    aborted = "malloc(): unaligned tcache chunk detected\nFatal Python error: Aborted\n"
    calls = _launch_with(tmp_path / "a", lambda env: (1, aborted))
    assert len(calls) == 1
    assert calls[0]["PYTHONFAULTHANDLER"] == "1"

    def every_rank_finished(env):  # train_grpo.py's markers, then a failure at teardown
        finished = tmp_path / "b" / "runs" / "u2r2_rerun.finished"
        assert env["MILES_FINISHED_DIR"] == str(finished)
        finished.mkdir(parents=True, exist_ok=True)
        for rank in range(4):
            (finished / f"rank{rank}").touch()
        return 1, "terminate called without an active exception\n"

    assert len(_launch_with(tmp_path / "b", every_rank_finished)) == 2
