"""Checkpoints prove their bytes: SHA256SUMS written with every save, checked on resume.

Two gloo ranks save a small model's checkpoints through :func:`save_checkpoint` (each rank hashes the
shard it wrote). ``sha256sum -c`` (coreutils, the reference) accepts every ``SHA256SUMS``, which lists
every file of the checkpoint. Then bytes of the newest checkpoint's rank-1 shard are changed in place
(same length, so the size check passes): the resume names that file and falls back to the previous
checkpoint on both ranks, ``last_good_checkpoint`` skips it, ``verify_checkpoint`` (``miles.eval
--checkpoint``) refuses it naming the file; an edited ``trainer.json`` in the older one leaves nothing
to resume, which is refused. About 10 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed


def _change_bytes(path: Path, offset: int = 64, count: int = 16) -> None:
    """Reverse ``count`` bytes in place: same length, other bytes."""
    data = bytearray(path.read_bytes())
    chunk = data[offset : offset + count]
    assert chunk != chunk[::-1]
    data[offset : offset + count] = chunk[::-1]
    path.write_bytes(bytes(data))


def _body(rank, world_size, root):
    import torch
    import torch.distributed as dist
    from torch import nn

    from miles.config import Config
    from miles.train.checkpoint import (
        DIGESTS,
        checkpoint_problem,
        last_good_checkpoint,
        save_checkpoint,
        verify_checkpoint,
    )
    from miles.train.resume import resume_checkpoint

    run_dir = Path(root) / "run"
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    cfg = Config()
    state = {"step": 0, "config": dataclasses.asdict(cfg)}
    for step in (1, 2):
        save_checkpoint(run_dir, step, model, opt, {**state, "step": step}, keep=3)
    ckpts = run_dir / "checkpoints"
    if rank == 0:
        for step in ("step_000001", "step_000002"):
            listed = {line.split("  ")[1] for line in (ckpts / step / DIGESTS).read_text().splitlines()}
            on_disk = {p.name for p in (ckpts / step).iterdir()} - {DIGESTS, "COMPLETE"}
            assert (
                listed == on_disk and {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer.json"} <= listed
            )
            subprocess.run(["sha256sum", "--quiet", "-c", DIGESTS], cwd=ckpts / step, check=True)
        _change_bytes(ckpts / "step_000002" / "__1_0.distcp")
    dist.barrier()
    assert checkpoint_problem(ckpts / "step_000002") is None  # the length check alone misses it
    assert resume_checkpoint(run_dir, cfg) == ckpts / "step_000001"  # on both ranks
    assert last_good_checkpoint(run_dir) == ckpts / "step_000001"
    with pytest.raises(ValueError, match=r"step_000002 is corrupt: its file __1_0.distcp does not match"):
        verify_checkpoint(ckpts / "step_000002")
    dist.barrier()
    if rank == 0:
        trainer_json = ckpts / "step_000001" / "trainer.json"
        trainer_json.write_text(trainer_json.read_text().replace('"step": 1', '"step": 7'))
    dist.barrier()
    with pytest.raises(ValueError, match="every checkpoint in .* is corrupt .step_000002, step_000001"):
        resume_checkpoint(run_dir, cfg)
    assert last_good_checkpoint(run_dir) is None
    with pytest.raises(ValueError, match="its file trainer.json does not match"):
        verify_checkpoint(ckpts / "step_000001")


def test_digests_written_verified_and_a_changed_file_is_skipped(tmp_path, capfd):
    run_distributed(_body, 2, str(tmp_path))
    err = capfd.readouterr().err
    assert "step_000002 is corrupt: its file __1_0.distcp does not match the sha256" in err
    assert "trying the previous one" in err
