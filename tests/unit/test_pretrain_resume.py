"""The world's pretraining paused at a budget and continued gives, bitwise on CPU, what one
uninterrupted run gives (``miles.pretrain_resume``, ``miles.pretrain_world``), at both shapes' code
paths, at a reduced size; the pieces around it (the on-demand video pool, the refusal of a state
written under other settings, SIGTERM, the exit status)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.pretrain_resume import PAUSED_EXIT, Budget, Paused, Resumable
from miles.pretrain_world import PretrainConfig, default_state_dir, pretrain
from miles.world.pretrain_data import VideoPool, crop_batch, render_dataset
from miles.world.world import Shape, train_prompts

TINY_9 = PretrainConfig(
    num_threads=1, vae_short_steps=2, vae_long_steps=1, vae_batch=2, vae_pool_per_prompt=1,
    videos_per_prompt=1, dit_steps=3, dit_batch=4, eval_seeds_heldout=1, eval_seeds_train=1, eval_steps=1,
)  # fmt: skip


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _chained(out: Path, cfg, cuts: list[tuple[int, str]], run=pretrain) -> dict:
    """Launch after launch, each cut after the given number of steps (and expected to pause in the
    given stage), then one launch without a budget."""
    for steps, stage in cuts:
        with pytest.raises(Paused) as paused:
            run(out, cfg, Budget(steps=steps))
        assert paused.value.stage == stage
        assert (default_state_dir(out) / "state.pt").is_file()
    return run(out, cfg)


def test_a_run_cut_in_every_stage_ends_bitwise_as_one_uninterrupted_run(tmp_path):
    """9-frame code path: cut mid-VAE (step 1 of 3), mid-prior (step 1 of 3) and before the
    evaluation; the folder's every file and the report's scores are those of one run."""
    whole = pretrain(tmp_path / "whole" / "pipeline", TINY_9)
    out = tmp_path / "cut" / "pipeline"
    cut = _chained(out, TINY_9, [(1, "vae"), (3, "prior"), (2, "eval")])
    assert _files(out) == _files(tmp_path / "whole" / "pipeline")
    for split in ("train", "heldout"):
        assert cut[split] == whole[split]
    assert cut["times"]["launches"] == 4 and whole["times"]["launches"] == 1
    assert not default_state_dir(out).exists()  # the finished run's state is gone


def test_81_frame_code_path_resumes_bitwise_at_a_reduced_shape(tmp_path):
    """``Pretrain81Config`` (its own VAE and prior, noise from the device generator, the trainer's
    evaluation) at 5 x 32 x 48 on CPU, cut mid-VAE and mid-prior."""
    from miles.pretrain_world_81 import PRIOR, Pretrain81Config
    from miles.pretrain_world_81 import pretrain as pretrain_81

    cfg = Pretrain81Config(
        shape=(5, 32, 48), device="cpu", compile=False, prior=dict(PRIOR, num_layers=1), num_threads=1,
        vae_short_steps=1, vae_long_steps=1, vae_batch=2, vae_pool_per_prompt=1, videos_per_prompt=1,
        dit_steps=3, dit_batch=2, eval_seeds_heldout=1, eval_seeds_train=0, eval_steps=1,
    )  # fmt: skip
    whole = pretrain_81(tmp_path / "whole" / "p", cfg)
    cut = _chained(tmp_path / "cut" / "p", cfg, [(1, "vae"), (3, "prior")], run=pretrain_81)
    assert _files(tmp_path / "cut" / "p") == _files(tmp_path / "whole" / "p")
    assert cut["heldout"] == whole["heldout"] and cut["latent_shape"] == [16, 2, 4, 6]


def test_video_pool_renders_what_the_rendered_dataset_holds():
    """The on-demand pool (81-frame videos do not fit a pool) indexes and crops as the tensor."""
    shape = Shape(5, 32, 48)
    prompts = train_prompts()[:3]
    videos, labels = render_dataset(prompts, 2, 10_000, shape)
    pool = VideoPool(prompts, 2, 10_000, shape, "cpu")
    assert pool.shape == tuple(videos.shape) and labels.tolist() == [0, 0, 1, 1, 2, 2]
    for i in range(len(pool)):
        assert torch.equal(pool[i], videos[i])
    centres = torch.full((6, 5, 2), 20.0)
    a = crop_batch(videos, centres, 4, 3, 16, np.random.default_rng(0))
    b = crop_batch(pool, centres, 4, 3, 16, np.random.default_rng(0))
    assert a.shape == (4, 3, 3, 16, 16) and torch.equal(a, b)


def test_a_state_written_under_other_settings_is_refused_by_name(tmp_path):
    Resumable(tmp_path, {"dit_steps": 3, "seed": 0}).save("prior", step=1)
    assert Resumable(tmp_path, {"dit_steps": 3, "seed": 0}).stage == "prior"
    with pytest.raises(SystemExit, match="dit_steps"):
        Resumable(tmp_path, {"dit_steps": 4, "seed": 0})


def test_sigterm_pauses_at_the_next_step():
    budget = Budget()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        budget.install_sigterm()
        assert not budget.spent()
        os.kill(os.getpid(), signal.SIGTERM)
        assert budget.spent()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_command_exits_75_when_paused_and_keeps_its_state(tmp_path):
    from miles import pretrain_world

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as done:
            pretrain_world.main([str(tmp_path / "pipeline"), "--max-minutes", "0"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert done.value.code == PAUSED_EXIT
    state = torch.load(default_state_dir(tmp_path / "pipeline") / "state.pt", weights_only=True)
    assert state["stage"] == "vae" and state["step"] == 0 and state["config"]["dit_steps"] == 3000
