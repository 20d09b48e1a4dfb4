"""The 81-frame world's recipes: ``configs/world_81.yaml`` plans (its dry run passes) and is the
shipped DiffusionNFT recipe with only the model, prompts, reward and batch swapped;
``bench/world81_recipes.py`` keeps every shipped recipe's own settings, and each recipe it writes
passes the dry run on one GPU rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import world81_recipes as w81  # noqa: E402

KEPT = ("algorithm", "grpo", "nft", "awm", "dgpo", "dpo", "rollout")
"""Sections the swap never touches (what makes each recipe that recipe)."""


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes name the model and prompts relative to the repository
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        monkeypatch.delenv(name, raising=False)


def test_world_81_yaml_is_the_shipped_nft_recipe_swapped_and_its_dry_run_passes():
    from miles.config import parse_args
    from miles.train.dry_run import dry_run

    shipped = yaml.safe_load((ROOT / "configs/world_81.yaml").read_text())
    made = w81.world81_recipe("configs/wan2_1_t2v_1_3b_nft.yaml")
    assert shipped["run"].pop("name") == "world_81" and made["run"].pop("name")
    assert shipped == made
    cfg, _ = parse_args(["--config", "configs/world_81.yaml"])
    rep = dry_run(cfg, world_size=1, verbose=False, device_type="cuda")
    assert rep["sequence"]["latent_shape"] == [16, 21, 60, 104]
    assert rep["sequence"]["tokens_per_sample"] == 32760
    assert rep["params"]["transformer"] * 4 <= 60e6  # the prior's fp32 weights fit the commit limit


def test_every_shipped_recipe_keeps_its_settings_and_plans_on_one_gpu(tmp_path):
    paths = w81.write_recipes(tmp_path, list(w81.RECIPES))
    for name, path in paths.items():
        shipped = yaml.safe_load((ROOT / w81.RECIPES[name]).read_text())
        made = yaml.safe_load(path.read_text())
        for section in KEPT:
            assert made.get(section) == shipped.get(section), (name, section)
        for section, swapped in (("model", {"path"}), ("train", {"num_rollouts"})):
            assert {k: v for k, v in made[section].items() if k not in swapped} == {
                k: v for k, v in shipped[section].items() if k not in swapped
            }, (name, section)
        assert made["data"]["group_size"] == shipped["data"]["group_size"]
        assert made["train"]["num_rollouts"] * made["train"]["steps_per_rollout"] == w81.STEPS
        assert made["reward"] == {"weights": {"world_adherence": 1.0}} and made["model"]["path"] == w81.MODEL
    reports = w81.dry_run_all(paths)  # what train_grpo.py --dry-run plans, on one CUDA rank
    assert {r["sequence"]["tokens_per_sample"] for r in reports.values()} == {32760}
    runs = w81.run_names(["nft"], [0, 1], negated=True)
    assert [r[0] for r in runs] == ["nft-s0", "nft-s0-negated", "nft-s1", "nft-s1-negated"]
    batch = w81.run_names(["nft"], [0, 1, 2], negated=True, twin_seeds=[0])  # the GPU batch's four
    assert [r[0] for r in batch] == ["nft-s0", "nft-s0-negated", "nft-s1", "nft-s2"]
    twin = w81.command(tmp_path, paths["nft"], *runs[1][0:1], 0, True)
    assert twin[-1] == "--grpo.negate-advantages" and "--run.seed" in twin and "--train.no-resume" in twin
    assert "--train.no-resume" not in w81.command(tmp_path, paths["nft"], "nft-s0", 0, False, resume=True)
    est = w81.estimate(paths["flow_grpo_cfg"])
    # Flow-GRPO as shipped: 20 steps with CFG (40 forwards) + an SDE window of 4 trained through CFG
    assert est["forwards_per_sample"] == 20 * 2 + 4 * 3 * 2
