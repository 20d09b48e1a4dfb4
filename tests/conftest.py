"""Test-wide settings: `gpu` tests skip themselves where there is no CUDA; the session's kept gloo
ranks (tests/dist_utils.py: run_pooled) are closed when the run leaves their folder."""

import pytest
import torch

from tests.dist_utils import close_pools


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_teardown(item, nextitem):
    """Idle kept ranks still cost: memory, and gloo's polling threads (~10% of a core each on the
    2-core machine, measured during the e2e launches). The folders run one after another, so when
    the next test lies in another folder the ranks of this one are closed; a later folder that
    needs ranks starts its own."""
    if nextitem is None or nextitem.path.parent != item.path.parent:
        close_pools()
