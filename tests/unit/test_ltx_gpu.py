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


def _fake_run(run_dir: Path, evals: list[tuple[int, float]], scores: list[float]) -> None:
    import json

    (run_dir / "eval").mkdir(parents=True)
    rows = [{"step": s, "time": 100.0 + s, "reward/mean": a} for s, a in evals if s]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ev = [
        {"step": s, "rollout": s // 2, "time": 100.0 + s, "time/eval_s": 1.0, "eval/reward/mean": a}
        for s, a in evals
    ]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    samples = [{"prompt": f"p{i}", "seed": 0, "reward": r} for i, r in enumerate(scores)]
    (run_dir / "eval" / f"step_{evals[-1][0]:06d}.json").write_text(json.dumps({"samples": samples}))


def test_runs_resumed_elsewhere_are_read_back_and_seeds_summarized(tmp_path, monkeypatch):
    """``bench/learning.py --read`` rebuilds a seed's tables from run directories without launching;
    ``bench/learning_seeds.py`` gives each run's mean, spread and error ratio over the seeds."""
    import json

    from bench import learning, learning_seeds

    finals = {0: 0.5, 1: 0.6, 2: 0.55}
    for seed, final in finals.items():
        out = tmp_path / f"s{seed}"
        _fake_run(out / "nft-dp4-lr1e-4", [(0, 0.2), (2, 0.4), (4, final)], [final, final])
        _fake_run(out / "nft-dp4-negated-lr1e-4", [(0, 0.2), (4, 0.01 * seed)], [0.0, 0.02 * seed])
        argv = [
            "learning.py",
            "--read",
            "--out",
            str(out),
            "--runs",
            "nft-dp4-lr1e-4",
            "nft-dp4-negated-lr1e-4",
        ]
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(learning, "launch_all", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
        learning.main()
        got = json.loads((out / "learning.json").read_text())
        assert [e["adherence"] for e in got["nft-dp4-lr1e-4"]["eval"]] == [0.2, 0.4, final]
    learning_seeds.main(["--out", str(tmp_path / "seeds.json"), *(str(tmp_path / f"s{s}") for s in finals)])
    runs = json.loads((tmp_path / "seeds.json").read_text())["runs"]
    nft = runs["nft-dp4-lr1e-4"]
    assert nft["final"] == [0.5, 0.6, 0.55] and abs(nft["final_mean"] - 0.55) < 1e-12
    assert abs(nft["final_std"] - 0.05) < 1e-12 and nft["final_range"] == [0.5, 0.6]
    assert abs(nft["error_ratio_of_means"] - 0.45 / 0.8) < 1e-12
    assert runs["nft-dp4-negated-lr1e-4"]["final"] == [0.0, 0.01, 0.02]
    assert "0.550 ± 0.050" in (tmp_path / "seeds.md").read_text()
