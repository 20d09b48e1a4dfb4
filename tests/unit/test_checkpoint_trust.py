"""Checkpoints are data: nothing of a checkpoint runs, and nothing is parsed before its bytes are checked.

A checkpoint is saved through :func:`save_checkpoint` on one in-process gloo rank, then damaged as a
careless or hostile copy would:

- its ``.metadata`` replaced by a pickle whose ``__reduce__`` creates a marker file, and its
  ``SHA256SUMS`` rewritten to match (anyone who can plant a file can do that): the resume (and the
  loader itself, ``has_state``, ``verify_checkpoint``) refuses it naming the global, and the marker
  never appears. torch's ``FileSystemReader`` would have unpickled it.
- a non-tensor entry of a shard (an optimizer hyperparameter, which DCP's default planner reads with
  ``torch.load(weights_only=False)``) replaced the same way: the load refuses it, no marker.
- a shard byte changed and ``SHA256SUMS`` deleted ("from before digests"): damage, so the resume falls
  back to the previous checkpoint, and ``verify_checkpoint`` refuses it.
- a file added beside the shards that ``SHA256SUMS`` does not list: damage.

The dry run and the real run's startup (``train_grpo.main`` in this process, the tiny model) refuse a
planted ``.metadata`` with exit code 2 before any model loads, and an edited prompt file (its sha256,
saved in ``trainer.json``) likewise. About 10 s.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miles.config import parse_args, to_dict
from miles.train.checkpoint import (
    DIGESTS,
    has_state,
    last_good_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from miles.train.resume import resume_checkpoint
from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[2]


class _Plant:
    """A pickle that, unpickled unrestricted, creates ``marker`` (it could as well run a shell)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _write_digests(ckpt: Path) -> None:
    """Rewrite SHA256SUMS to match the folder, as whoever planted a file can."""
    names = sorted(p.name for p in ckpt.iterdir() if p.name not in (DIGESTS, "COMPLETE"))
    lines = [f"{hashlib.sha256((ckpt / n).read_bytes()).hexdigest()}  {n}\n" for n in names]
    (ckpt / DIGESTS).write_text("".join(lines))


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def _save_two(run_dir: Path, state: dict) -> tuple[nn.Module, torch.optim.Optimizer, Path]:
    model, opt = _model()
    for step in (1, 2):
        save_checkpoint(run_dir, step, model, opt, {**state, "step": step}, keep=3)
    return model, opt, run_dir / "checkpoints"


def test_a_planted_metadata_pickle_never_runs(tmp_path, one_rank, capsys):
    cfg = parse_args([])[0]
    model, opt, ckpts = _save_two(tmp_path / "run", {"config": to_dict(cfg)})
    marker = tmp_path / "PWNED"
    for step in ("step_000001", "step_000002"):
        (ckpts / step / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
        _write_digests(ckpts / step)
    with pytest.raises(ValueError, match=r"every checkpoint in .* is corrupt \(step_000002, step_000001"):
        resume_checkpoint(tmp_path / "run", cfg)
    err = capsys.readouterr().err
    assert "its .metadata is not a DCP checkpoint index (it names io.open)" in err, err
    path = ckpts / "step_000002"
    for read in (
        lambda: load_checkpoint(path, model, opt),  # the loader itself, not only the resume's check
        lambda: has_state(path, "ema"),
        lambda: verify_checkpoint(path),  # python -m miles.eval --checkpoint
    ):
        with pytest.raises(ValueError, match="names io.open"):
            read()
    assert last_good_checkpoint(tmp_path / "run") is None
    assert not marker.exists()


def test_a_planted_value_in_a_shard_never_runs(tmp_path, one_rank):
    """An optimizer hyperparameter is a pickled value inside a shard: it is read weights_only."""
    import torch.distributed.checkpoint as dcp

    model, opt, ckpts = _save_two(tmp_path / "run", {"config": {}})
    path = ckpts / "step_000002"
    meta = dcp.FileSystemReader(str(path)).read_metadata()  # this test's own file: trusted
    index = next(i for i in meta.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = meta.storage_data[index]
    shard = path / info.relative_path
    planted = io.BytesIO()
    torch.save(_Plant(tmp_path / "PWNED"), planted)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(planted.getvalue())
    info.offset, info.length = offset, len(planted.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(meta))  # DCP's own classes only: admitted
    _write_digests(path)
    assert verify_checkpoint(path) is None  # whole and as "saved": only the load reads the value
    with pytest.raises(ValueError, match=r"a value stored in its shards is not plain data .*GLOBAL io.open"):
        load_checkpoint(path, model, opt)
    assert not (tmp_path / "PWNED").exists()
    load_checkpoint(ckpts / "step_000001", model, opt)  # an untouched checkpoint loads
    assert opt.param_groups[0]["lr"] == 1e-3


def test_a_missing_sha256sums_is_damage(tmp_path, one_rank, capsys):
    cfg = parse_args([])[0]
    _, _, ckpts = _save_two(tmp_path / "run", {"config": to_dict(cfg)})
    shard = ckpts / "step_000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100:116] = data[100:116][::-1]
    shard.write_bytes(bytes(data))
    (ckpts / "step_000002" / DIGESTS).unlink()
    assert resume_checkpoint(tmp_path / "run", cfg) == ckpts / "step_000001"
    err = capsys.readouterr().err
    assert "step_000002 is corrupt: its SHA256SUMS is missing: every checkpoint this version writes" in err
    assert "sha256sum .metadata trainer.json __*.distcp > SHA256SUMS" in err  # the way out for an old one
    with pytest.raises(ValueError, match="its SHA256SUMS is missing"):
        verify_checkpoint(ckpts / "step_000002")
    # A file SHA256SUMS does not list is damage too.
    (ckpts / "step_000001" / "__1_0.distcp").write_bytes(b"extra")
    with pytest.raises(ValueError, match=r"its file __1_0.distcp is not listed in its SHA256SUMS"):
        verify_checkpoint(ckpts / "step_000001")


# --- through train_grpo.main: the dry run and the real run's startup, before any model loads ---------


def _argv(tmp_path: Path, prompts: Path) -> list[str]:
    return [
        "--config", "configs/tiny_cpu.yaml", "--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan"),
        "--run.output-dir", str(tmp_path / "runs"), "--run.name", "r", "--run.wandb-mode", "disabled",
        "--run.no-progress", "--data.prompt-file", str(prompts),
    ]  # fmt: skip


def _fake_checkpoint(run_dir: Path, argv: list[str], metadata: bytes, prompts_fp: dict | None) -> Path:
    """A checkpoint folder saved with this launch's config (so the resume gets past the config check
    to the index), holding ``metadata`` as its ``.metadata``."""
    ckpt = run_dir / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    state = {"step": 2, "config": to_dict(parse_args(argv)[0]), "prompt_fingerprint": prompts_fp}
    (ckpt / "trainer.json").write_text(json.dumps(state))
    (ckpt / ".metadata").write_bytes(metadata)
    _write_digests(ckpt)
    (ckpt / "COMPLETE").write_text("2\n")
    return ckpt


def _main_refuses(argv: list[str], monkeypatch, capsys) -> list[str]:
    """The dry run's and the real run's ``error`` lines (each must exit 2, loading no model)."""
    import train_grpo
    from miles.models.wan_family import WanFamily

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(WanFamily, "load", no_load)
    errors = []
    for extra in (["--dry-run", "--world-size", "1"], []):
        assert train_grpo.main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        errors.append(next(line for line in err.splitlines() if line.startswith("error")))
    assert not dist.is_initialized()
    return errors


def test_dry_run_and_startup_refuse_a_planted_pickle_and_an_edited_prompt_file(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text((REPO / "miles" / "data" / "tiny_prompts.txt").read_text())
    argv = _argv(tmp_path, prompts)
    run_dir = tmp_path / "runs" / "r"
    marker = tmp_path / "PWNED"
    ckpt = _fake_checkpoint(run_dir, argv, pickle.dumps(_Plant(marker)), None)
    for line in _main_refuses(argv, monkeypatch, capsys):
        assert "every checkpoint in" in line and "is corrupt (step_000002" in line, line
    assert not marker.exists()

    # A (valid) checkpoint saved with the prompt file's sha256, then the file edited: refused by name.
    import shutil

    from miles.train.resume import prompt_fingerprint

    shutil.rmtree(ckpt)
    saved_fp = prompt_fingerprint(parse_args(argv)[0])
    assert saved_fp["sha256"] == hashlib.sha256(prompts.read_bytes()).hexdigest()
    _fake_checkpoint(run_dir, argv, b"unused: the prompt check comes first", saved_fp)
    prompts.write_text(prompts.read_text().replace("a", "o", 1))
    for line in _main_refuses(argv, monkeypatch, capsys):
        assert (
            f"cannot resume {run_dir / 'checkpoints' / 'step_000002'}: the prompt file {prompts} changed"
            in line
        )
        assert "Restore the file as it was, or start a new run" in line, line
