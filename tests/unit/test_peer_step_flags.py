"""``bench/peer_step.py``'s side by side is like for like (issue 43): miles' side gets every setting the
two sides share as a flag, and ``bench/step_bench.py`` turns each flag into the config it trains with.

The check walks the real path: ``peer_step.ours_command`` -> ``step_bench``'s own parser ->
``step_bench.build_config`` (the recipe with the flags applied), and compares each resolved config field
with the peer's setting. A flag dropped on either side, or a recipe default left in its place, fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# settings chosen to differ from the recipe's (configs/wan2_1_t2v_1_3b.yaml: guidance 5, shift 3,
# 512 text tokens, micro-batch 1, no LoRA) so that a default left in place is caught
PEER = [
    "--flow-grpo",
    "/nonexistent/flow_grpo",
    "--out",
    "/tmp/unused",
    "--model",
    "tiny",
    "--shape",
    "5",
    "64",
    "64",
    "--num-steps",
    "6",
    "--train-steps",
    "3",
    "--samples",
    "4",
    "--micro-batch",
    "2",
    "--guidance",
    "4.5",
    "--shift",
    "5.0",
    "--text-tokens",
    "24",
]


@pytest.mark.parametrize("full", [False, True])
def test_ours_gets_every_shared_setting(full, tmp_path):
    from bench import peer_step, step_bench

    peer = peer_step.parse(PEER)
    cmd = peer_step.ours_command(peer, tmp_path / "ours", peer.shape, 100.0, full)
    assert cmd[1].endswith("bench/step_bench.py")
    args = step_bench.parser().parse_args(cmd[2:])
    args.work = tmp_path / "work"  # as main() sets it
    cfg = step_bench.build_config(args, "jpeg", tmp_path / "model", None)

    assert [cfg.rollout.num_frames, cfg.rollout.height, cfg.rollout.width] == peer.shape
    assert cfg.rollout.num_steps == peer.num_steps
    assert cfg.rollout.sde_window_size == peer.train_steps
    assert cfg.data.prompts_per_rank * cfg.data.group_size == peer.samples
    assert cfg.rollout.guidance_scale == peer.guidance
    assert cfg.rollout.shift == peer.shift
    assert cfg.data.max_sequence_length == peer.text_tokens
    assert cfg.train.micro_batch_size == peer.micro_batch
    assert cfg.model.lora_rank == (0 if full else peer_step.LORA_RANK)
    assert cfg.model.lora_alpha == peer_step.LORA_ALPHA
    assert list(cfg.model.lora_target_modules) == peer_step.LORA_TARGETS


def test_unset_shared_flags_keep_the_recipe(tmp_path):
    from bench import step_bench

    args = step_bench.parser().parse_args(["--out", str(tmp_path), "--model", "wan2.1-t2v-1.3b"])
    args.work = tmp_path / "work"
    cfg = step_bench.build_config(args, "jpeg", tmp_path / "model", None)
    assert (cfg.rollout.guidance_scale, cfg.rollout.shift, cfg.model.lora_rank) == (5.0, 3.0, 0)
    assert cfg.data.max_sequence_length == 512


def test_memory_cap_reads_the_shared_variable(monkeypatch):
    from bench import step_bench

    monkeypatch.delenv("MILES_BENCH_MEMORY_CAP_GIB", raising=False)
    assert step_bench.cap_process_memory() is None
    monkeypatch.setenv("MILES_BENCH_MEMORY_CAP_GIB", "80")
    assert step_bench.cap_process_memory() == 80.0


def test_markdown_reads_each_setting_from_the_json():
    from bench import peer_step

    def side(step_s, params):
        return {
            "trainable_params": params,
            "rollout_s": 1.0,
            "rollout_tflops": 1.0,
            "reward_s": 0.5,
            "train_s": 2.0,
            "train_tflops": 1.0,
            "step_s": step_s,
            "peak_gib": 1.0,
        }

    def ours(step_s):
        phase = {"wall_s": 1.0, "tflops": 1.0}
        return {
            "trainable_params": 7,
            "summary": {
                "phases": {"rollout": phase, "decode+reward": phase, "train": phase},
                "step": {"wall_s": step_s},
                "peak_gib": 2.0,
            },
        }

    args = vars(peer_step.parse(PEER))
    results = {
        "args": {k: v for k, v in args.items() if k not in ("flow_grpo", "out")},
        "device": "cpu",
        "flops": {"tokens": 48},
        "lora": {"flow_grpo": side(6.0, 11), "miles": ours(3.0)},
        "full": {"flow_grpo": side(9.0, 99), "miles": ours(2.0)},
    }
    text = peer_step.markdown(results)
    assert "lora: miles' step is 2.00x" in text and "full: miles' step is 4.50x" in text
    assert "| lora | flow_grpo | 11 |" in text and "| full | flow_grpo | 99 |" in text


@pytest.mark.parametrize(
    ("flags", "backend", "ckpt"),
    [
        ([], None, "budget"),
        (["--attention-backend", "_native_flash", "--checkpointing", "none"], "_native_flash", "none"),
    ],
)
def test_attention_sweep_flags_reach_the_config(flags, backend, ckpt, tmp_path):
    """``--attention-backend`` / ``--checkpointing`` (the training backend sweep) become the trainer's
    fields; unset, the recipe's stand; the JSON's ``attention_backend`` is the one the trainer runs."""
    from bench import step_bench

    args = step_bench.parser().parse_args(["--out", str(tmp_path), *flags])
    args.work = tmp_path / "work"
    cfg = step_bench.build_config(args, "jpeg", tmp_path / "model", None)
    assert cfg.parallel.fsdp_attention_backend == backend
    assert cfg.model.activation_checkpointing == ckpt
    cuda = step_bench.resolved_backend(cfg, "cuda")
    assert cuda == (backend or "_native_cudnn")  # the recipe computes in bf16: cudnn by default on CUDA
    assert step_bench.resolved_backend(cfg, "cpu") == backend  # no default on CPU


def test_canary_record_reads_the_trainers_metrics(tmp_path):
    from bench import step_bench

    rows = [
        {"step": 1, "train/log_prob_mean_abs_diff": 0.0, "train/loss": 1.0},
        {"step": 2, "train/loss": 0.5},  # a later optimizer step of the rollout: no canary
        {"step": 3, "train/log_prob_mean_abs_diff": 2.5e-6},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    values = step_bench.read_canary(tmp_path)
    assert values == [0.0, 2.5e-6]
    assert step_bench.canary_record(values) == {
        "canary_per_rollout": [0.0, 2.5e-6],
        "canary_exact": False,
        "canary_max": 2.5e-6,
    }
    assert step_bench.canary_record([0.0, 0.0])["canary_exact"] is True
    assert step_bench.canary_record(step_bench.read_canary(tmp_path / "absent"))["canary_exact"] is False


def test_fit_searches_each_cap_up_to_the_largest_that_fits(tmp_path, monkeypatch):
    """``--fit``: frame counts ascending per cap for both trainers; a failure stops that trainer; at
    141 GiB each starts from its 80 GiB fit; every case is recorded and the Markdown reads them."""
    from bench import peer_step

    capacity = {
        ("flow_grpo", 80.0): 121,
        ("miles", 80.0): 161,
        ("flow_grpo", 141.0): 201,
        ("miles", 141.0): 241,
    }
    ran = []

    def fake(name):
        def run(args, setting, shape, cap, case):
            ran.append((name, cap, shape[0]))
            assert setting == "lora" and case.name == f"fit_lora_{cap:g}_{shape[0]}"
            ok = shape[0] <= capacity[name, cap]
            return {"ok": ok, "peak_gib": shape[0] / 4 if ok else None, "step_s": 1.0 if ok else None}

        return run

    monkeypatch.setattr(peer_step, "fit_peer", fake("flow_grpo"))
    monkeypatch.setattr(peer_step, "fit_ours", fake("miles"))
    argv = ["--flow-grpo", "/nonexistent", "--out", str(tmp_path), "--train", "both"]
    args = peer_step.parse([*argv, "--fit", "201", "81", "121", "161", "241", "281"])
    assert args.fit == [81, 121, 161, 201, 241, 281]
    results = {"args": {}, "device": "cpu"}
    peer_step.fit(args, results)
    fit = results["fit"]
    assert fit["train"] == "lora"
    assert (fit["80"], fit["141"]) == ({"flow_grpo": 121, "miles": 161}, {"flow_grpo": 201, "miles": 241})
    # 80 GiB: each trainer until its first failure; 141 GiB: only counts above the 80 GiB fit
    assert [r for r in ran if r[1] == 80.0] == [
        ("flow_grpo", 80.0, 81), ("miles", 80.0, 81), ("flow_grpo", 80.0, 121), ("miles", 80.0, 121),
        ("flow_grpo", 80.0, 161), ("miles", 80.0, 161), ("miles", 80.0, 201),
    ]  # fmt: skip
    assert [r for r in ran if r[1] == 141.0] == [
        ("flow_grpo", 141.0, 161), ("flow_grpo", 141.0, 201), ("miles", 141.0, 201),
        ("flow_grpo", 141.0, 241), ("miles", 141.0, 241), ("miles", 141.0, 281),
    ]  # fmt: skip
    implied = [(c["trainer"], c["frames"]) for c in fit["cases"] if c.get("implied_by_smaller_cap")]
    assert implied == [("flow_grpo", 81), ("miles", 81), ("flow_grpo", 121), ("miles", 121), ("miles", 161)]
    text = peer_step.markdown({**results, "args": vars(peer_step.parse(PEER)), "flops": {"tokens": 48}})
    assert "Largest frame count in 80 GiB (lora): flow_grpo 121, miles 161." in text
    assert "Largest frame count in 141 GiB (lora): flow_grpo 201, miles 241." in text
    assert "| 80 | 161 | miles | yes | 40.2 | 1.0 |" in text and "| 141 | 281 | miles | no | — | — |" in text
    assert json.loads((tmp_path / "peer_step.json").read_text())["fit"]["141"] == fit["141"]

    # --fit-resume: a search cut short continues; the cases already run are kept, not run again
    first = tmp_path / "first.json"
    cut = {**results, "fit": {**fit, "cases": fit["cases"][:9]}}  # stopped once the 80 GiB search was done
    first.write_text(json.dumps(cut))
    ran.clear()
    again = peer_step.parse(
        [*argv, "--fit", "81", "121", "161", "201", "241", "281", "--fit-only", "--fit-resume", str(first)]
    )
    results2 = {"args": {}, "device": "cpu"}
    peer_step.fit(again, results2)
    assert ran == [r for r in ran if r[1] == 141.0] and len(ran) == 6  # only the 141 GiB cases ran
    assert results2["fit"]["80"] == fit["80"] and results2["fit"]["141"] == fit["141"]
    assert results2["fit"]["cases"] == fit["cases"]


def test_fit_refuses_frame_counts_wan_cannot_take():
    from bench import peer_step

    with pytest.raises(SystemExit, match="4k\\+1"):
        peer_step.parse(["--flow-grpo", "/x", "--out", "/tmp/x", "--fit", "81", "120"])
    with pytest.raises(SystemExit, match="--fit-only needs"):
        peer_step.parse(["--flow-grpo", "/x", "--out", "/tmp/x", "--fit-only"])


def test_the_peers_train_step_gets_every_field_it_reads():
    """``peer_learning.train_rollout`` (shared with ``bench/peer_learning.py``) reads ``args.beta``,
    ``args.lora_rank`` and ``optimizer.state_steps`` since issue 42's ``--recipe own``: peer_step's
    Namespace and optimizer must carry each (they did not: its flow_grpo step failed at train)."""
    import ast
    import inspect

    import torch

    from bench import peer_learning, peer_step

    tree = ast.parse(
        inspect.getsource(peer_learning.train_rollout) + inspect.getsource(peer_learning._autocast)
    )
    reads = {
        base: {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == base
        }
        for base in ("args", "optimizer")
    }
    assert {"beta", "lora_rank", "micro_batch"} <= reads["args"] and "state_steps" in reads["optimizer"]
    args = peer_step._train_args(peer_step.parse(PEER))
    assert all(hasattr(args, name) for name in reads["args"]), reads["args"] - set(vars(args))
    assert args.beta == 0.0 and int(args.num_steps * args.timestep_fraction) == 3  # --train-steps 3
    optimizer = peer_step.make_optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert all(hasattr(optimizer, name) for name in reads["optimizer"] if not name.startswith("_"))
