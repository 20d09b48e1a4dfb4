"""``bench/ltx_gpu.sh`` (issue 45's GPU batch) on CPU, in its dry mode (``DRY=1``): every command it
would run on the device is parsed by its bench's own parser, each algorithm's train_grpo.py flags
pass the trainer's dry run (a flag or value the trainer refuses fails here rather than on the device),
the seeds and twins are those the docs report, and the rehearsal case is the LTX recipe's layout."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _commands(tmp_path: Path) -> list[list[str]]:
    proc = subprocess.run(
        ["bash", "bench/ltx_gpu.sh", str(tmp_path / "out")],
        cwd=REPO,
        env={**os.environ, "DRY": "1", "SCRATCH": str(tmp_path / "scratch"), "PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [shlex.split(line[4:]) for line in proc.stdout.splitlines() if line.startswith("CMD ")]


def test_every_command_parses_and_each_curve_passes_the_dry_run(tmp_path):
    from bench import learning
    from bench.memory_rehearsal import CASES

    cmds = _commands(tmp_path)
    curves = [c for c in cmds if c[1] == "bench/learning.py"]
    rehearsal = [c for c in cmds if "bench/memory_rehearsal.py" in c]
    assert len(curves) == 4 and len(rehearsal) == 1
    seen = set()
    for words in curves:
        args = learning.parser().parse_args(words[2:])
        assert args.gpu and args.config == "configs/world_ltx_cpu.yaml" and args.time_limit <= 570 - 60
        seed = args.extra[args.extra.index("--run.seed") + 1]
        algorithm = "flow_grpo" if "--algorithm.name" in args.extra else "diffusion_nft"
        for name in args.runs:
            seen.add((algorithm, name.replace("nft-", "").replace("-lr1e-4", ""), seed))
            if (algorithm, "checked") in seen:  # one dry run per algorithm: the others differ in seed or sign
                continue
            seen.add((algorithm, "checked"))
            flags = learning.command(
                tmp_path, name, learning.RUNS[name], 1, args.extra, args.config, gpu=True
            )
            flags = flags[flags.index("train_grpo.py") + 1 :]
            proc = subprocess.run(
                [sys.executable, "train_grpo.py", *flags, "--dry-run", "--world-size", "1"],
                cwd=REPO,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, (name, proc.stdout[-2000:] + proc.stderr[-2000:])
    seen = {r for r in seen if len(r) == 3}
    nft = {(a, n, s) for a, n, s in seen if a == "diffusion_nft"}
    assert nft == {("diffusion_nft", run, s) for run in ("dp4", "dp4-negated") for s in "012"}
    assert {("flow_grpo", "dp4", "0"), ("flow_grpo", "dp4-negated", "0")} <= seen
    words = rehearsal[0]
    assert words[0] == "timeout" and int(words[1]) <= 570
    case = CASES[words[words.index("--cases") + 1]]
    assert case.recipe == "configs/ltx_video_2b.yaml" and (case.world, case.sp) == (8, 4)
