"""The model-family seam (``miles.models.family``): the Wan family found from a folder, its expert
routing and per-token timesteps checked against WanPipeline's rules written out here, with the
boundary and the timestep layout read from the tiny folders' own JSON files (not through the family)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.config import Config, ModelConfig
from miles.models.family import family_of, model_folder
from miles.rollout.sampler import flow_sigmas

ROOT = Path(__file__).resolve().parents[2]


@functools.cache  # each folder read once (configs only, on the meta device)
def _meta(variant: str):
    cfg = Config(model=ModelConfig(tiny_model_dir=str(ROOT / ".cache/tiny-wan"), tiny_variant=variant))
    path = model_folder(cfg.model)
    family = family_of(path)
    model, _, _ = family.load_meta(cfg)
    index = json.loads((path / "model_index.json").read_text())
    return family, model, index, path


def _fresh_timesteps(boundary: float) -> np.ndarray:
    """fp32 timesteps: uniform draws, a shifted schedule, the boundary itself and its fp32 neighbours."""
    edge = np.float32(boundary * 1000)
    draws = np.random.default_rng(0).uniform(0.0, 1000.0, 300).astype(np.float32)
    grid = (flow_sigmas(12, 5.0) * 1000).numpy()
    return np.concatenate(
        [draws, grid, [edge, np.nextafter(edge, np.float32(0)), np.nextafter(edge, np.float32(2000))]]
    )


@pytest.mark.parametrize("variant", ["two_expert", "i2v_two_expert"])
def test_two_expert_routing_is_wan_pipelines_rule(variant):
    """Expert 0 (``transformer``) iff fp32 t >= boundary_ratio·1000, else expert 1, on fresh timesteps."""
    family, model, index, path = _meta(variant)
    assert family.name == "wan" and len(model.transformers) == 2
    assert model.expert_folders == ("transformer", "transformer_2")
    assert all((path / sub / "config.json").is_file() for sub in model.expert_folders)
    ratio = index["boundary_ratio"]
    routing = model.routing
    assert routing.boundary_sigma == ratio  # SFT splits the σ density of its experts there
    for t in _fresh_timesteps(ratio):
        want = 0 if np.float32(t) >= np.float32(ratio * 1000) else 1
        assert routing.expert_index(torch.tensor(t), 2) == want, t
        assert routing.expert_index(float(t), 2) == want, t
    assert routing.expert_index(999.0, 1) == 0  # one expert passed: always it


def test_one_expert_folder_routes_to_it_and_refuses_two():
    _, model, index, _ = _meta("single_expert")
    assert len(model.transformers) == 1 and model.expert_folders == ("transformer",)
    assert index.get("boundary_ratio") is None and model.routing.boundary_sigma is None
    assert {model.routing.expert_index(float(t), 1) for t in _fresh_timesteps(0.5)} == {0}
    with pytest.raises(ValueError, match="boundary_ratio"):
        model.routing.expert_index(500.0, 2)


@pytest.mark.parametrize("variant", ["ti2v", "two_expert", "single_expert"])
def test_timesteps_are_per_token_as_the_folder_says(variant):
    """With ``expand_timesteps`` (Wan2.2 TI2V) each sample's t is repeated over its (F/pt)(H/ph)(W/pw)
    tokens, (B, S); otherwise the expert takes (B,) as given."""
    _, model, index, path = _meta(variant)
    per_token = bool(index.get("expand_timesteps", False))
    assert per_token == (variant == "ti2v") == model.routing.per_token_timesteps
    pt, ph, pw = json.loads((path / "transformer" / "config.json").read_text())["patch_size"]
    c, f, h, w = model.latent_shape(9, 32, 48)
    x = torch.zeros(3, c, f, h, w)
    t = torch.tensor([999.0, 412.5, 0.25])
    got = model.routing.model_timestep(t, x, model.transformers[0])
    if per_token:
        tokens = (f // pt) * (h // ph) * (w // pw)
        assert tokens == model.num_tokens(9, 32, 48)
        want = torch.stack([torch.full((tokens,), float(v)) for v in t])
    else:
        want = t
    assert got.shape == want.shape and torch.equal(got, want)


def test_a_folder_no_family_reads_is_refused_naming_the_families(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match=r"FluxPipeline, which no model family reads \(wan: \["):
        family_of(tmp_path)
    with pytest.raises(ValueError, match="is not a folder"):
        family_of(tmp_path / "nowhere")
