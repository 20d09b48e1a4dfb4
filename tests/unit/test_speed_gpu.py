"""``bench/speed_gpu.sh`` (issue 43's GPU batch) on CPU: every stage in its dry mode (``DRY=1``), each
python command it would run parsed by that script's own parser (a flag a bench does not define, or
one it refuses, fails here rather than on the device), the stages' estimates within the device
limits, and the wheels it downloads pinned as pyproject.toml pins them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SCRIPT = REPO / "bench" / "speed_gpu.sh"
STAGES = [
    "profile",
    "backends",
    "backends2",
    "peer-lora",
    "peer-full",
    "fit",
    "precision",
    "step-lowp",
    "mfu",
]


def dry(stage: str, tmp_path: Path, **env) -> list[str]:
    proc = subprocess.run(
        ["bash", str(SCRIPT), stage, str(tmp_path / "out")],
        cwd=REPO,
        env={**os.environ, "DRY": "1", "SCRATCH": str(tmp_path / "scratch"), "PY": sys.executable, **env},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def commands(lines: list[str]) -> list[list[str]]:
    out = []
    for line in lines:
        if line.startswith("CMD "):
            words = shlex.split(line[4:])
            if words[0] == "timeout":
                assert int(words[1]) <= 570  # under the device tool's 600 s a command
                words = words[2:]
            out.append(words)
    return out


def parse_with_its_parser(words: list[str]) -> None:
    assert words[0] == sys.executable and words[1].startswith("bench/"), words
    script, args = words[1], words[2:]
    name = Path(script).stem
    if name == "attention_precision":  # h43a's bench: the interface this script calls it with
        text = (REPO / script).read_text()
        for flag in (a for a in args if a.startswith("--")):
            assert f'"{flag}"' in text, f"{script} defines no {flag}"
        return
    module = __import__(f"bench.{name}", fromlist=["_"])
    if name == "peer_step":
        module.parse(args)  # its own checks too (--fit frame counts, --fit-only)
    else:
        module.parser().parse_args(args)


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_command_parses(stage, tmp_path):
    lines = dry(stage, tmp_path)
    cmds = commands(lines)
    if stage == "precision" and not (REPO / "bench" / "attention_precision.py").is_file():
        assert any("skipped" in line for line in lines) and not cmds
        return
    assert cmds, lines
    for words in cmds:
        parse_with_its_parser(words)
    assert any(line.startswith(f"[speed] {stage}: ~") for line in lines)  # its device-time estimate


def test_stage_commands_are_what_the_issue_asks(tmp_path):
    profile = commands(dry("profile", tmp_path))[0]
    assert profile[1] == "bench/profile_step.py" and "--model" not in profile  # the 1.3B shape, 81x480x832
    sweep = commands(dry("backends", tmp_path)) + commands(dry("backends2", tmp_path))
    cases = {(w[w.index("--attention-backend") + 1], w[w.index("--checkpointing") + 1]) for w in sweep}
    assert {"_native_cudnn", "_native_flash", "_native_efficient", "xformers", "flex"} == {
        b for b, _ in cases
    }
    assert {("_native_cudnn", "none"), ("_native_cudnn", "budget")} <= cases  # with and without checkpointing
    picked = commands(dry("backends", tmp_path, CASES="_native_flash:full"))
    assert len(picked) == 1 and picked[0][-4:] == [
        "--attention-backend",
        "_native_flash",
        "--checkpointing",
        "full",
    ]
    lora, full = commands(dry("peer-lora", tmp_path))[0], commands(dry("peer-full", tmp_path))[0]
    assert lora[lora.index("--train") + 1] == "lora" and full[full.index("--train") + 1] == "full"
    fit = commands(dry("fit", tmp_path))[0]
    assert "--fit-only" in fit and fit[fit.index("--train") + 1] == "lora"
    mfu = commands(dry("mfu", tmp_path))[0]
    assert sorted(mfu[mfu.index("--json") + 1 :]) == sorted(
        str(p.relative_to(REPO)) for p in (REPO / "docs" / "bench").glob("*.json")
    )


def test_plan_estimates_fit_the_device_budget(tmp_path):
    lines = dry("plan", tmp_path)
    estimates = {m[1]: int(m[2]) for line in lines if (m := re.match(r"(\S+)\s+~\s*(\d+) s$", line))}
    assert set(estimates) == set(STAGES)
    assert all(v <= 570 for v in estimates.values())
    order = next(line for line in lines if line.startswith("order: ")).removeprefix("order: ")
    first = order.split("|")[0].split()
    assert sum(estimates[s] for s in first) <= 1800 - 120  # a session's 30 min, the machine's start aside
    assert f"~{sum(estimates[s] for s in first)} s" in lines[-1]
    assert set(order.replace("|", " ").split()) == set(STAGES)  # every stage has its place


def test_wheels_are_pinned_as_the_project_pins_them(tmp_path):
    words = commands(dry("wheels", tmp_path))[0]
    assert words[1:4] == ["-m", "pip", "download"] and "--no-deps" in words
    pinned = dict(re.findall(r'"([a-z_]+)==([^"]+)"', (REPO / "pyproject.toml").read_text()))
    wheels = dict(w.split("==") for w in words if "==" in w)
    for name in ("diffusers", "transformers", "peft", "tyro"):
        assert wheels[name] == pinned[name], name
    assert wheels["xformers"] == "0.0.35"
