"""Quiet, readable output: progress bars only on rank 0 at a terminal, library loading bars off
elsewhere, the export cast without diffusers' fp32 warning, exported files readable by the group."""

from __future__ import annotations

import io
import logging
import os

import pytest
import torch

from miles.train.export import cast_like_from_pretrained, readable_by_umask
from miles.train.logging import configure_library_progress, show_progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize("rank, tty, enabled, shown", [(0, True, True, True), (1, True, True, False),
                                                       (0, False, True, False), (0, True, False, False)])  # fmt: skip
def test_progress_only_on_rank_0_at_a_terminal(monkeypatch, rank, tty, enabled, shown):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr("sys.stderr", _Stream(tty))
    assert show_progress(enabled) is shown


def test_library_loading_bars_follow(monkeypatch):
    import diffusers.utils.logging as d
    import transformers.utils.logging as t

    configure_library_progress(False)
    assert not d.is_progress_bar_enabled() and not t.is_progress_bar_enabled()
    configure_library_progress(True)
    assert d.is_progress_bar_enabled() and t.is_progress_bar_enabled()


def test_export_cast_keeps_the_fp32_modules_and_does_not_warn(caplog):
    from diffusers import WanTransformer3DModel

    from tests.models import TINY_WAN

    model = WanTransformer3DModel(**TINY_WAN)
    with caplog.at_level(logging.WARNING):
        cast_like_from_pretrained(model, torch.bfloat16)
    assert "float32" not in caplog.text
    keep = set(model._keep_in_fp32_modules)
    for name, p in model.named_parameters():
        want = torch.float32 if keep.intersection(name.split(".")) else torch.bfloat16
        assert p.dtype == want, (name, p.dtype)


def test_exported_files_get_the_modes_the_umask_allows(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "weights.safetensors").write_bytes(b"x")
    os.chmod(tmp_path / "sub" / "weights.safetensors", 0o600)  # as safetensors writes them
    old = os.umask(0o022)
    try:
        readable_by_umask(tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / "sub" / "weights.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "sub").stat().st_mode & 0o777 == 0o755
