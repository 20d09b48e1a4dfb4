"""Lean checkpoints on the real Trainer (4 gloo ranks, the tiny two-expert model, LoRA rank 4, EMA on,
deterministic mode, one optimizer step per rollout, a checkpoint after every rollout).

- Size: the LoRA checkpoint holds the adapters, their AdamW state and their EMA, no frozen weight
  (no ``.base_layer.`` key): it is smaller than the same state saved the former way (every parameter,
  ``StateDictOptions()``) by at least the frozen weights' bytes. (Rank 4 on the tiny model is large
  next to its base; at A14B the ratio is 9x to 16x, see docs/scale.md.)
- Resume, bitwise, across layouts: run A trains 2 rollouts at dp4. A's step-1 checkpoint is
  resumed at dp2 x sp2 (the weights sha256 at load equals A's at step 1) and saved again there; that
  checkpoint is resumed at dp4 and trained to step 2: its weights equal A's at step 2 bit for bit.
- Old checkpoints: A's step-1 state saved the former way (frozen weights included, no fingerprint)
  loads, and training on from it reaches A's step-2 weights bit for bit.
- Another base: the model folder's transformer_2 rewritten with the same tensors but another header
  (another model with the same shapes) is refused at resume, before any weights load, naming the folder.

About 3 to 5 minutes on 2 shared cores (7 trainers at world 4).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.dist_utils import run_pooled

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny-wan" / "two_expert"


def _trainer(root: Path, name: str, *flags: str, num_rollouts: int = 2):
    import miles.train.trainer as T
    from miles.config import parse_args

    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", str(root)]
        + ["--run.name", name, "--run.wandb-mode", "disabled", "--run.no-progress"]
        + ["--model.path", str(root / "model"), "--deterministic-mode", "--train.no-export"]
        + ["--model.lora-rank", "4", "--train.ema-decay", "0.9", "--train.steps-per-rollout", "1"]
        + ["--train.checkpoint-every", "1", "--train.num-rollouts", str(num_rollouts), "--eval.every", "0"]
        + list(flags)
    )
    return T.Trainer(cfg)


def _copy_checkpoint(src_run: Path, dst_run: Path, step: int) -> Path:
    """Rank 0 copies one checkpoint into a fresh run directory; every rank waits."""
    import torch.distributed as dist

    name = f"step_{step:06d}"
    if dist.get_rank() == 0:
        shutil.copytree(src_run / "checkpoints" / name, dst_run / "checkpoints" / name)
    dist.barrier()
    return dst_run / "checkpoints" / name


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _keys(path: Path) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _run_a(root: Path) -> tuple[str, str]:
    """The uninterrupted reference: 2 rollouts at dp4; the weights digests at its saves (steps 1, 2)."""
    from miles.train.checkpoint import weights_digest

    a = _trainer(root, "a")
    digests, save = {}, a.save

    def save_and_digest() -> None:
        save()
        digests[a.step] = weights_digest(a.experts)

    a.save = save_and_digest
    a.train()
    a.close()
    assert sorted(digests) == [1, 2], digests
    return digests[1], digests[2]


def _old_style_save(trainer, monkeypatch_target) -> None:
    """Save ``trainer`` the former way: every parameter, no model fingerprint and no ``SHA256SUMS``
    (digests came later than both); then given its ``SHA256SUMS`` by hand, as the refusal of a
    checkpoint without one says (miles.files.WRITE_DIGESTS)."""
    import subprocess

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lean = monkeypatch_target.STATE_OPTIONS
    monkeypatch_target.STATE_OPTIONS = StateDictOptions()
    try:
        trainer.save()
    finally:
        monkeypatch_target.STATE_OPTIONS = lean
    if dist.get_rank() == 0:
        info = trainer.run_dir / "checkpoints" / f"step_{trainer.step:06d}" / "trainer.json"
        state = json.loads(info.read_text())
        del state["model_fingerprint"]
        info.write_text(json.dumps(state))
        (info.parent / monkeypatch_target.DIGESTS).unlink()
        from miles.files import WRITE_DIGESTS

        subprocess.run(WRITE_DIGESTS, shell=True, cwd=info.parent, check=True)
    dist.barrier()


def _body(rank, world_size, root):
    import torch.distributed as dist

    import miles.train.checkpoint as C
    from miles.train.checkpoint import weights_digest

    root = Path(root)
    d1, d2 = _run_a(root)
    lean = root / "a" / "checkpoints" / "step_000001"
    assert C.has_ema(lean) and not any(".base_layer." in k for k in _keys(lean)), _keys(lean)[:5]
    assert any(".lora_A." in k for k in _keys(lean))

    # dp4 -> dp2 x sp2 (load, save) -> dp4 (load, train one rollout)
    _copy_checkpoint(root / "a", root / "b", 1)
    b = _trainer(root, "b", "--sequence-parallel-size", "2", "--data.prompts-per-rank", "4")
    assert b.step == 1 and b.dims.sp == 2 and weights_digest(b.experts) in (d1, None)
    b.save()
    b.close()
    c = _trainer(root, "b")
    assert c.resume_from == root / "b" / "checkpoints" / "step_000001" and c.step == 1
    c.train()
    assert weights_digest(c.experts) in (d2, None), "resumed across layouts, not bitwise"
    c.close()

    # A former full checkpoint (frozen weights, no fingerprint) still loads and trains on bitwise.
    _copy_checkpoint(root / "a", root / "old", 1)
    d = _trainer(root, "old")
    frozen = sum(p.numel() * p.element_size() for p in d.experts.parameters() if not p.requires_grad)
    _old_style_save(d, C)
    d.close()
    full = root / "old" / "checkpoints" / "step_000001"
    assert any(".base_layer." in k for k in _keys(full))
    lean_bytes, full_bytes = _size(lean), _size(full)
    assert full_bytes - lean_bytes >= frozen > 0, (lean_bytes, full_bytes, frozen)
    e = _trainer(root, "old")
    assert e.step == 1 and weights_digest(e.experts) in (d1, None)
    e.train()
    assert weights_digest(e.experts) in (d2, None), "an old full checkpoint did not resume bitwise"
    e.close()
    if rank == 0:
        print(f"\nLoRA checkpoint bytes: lean {lean_bytes}, former {full_bytes} (frozen weights {frozen})")
        _rewrite_header(root / "model" / "transformer_2")
    dist.barrier()
    try:
        _trainer(root, "b", num_rollouts=3)
    except ValueError as err:
        message = str(err)
    else:
        raise AssertionError("a checkpoint of another base model was resumed")
    assert "the checkpoint was trained from another base model: transformer_2 of" in message, message
    assert f"set model.path to {(root / 'model').resolve()}" in message, message


def _rewrite_header(folder: Path) -> None:
    """The same tensors under another header: what a different model of the same shapes looks like."""
    from safetensors.torch import load_file, save_file

    file = folder / "diffusion_pytorch_model.safetensors"
    save_file(load_file(file), file, metadata={"format": "pt", "note": "another model"})


def test_lean_checkpoints_resume_bitwise_across_layouts(tmp_path):
    shutil.copytree(TINY, tmp_path / "model")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run_pooled(_body, 4, str(tmp_path))
