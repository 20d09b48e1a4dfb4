"""The 81-frame world's device plan (``bench/world81_plan.py``): its stages fit the device's commands
and sessions, the headline comes first, the recipes' forwards are counted as their algorithms run
them, the 1-block prior halves the transformer's work, and the carried state is what resumes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import world81_plan as plan_mod  # noqa: E402


@pytest.fixture(scope="module")
def plans():
    return {blocks: plan_mod.plan(blocks) for blocks in (1, 2)}


def test_every_stage_fits_its_commands_and_sessions_in_headline_order(plans):
    for p in plans.values():
        names = [s["stage"] for s in p["stages"]]
        assert names[:3] == ["pretrain", "curves", "report"]  # the headline first
        for s in p["stages"]:
            assert s["device_s"] / s["commands"] <= plan_mod.COMMAND_S
        order = [name for session in p["sessions"] for name in session["stages"]]
        assert sorted(set(order), key=order.index) == names  # every stage, in order
        assert all(s["device_s"] <= plan_mod.SESSION_S for s in p["sessions"])
        total = sum(s["device_s"] for s in p["stages"]) + plan_mod.SESSION_OVERHEAD_S * len(p["sessions"])
        assert sum(s["device_s"] for s in p["sessions"]) == pytest.approx(total, abs=len(p["sessions"]))
        parts = p["pretrain_parts_s"]
        assert p["stages"][0]["work_s"] == sum(parts.values()) - parts["start_s"]


def test_nft_counts_its_old_policy_and_reference_forwards(plans):
    nft = plans[2]["nft_curve"]
    # 10 ODE steps, CFG-free; 9 trained levels x (fwd+bwd = 3, the old policy, the KL reference)
    assert nft["forwards_per_sample"] == 10 + 9 * (3 + 1 + 1)
    assert nft["samples_per_curve"] == 2 * 8 * 150
    assert plans[2]["stages"][1]["work_s"] == pytest.approx(4 * nft["curve_s_alone"], abs=1)


def test_one_block_halves_the_transformers_work_not_the_decodes(plans):
    one, two = plans[1]["nft_curve"], plans[2]["nft_curve"]
    for part in ("rollout_s", "train_s", "no_grad_s"):
        assert one[part] == pytest.approx(two[part] / 2, abs=1.5)
    assert one["decode_s"] == two["decode_s"]
    assert plans[1]["pretrain_parts_s"]["prior_s"] == pytest.approx(
        plans[2]["pretrain_parts_s"]["prior_s"] / 2, abs=1
    )


def test_carry_keeps_the_newest_checkpoint_and_the_prior_but_no_videos(tmp_path):
    work, dest = tmp_path / "work", tmp_path / "dest"
    run = work / "curves" / "nft-s0"
    for step in ("step_000010", "step_000020"):
        (run / "checkpoints" / step).mkdir(parents=True)
        (run / "checkpoints" / step / "COMPLETE").write_text("")
        (run / "checkpoints" / step / "state.distcp").write_bytes(b"x" * 10)
    (run / "checkpoints" / "step_000030").mkdir()  # incomplete: not resumable
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "videos").mkdir()
    (run / "videos" / "step_10.mp4").write_bytes(b"v" * (plan_mod.CARRY_SKIP_BYTES + 1))
    (work / "pipeline_81" / "vae").mkdir(parents=True)
    (work / "pipeline_81" / "vae" / "w.safetensors").write_bytes(b"w" * (plan_mod.CARRY_SKIP_BYTES + 1))
    done = plan_mod.carry(work, dest)
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == [
        "curves/nft-s0/checkpoints/step_000020/COMPLETE",
        "curves/nft-s0/checkpoints/step_000020/state.distcp",
        "curves/nft-s0/metrics.jsonl",
        "pipeline_81/vae/w.safetensors",
    ]
    assert done["skipped"] == ["curves/nft-s0/videos/step_10.mp4"]


SCRIPT = ROOT / "bench" / "world81_gpu.sh"
STAGES = ["plan", "pretrain", "curves", "report", "vae", "recipes", "peer"]


def _dry(stage: str, tmp_path: Path, **env) -> list[list[str]]:
    import os
    import shlex
    import subprocess

    proc = subprocess.run(
        ["bash", str(SCRIPT), stage, str(tmp_path / "out")],
        cwd=ROOT,
        env={**os.environ, "DRY": "1", "WORK": str(tmp_path / "work"), "PY": sys.executable, **env},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [shlex.split(line[4:]) for line in proc.stdout.splitlines() if line.startswith("CMD ")]


def _parse(words: list[str]) -> None:
    """A command parsed by its own script's parser (a flag it does not define fails here, not on the
    device); the benches this script does not own are checked for each flag's definition."""
    if words[0] == "timeout":
        assert words[1:3] == ["-k", "15"] and int(words[3]) <= 570  # under the device's 600 s
        words = words[4:]
    assert words[0] == sys.executable
    if words[1:3] == ["-m", "miles.pretrain_world_81"]:
        from miles.pretrain_world_81 import config_from_args, parser

        config_from_args(parser().parse_args(words[3:]))
        return
    script, args = words[1], words[2:]
    name = Path(script).stem
    if name in ("world81_recipes", "world81_plan"):
        module = __import__(name)
        module.parser().parse_args(args)
        return
    text = (ROOT / script).read_text()
    for flag in (a for a in args if a.startswith("--")):
        assert f'"{flag}"' in text, f"{script} defines no {flag}"


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_command_parses(stage, tmp_path):
    cmds = _dry(stage, tmp_path, PRIOR_BLOCKS="1", EVAL_EVERY="30", RECIPES="awm dgpo")
    assert cmds
    for words in cmds:
        _parse(words)
    if stage != "plan":  # every stage leaves what resumes it in OUT
        assert cmds[-1][1:3] == ["bench/world81_plan.py", "--carry"]
    joined = [" ".join(c) for c in cmds]
    if stage == "pretrain":
        assert "--prior-blocks 1" in joined[0] and "--max-minutes 8.5" in joined[0]
    if stage == "curves":
        assert "--resume" in joined[0] and "--eval-every 30" in joined[0] and "--time-limit 480" in joined[0]
