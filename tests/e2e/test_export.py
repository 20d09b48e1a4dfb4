"""Export through the real launcher: the diffusers folders a run leaves under ``<run>/export``.

Three 2-process runs of the tiny recipes (in the session's shared torchrun launch,
``tests/e2e/conftest.py``), one rollout (2 optimizer steps) each:

- full fine-tune at dp1 x sp2 (the experts carry the sequence-parallel install when gathered):
  ``WanPipeline.from_pretrained(<run>/export/pipeline)`` loads, and both experts' weights equal the
  final checkpoint's (``dcp_to_torch_save``: keys ``model.<expert>.<param>``, expert ``0`` is
  ``transformer``, ``1`` is ``transformer_2``) bit for bit;
- LoRA (``--model.lora-rank 4``, alpha 64: scale 16) at dp2, for each model family (parametrized):
  Wan's two experts, ``lora/transformer`` and ``lora/transformer_2``, load with
  ``WanPipeline.load_lora_weights`` (``load_into_transformer_2=True`` for the second: diffusers'
  ``WanLoraLoaderMixin``); the tiny LTX-Video's ``lora/transformer`` with ``LTXPipeline``'s
  (``LTXVideoLoraLoaderMixin``). Each holds the checkpoint's adapter weights; ``merged/`` holds
  W + (alpha / r) B A (W: the model folder's, the checkpoint holds only the adapters), and its
  transformer output equals the base pipeline with the adapters loaded (fp32 tolerance, fixed
  random input), which is the trained model's.

About 40 s on 2 cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny-wan" / "two_expert"
EXPERTS = ("transformer", "transformer_2")
LORA_RANK, LORA_ALPHA = 4, 64.0
LTX_TINY = REPO / ".cache" / "tiny-wan" / "ltx"


def _check_run(run) -> Path:
    assert "[miles] exported the trained model to" in run.output, run.output[-3000:]
    assert "should be kept in float32" not in run.output, "the export cast the fp32-kept modules"
    return run.run_dir


def _final_checkpoint(run_dir: Path, tmp: Path, experts=EXPERTS) -> list[dict[str, torch.Tensor]]:
    """Each expert's weights in the run's last checkpoint (``model.<i>.<name>`` in the DCP files)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (ckpt,) = sorted((run_dir / "checkpoints").glob("step_*"))
    dcp_to_torch_save(ckpt, tmp / "ckpt.pt")
    model = torch.load(tmp / "ckpt.pt", weights_only=False)["model"]
    weights = [{} for _ in experts]
    for key, value in model.items():
        index, name = key.split(".", 1)
        weights[int(index)][name] = value
    return weights


_BASE = ["--config", "configs/tiny_cpu.yaml", "--run.wandb-mode", "disabled", "--run.no-progress"]
_BASE += ["--train.num-rollouts", "1", "--model.tiny-model-dir", str(TINY.parent)]
_LORA = ["--model.lora-rank", str(LORA_RANK), "--model.lora-alpha", str(LORA_ALPHA)]
_LTX = ["--config", "configs/tiny_ltx_cpu.yaml", "--run.wandb-mode", "disabled", "--train.num-rollouts", "1"]
SHARED_RUNS = {  # tests/e2e/conftest.py
    2: {
        "full": [*_BASE, "--sequence-parallel-size", "2", "--ulysses-degree", "2"],
        "lora": [*_BASE, *_LORA],
        "ltx_lora": [*_LTX, *_LORA],
    }
}


@pytest.fixture(scope="module")
def runs(shared_runs):
    return {name: _check_run(shared_runs[name]) for name in SHARED_RUNS[2]}


def _pipeline(path: Path, family: str = "wan"):
    from diffusers import LTXPipeline, WanPipeline

    pipeline = LTXPipeline if family == "ltx" else WanPipeline
    return pipeline.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def _forward(transformer, seed: int = 0) -> torch.Tensor:
    """The transformer on a fixed random latent (5 frames at 64x64) and text embedding."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 16, 2, 8, 8, generator=g)
    context = torch.randn(1, 16, transformer.config.text_dim, generator=g)
    with torch.no_grad():
        return transformer(latents, torch.tensor([500.0]), context, return_dict=False)[0]


def _forward_ltx(transformer, seed: int = 0) -> torch.Tensor:
    """The LTX transformer on fixed random tokens (2 x 3 x 4 latent) and text, half of it masked."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(1, 24, transformer.config.in_channels, generator=g)
    text = torch.randn(1, 16, transformer.config.caption_channels, generator=g)
    mask = (torch.arange(16) < 8)[None]
    with torch.no_grad():
        return transformer(
            tokens, text, torch.tensor([500.0]), mask, num_frames=2, height=3, width=4, return_dict=False
        )[0]


# family: (its LoRA run, base folder, experts, transformer forward)
FAMILIES = {
    "wan": ("lora", TINY, EXPERTS, _forward),
    "ltx": ("ltx_lora", LTX_TINY, ("transformer",), _forward_ltx),
}


def test_full_export_loads_with_the_trained_weights(runs, tmp_path):
    run_dir = runs["full"]
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["pipeline"]  # no .partial left
    umask = os.umask(0)
    os.umask(umask)
    for path in [run_dir / "export", *(run_dir / "export").rglob("*")]:  # readable as the umask allows
        want_mode = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == want_mode, (path, oct(path.stat().st_mode))
    pipe = _pipeline(run_dir / "export" / "pipeline")
    base = _pipeline(TINY)
    trained = _final_checkpoint(run_dir, tmp_path)
    for name, want in zip(EXPERTS, trained):
        got = getattr(pipe, name).state_dict()
        assert got.keys() == want.keys(), name
        for key in want:
            assert got[key].dtype == torch.float32 and torch.equal(got[key], want[key]), (name, key)
        # Training moved the weights, so the comparison is not vacuous.
        moved = [k for k, v in getattr(base, name).state_dict().items() if not torch.equal(v, want[k])]
        assert moved, f"{name}: no weight changed in training"
    # The frozen parts are the base model's.
    for key, value in base.text_encoder.state_dict().items():
        assert torch.equal(pipe.text_encoder.state_dict()[key], value), key


def _lora_pipeline(run_dir: Path, family: str = "wan"):
    _, tiny, experts, _ = FAMILIES[family]
    pipe = _pipeline(tiny, family)
    for name in experts:
        extra = {"load_into_transformer_2": name == "transformer_2"} if family == "wan" else {}
        pipe.load_lora_weights(run_dir / "export" / "lora" / name, adapter_name="grpo", **extra)
    return pipe


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_export_holds_the_trained_adapters_and_merged_weights(runs, tmp_path, family):
    run, tiny, experts, _ = FAMILIES[family]
    run_dir = runs[run]
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["lora", "merged"]
    assert sorted(p.name for p in (run_dir / "export" / "lora").iterdir()) == sorted(experts)
    pipe = _lora_pipeline(run_dir, family)
    merged = _pipeline(run_dir / "export" / "merged", family)
    base = _pipeline(tiny, family)
    trained = _final_checkpoint(run_dir, tmp_path, experts)
    scale = LORA_ALPHA / LORA_RANK
    for name, want in zip(experts, trained):
        # The adapters: the checkpoint's lora_A / lora_B, bit for bit.
        loaded = getattr(pipe, name).state_dict()
        adapters = {k: v for k, v in want.items() if ".lora_" in k}
        assert adapters, f"{name}: the checkpoint has no LoRA weights"
        for key, value in adapters.items():
            assert torch.equal(loaded[key.replace(".default.", ".grpo.")], value), (name, key)
        # merged/: W + (alpha / r) B A for every adapted module, W from the model folder (the lean
        # checkpoint holds only the adapters); every other weight is the model folder's.
        merged_sd = getattr(merged, name).state_dict()
        assert not any("lora" in k for k in merged_sd)
        assert not any(".base_layer." in k for k in want), f"{name}: the checkpoint holds frozen weights"
        for key, value in getattr(base, name).state_dict().items():
            module, _, kind = key.rpartition(".")
            expect = value
            if kind == "weight" and f"{module}.lora_A.default.weight" in want:
                a, b = want[f"{module}.lora_A.default.weight"], want[f"{module}.lora_B.default.weight"]
                expect = value + scale * (b @ a)
            torch.testing.assert_close(merged_sd[key], expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_merged_output_equals_base_with_adapters_loaded(runs, family):
    run, tiny, experts, forward = FAMILIES[family]
    pipe = _lora_pipeline(runs[run], family)
    merged = _pipeline(runs[run] / "export" / "merged", family)
    base = _pipeline(tiny, family)
    for name in experts:
        got = forward(getattr(pipe, name))
        torch.testing.assert_close(got, forward(getattr(merged, name)), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got, forward(getattr(base, name)), rtol=1e-4, atol=1e-5)  # trained
