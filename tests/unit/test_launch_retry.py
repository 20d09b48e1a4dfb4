"""The e2e launch helpers' retry rule (tests/dist_utils.py): retry a failed launch only when every
rank wrote its "finished" marker, and say so; never a launch killed mid-run or a passing one."""

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
