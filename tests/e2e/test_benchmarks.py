"""The issue-16 benchmark scripts, each run once at its tiny CPU case, their outputs checked.

- ``bench/memory_rehearsal.py --case tiny``: rank 0 of a fake world of 4 (dp2 x sp2) goes through
  the trainer's whole path (a checkpoint and an export are written); every phase is probed; the
  dry run's estimate is the dry run's, and the ratio is measured / estimate.
- ``bench/sp_timing.py`` at ulysses 2 x ring 2 (fake world of 4), no activation checkpointing:
  the Ulysses all-to-all bytes per layer equal 8 B s H D x 4 (q, k, v, out; forward and
  backward), FSDP's reduce-scatter takes every parameter's padded gradient once and its
  all-gather every sharded parameter twice (forward, backward re-gather), the SP boundary
  gathers proj_out's output once; the ring moves bytes over a group of 2.
- ``bench/step_bench.py`` (tiny, jpeg, 2 rollouts): per-phase rows, FLOPs from the formula,
  MFU = TFLOP/s / 782.
- ``bench/real_configs.py``: the real-size folders have the published sizes (dry run on meta).

No timings are asserted. Slow on a loaded 2-core machine (each script is its own process).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}


def _run(*args: str) -> None:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("rehearsal")
    _run("bench/memory_rehearsal.py", "--out", str(out), "--case", "tiny")
    return out, json.loads((out / "tiny.json").read_text())


@pytest.fixture(scope="module")
def sp_timing(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sp")
    args = ["--model", "tiny", "--shape", "5", "64", "64", "--layouts", "4u2", "--checkpointing", "none"]
    _run("bench/sp_timing.py", "--out", str(out), *args, "--warmup", "0", "--iters", "1")
    rows = json.loads((out / "sp_timing.json").read_text())
    assert (out / "sp_timing.md").is_file()
    return rows[0]


@pytest.fixture(scope="module")
def step_bench(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("step")
    args = ["--model", "tiny", "--shape", "5", "64", "64", "--num-steps", "2", "--sde-window", "1"]
    _run(
        "bench/step_bench.py",
        "--out",
        str(out),
        *args,
        "--rollouts",
        "2",
        "--budget-gib",
        "1",
        "--rewards",
        "jpeg",
    )
    assert (out / "step_bench.md").is_file()
    return json.loads((out / "jpeg.json").read_text())


def test_rehearsal_runs_the_trainers_whole_path(rehearsal):
    out, r = rehearsal
    from bench.memory_rehearsal import PHASES

    assert {p["phase"] for p in r["phases"]} == set(PHASES)
    for p in r["phases"]:
        assert (
            p["wall_s"] >= 0 and p["host_rss_gib"] > 0 and p["host_rss_peak_gib"] >= p["host_rss_gib"] * 0.99
        )
    assert (r["world_size"], r["dp"], r["sp"], r["ulysses"], r["ring"]) == (4, 2, 2, 2, 1)
    # two rollouts of one step each: the second's peaks hold the AdamW moments the first allocates
    assert r["optimizer_steps"] == 2 and r["rollouts"] == 2
    assert [p["phase"] for p in r["phases"]].count("train") == 2
    run = out / "work" / "runs" / "tiny"
    assert (run / "checkpoints" / "step_000002").is_dir()
    assert (run / "export" / "pipeline" / "model_index.json").is_file()
    assert (out / "tiny.md").read_text().count("|") > 20


def test_rehearsal_compares_with_the_dry_run(rehearsal):
    out, r = rehearsal
    from bench.memory_rehearsal import CASES, build_config
    from miles.train.dry_run import dry_run

    cfg = build_config(CASES["tiny"], out / "work" / "models" / "tiny", out / "work", "tiny")
    assert cfg.model.init == "random" and cfg.train.num_rollouts == 2 and cfg.grpo.kl_beta > 0
    mem = dry_run(cfg, world_size=4, local_world_size=4, device_type="cpu", verbose=False)["memory_gib"]
    assert mem == r["dry_run_memory_gib"]  # the same config's dry run
    rows = {c["phase"]: c for c in r["comparison"]}
    assert rows["rollout + decode"]["estimate_gib"] == mem["rollout_peak"]
    assert rows["train"]["estimate_gib"] == mem["train_peak"]
    assert rows["whole run"]["estimate_gib"] == max(mem["rollout_peak"], mem["train_peak"])
    assert all(c["measured_gib"] is None and c["ratio"] is None for c in r["comparison"])  # no GPU here


def test_compare_ratio_is_measured_over_estimate():
    from bench.memory_rehearsal import compare

    phases = [
        {"phase": "rollout", "gpu_peak_allocated_gib": 30.0},
        {"phase": "decode+reward", "gpu_peak_allocated_gib": 35.0},  # the dry run's rollout peak covers it
        {"phase": "rollout", "gpu_peak_allocated_gib": 33.0},
        {"phase": "train", "gpu_peak_allocated_gib": 60.0},
        {"phase": "train", "gpu_peak_allocated_gib": 66.0},
        {"phase": "export", "gpu_peak_allocated_gib": 70.0},
    ]
    rows = {c["phase"]: c for c in compare(phases, {"rollout_peak": 40.0, "train_peak": 60.0})}
    assert (
        rows["rollout + decode"]["measured_gib"] == 35.0 and rows["rollout + decode"]["ratio"] == 35.0 / 40.0
    )
    assert rows["train"]["measured_gib"] == 66.0 and rows["train"]["ratio"] == 66.0 / 60.0
    assert rows["whole run"]["measured_gib"] == 70.0 and rows["whole run"]["ratio"] == 70.0 / 60.0


def test_sde_window_fits_a_shortened_rollout():
    from bench.memory_rehearsal import sde_window_fields
    from miles.rollout.sampler import sde_step_indices

    for n, size, lo, hi in [(10, 4, 0, 20), (40, 4, 0, 20), (2, 2, 0, 10), (10, 2, 0, 5)]:
        f = sde_window_fields(n, size, lo, hi)
        w, rng = f["rollout.sde_window_size"], tuple(f["rollout.sde_window_range"])
        assert sde_step_indices(n, sde_window_size=w, sde_window_start_range=rng)  # accepted
    assert sde_window_fields(40, 4, 0, 20) == {
        "rollout.sde_window_size": 4,
        "rollout.sde_window_range": [0, 20],
    }


def _padded(numel_dim0: int, rest: int, world: int) -> tuple[int, int]:
    shard = math.ceil(numel_dim0 / world)
    return shard * rest, shard * world * rest


def test_sp_collective_bytes_match_the_formulas(sp_timing):
    import torch
    from diffusers import WanTransformer3DModel

    from bench.real_configs import model_spec

    r = sp_timing
    config = model_spec("tiny")["transformer"]
    B, H, D, L = r["batch"], config["num_attention_heads"], config["attention_head_dim"], r["num_layers"]
    s, world, fp32 = r["tokens_per_rank"], r["sp"], 4
    rows = {(c["category"], c["kind"]): c for c in r["collectives"]}
    assert (r["ulysses"], r["ring"]) == (2, 2)
    # one rank's share of the model FLOPs (forward + backward) and the rate it implies
    from bench.gpu_bench import model_flops

    flops = 3 * B * model_flops(config, r["tokens"]) / world
    assert r["model_tflops_per_rank"] == pytest.approx(flops / 1e12, rel=1e-12)
    assert r["tflops_per_s"] == pytest.approx(flops / (r["step_ms"] / 1e3) / 1e12, rel=1e-12)
    ulysses = rows[("ulysses", "all_to_all")]
    assert ulysses["buffer_bytes_per_layer"] == 8 * B * s * H * D * fp32
    assert ulysses["wire_bytes_per_layer"] == ulysses["buffer_bytes_per_layer"] / 2  # (u - 1) / u, u = 2
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    sharded = padded = 0
    for p in model.parameters():
        a, b = _padded(p.shape[0], p[0].numel() if p.dim() > 1 else 1, world)
        sharded, padded = sharded + a, padded + b
    assert rows[("fsdp", "reduce_scatter")]["buffer_bytes"] == padded * fp32
    assert rows[("fsdp", "all_gather")]["buffer_bytes"] == 2 * sharded * fp32
    out_dim = config["out_channels"] * math.prod(config["patch_size"])
    assert rows[("sp_boundary", "all_gather")]["buffer_bytes"] == B * s * out_dim * fp32
    ring = [c for c in r["collectives"] if c["category"] == "ring"]
    assert ring and all(c["group_size"] == 2 and c["buffer_bytes"] > 0 for c in ring)
    assert r["step_ms"] > 0 and len(r["step_ms_all"]) == 1 and L == 2
    assert r["grads_vs_eager"] == {"max_rel_diff": 0.0, "param": None, "missing": []}  # eager both


def test_sp_timing_checks_the_compiled_step_against_eager(tmp_path):
    """The timed step (compiled blocks, selective checkpointing, Ulysses 4) computes the gradients
    the uncompiled copy does; the table flags a step whose gradients differ."""
    from bench.sp_timing import compare_grads, markdown

    args = ["--model", "tiny", "--shape", "5", "64", "64", "--layouts", "4", "--checkpointing", "selective"]
    _run(
        "bench/sp_timing.py",
        "--out",
        str(tmp_path),
        *args,
        "--compile",
        "on",
        "--warmup",
        "0",
        "--iters",
        "1",
    )
    row = json.loads((tmp_path / "sp_timing.json").read_text())[0]
    assert row["compiled"] and (row["ulysses"], row["ring"]) == (4, 1)
    check = row["grads_vs_eager"]
    assert check["missing"] == [] and check["max_rel_diff"] <= 1e-4, check
    assert "(!)" not in markdown([row])
    ref = {"a": 1.0, "b": 2.0}
    assert compare_grads(ref, {"a": 1.0, "b": 2.0})["max_rel_diff"] == 0.0
    skipped = compare_grads(ref, {"a": 1.0, "b": 0.05})
    assert skipped["param"] == "b" and skipped["max_rel_diff"] == pytest.approx(0.975)
    assert math.isnan(compare_grads(ref, {"a": float("nan"), "b": 2.0})["max_rel_diff"])
    assert "(!)" in markdown([{**row, "grads_vs_eager": skipped}])


def test_step_bench_flops_and_mfu(step_bench):
    from bench.gpu_bench import model_flops
    from bench.real_configs import model_spec

    r = step_bench
    forward = model_flops(model_spec("tiny")["transformer"], r["tokens"], text_tokens=64)
    assert r["flops"]["rollout"] == r["samples"] * r["num_steps"] * 2 * forward  # CFG: 2 forwards a step
    assert r["flops"]["train"] == r["samples"] * r["num_sde_steps"] * 2 * 3 * forward
    # the settings a side by side compares are recorded as trained (recipe values: no flag given)
    assert (r["text_tokens"], r["lora_rank"], r["guidance"], r["micro_batch"]) == (64, 0, 5.0, 1)
    assert r["trainable_params"] > 0 and r["memory_cap_gib"] is None
    s = r["summary"]
    assert s["measured_rollouts"] == 1  # the first of 2 is the warm-up
    assert s["step"]["model_tflop"] == pytest.approx((r["flops"]["rollout"] + r["flops"]["train"]) / 1e12)
    assert s["step"]["wall_s"] == pytest.approx(sum(p["wall_s"] for p in s["phases"].values()))
    assert s["step"]["mfu"] == pytest.approx(s["step"]["tflops"] / 782.0)
    phases = [p["phase"] for p in r["phases"] if p["phase"] != "init"]
    assert phases == ["rollout", "decode+reward", "train"] * 2


def test_step_bench_summary_arithmetic():
    from bench.step_bench import summarize

    row = lambda t: {"wall_s": t, "gpu_peak_allocated_gib": 10.0 * t}  # noqa: E731
    rollouts = [{ph: row(100.0) for ph in ("rollout", "decode+reward", "train")}]
    rollouts.append({"rollout": row(2.0), "decode+reward": row(1.0), "train": row(3.0)})
    s = summarize(rollouts, {"rollout": 4e15, "train": 3e15}, budget_gib=100.0, peak_tflops=1000.0)
    assert s["phases"]["rollout"]["tflops"] == pytest.approx(2000.0)
    assert s["phases"]["train"]["mfu"] == pytest.approx(1.0)
    assert s["step"]["wall_s"] == 6.0 and s["step"]["tflops"] == pytest.approx(7000.0 / 6.0)
    assert s["peak_gib"] == 1000.0 and s["peak_within_budget"] is False


def test_pickscore_sized_clip_has_pickscores_size():
    import torch
    from transformers import CLIPModel

    from bench.step_bench import pickscore_sized_config

    with torch.device("meta"):
        model = CLIPModel(pickscore_sized_config(0, 1))
    vision = sum(p.numel() for p in model.vision_model.parameters())
    assert 0.98e9 < sum(p.numel() for p in model.parameters()) < 0.99e9  # PickScore_v1: 986M
    assert 0.63e9 < vision < 0.64e9  # ViT-H-14's tower: 632M


@pytest.mark.parametrize(
    "name, per_expert, experts, tokens, shape",
    [
        ("wan2.2-t2v-a14b", (14.0e9, 14.5e9), 2, 32760, (81, 480, 832)),
        ("wan2.1-t2v-14b", (14.0e9, 14.5e9), 1, 32760, (81, 480, 832)),
        ("wan2.2-ti2v-5b", (4.8e9, 5.2e9), 1, 18480, (81, 704, 1280)),
        ("wan2.1-t2v-1.3b", (1.3e9, 1.5e9), 1, 32760, (81, 480, 832)),
    ],
)
def test_real_config_folders_have_the_published_sizes(tmp_path, name, per_expert, experts, tokens, shape):
    from bench.memory_rehearsal import set_fields
    from bench.real_configs import write_config_folder
    from miles.config import Config
    from miles.train.dry_run import dry_run

    folder = write_config_folder(name, tmp_path / name)
    fields = {"model.path": str(folder), "model.init": "random", "parallel.sequence_parallel_size": 8}
    fields.update({"rollout.num_frames": shape[0], "rollout.height": shape[1], "rollout.width": shape[2]})
    rep = dry_run(set_fields(Config(), fields), world_size=8, local_world_size=8, verbose=False)
    assert len(rep["params"]["per_expert"]) == experts
    assert all(per_expert[0] < n < per_expert[1] for n in rep["params"]["per_expert"])
    assert 5.6e9 < rep["params"]["text_encoder"] < 5.8e9  # UMT5-XXL's encoder (22.7 GB in fp32)
    assert rep["sequence"]["tokens_per_sample"] == tokens
    assert rep["model"]["expand_timesteps"] == (name == "wan2.2-ti2v-5b")
    assert rep["model"]["boundary_ratio"] == (0.875 if experts == 2 else None)


@pytest.mark.parametrize(
    "name, per_expert, layers",
    [("ltx-video-2b", (1.9e9, 1.95e9), 28), ("ltx-video-13b", (13.0e9, 13.1e9), 48)],
)
def test_ltx_config_folders_have_the_published_sizes_and_the_recipes_schedule(
    tmp_path, name, per_expert, layers
):
    """LTX-Video's config-only folders through the dry run at the recipe's size (161 frames x 512 x
    704: 21 x 16 x 22 = 7,392 tokens): the published transformer sizes, T5-XXL's encoder, the
    family's SP plan, the folder's schedule (LTXPipeline's dynamic shift at 7,392 tokens, as the
    recipes' comments say; the recipes set no rollout.shift)."""
    import yaml

    from bench.memory_rehearsal import set_fields
    from bench.real_configs import write_config_folder
    from miles.config import Config
    from miles.train.dry_run import dry_run

    folder = write_config_folder(name, tmp_path / name)
    fields = {"model.path": str(folder), "model.init": "random", "parallel.sequence_parallel_size": 4}
    fields.update({"rollout.num_frames": 161, "rollout.height": 512, "rollout.width": 704})
    rep = dry_run(set_fields(Config(), fields), world_size=8, local_world_size=8, verbose=False)
    assert rep["model"]["pipeline"] == "LTXPipeline" and rep["model"]["num_layers"] == layers
    assert per_expert[0] < rep["params"]["per_expert"][0] < per_expert[1]
    assert 4.7e9 < rep["params"]["text_encoder"] < 4.8e9  # google/t5-v1_1-xxl's encoder
    assert rep["sequence"]["tokens_per_sample"] == 7392
    assert rep["sp_plan"]["source"].startswith("miles.models.ltx_sp")
    assert "mu 3.2302 (shift e^mu = 25.28), stretched to shift_terminal 0.1" in rep["sequence"]["schedule"]
    assert rep["sequence"]["sigmas"][-2] == pytest.approx(0.1, abs=1e-6)
    for recipe in ("ltx_video_2b", "ltx_video_2b_nft"):
        text = (REPO / "configs" / f"{recipe}.yaml").read_text()
        assert "shift" not in yaml.safe_load(text)["rollout"] and "mu 3.230, shift 25.28" in text


def test_fake_collective_outputs_are_filled_like_the_cpu_fake_group():
    """``bench/fake_rank.py`` fills what a collective that moved nothing left as allocated: every
    gathered chunk is the local input, the scatter's output the input's first chunk, the
    all-to-all's output its input (positional or keyword arguments alike)."""
    import torch

    from bench.fake_rank import _fill_all_to_all, _fill_gather_tensor, _fill_scatter_tensor, _filling

    def nothing(*args, **kwargs):
        return "work"

    x = torch.arange(6.0).reshape(2, 3)
    out = torch.full((8, 3), float("nan"))
    assert _filling(nothing, _fill_gather_tensor)(out, x, group=None, async_op=True) == "work"
    assert torch.equal(out, x.repeat(4, 1))
    buffer = torch.full((4, 3), float("nan"))  # in place, as FSDP gathers: the input is a slice of the output
    buffer[1] = torch.tensor([1.0, 2.0, 3.0])
    _filling(nothing, _fill_gather_tensor)(buffer, buffer[1])
    assert torch.equal(buffer, torch.tensor([1.0, 2.0, 3.0]).repeat(4, 1))
    big = torch.arange(12.0)
    out = torch.full((3,), float("nan"))
    _filling(nothing, _fill_scatter_tensor)(output=out, input=big)
    assert torch.equal(out, big[:3])
    out = torch.full((3, 2), float("nan"))
    _filling(nothing, _fill_all_to_all)(out, x.t())  # a non-contiguous input of the same size
    assert torch.equal(out, x.t().reshape(3, 2))


def test_fake_ring_exchanges_are_filled_in_the_templates_module():
    """The ring templates exchange K/V through torch's functional collectives (``ft_c``): under
    ``fake_collective_fixes`` their all-gather returns the local buffer in every chunk and their
    permute returns its input, whatever the collective left (NaN here, as memory left allocated);
    the module gets its own ``ft_c`` back afterwards."""
    from types import SimpleNamespace

    import torch

    from bench.fake_rank import _FilledFunctionals, fake_collective_fixes
    from miles.sequence_parallel import ring

    class Async(torch.Tensor):
        def wait(self):
            return torch.Tensor(self)

    left = SimpleNamespace(
        AsyncCollectiveTensor=Async,
        all_gather_tensor=lambda t, gather_dim, group: torch.full(
            (2 * t.shape[0], *t.shape[1:]), float("nan")
        ),
        all_gather_single=lambda t, gather_dim, group: torch.full(
            (2 * t.shape[0], *t.shape[1:]), float("nan")
        ),
        permute_tensor=lambda t, dsts, group: torch.full_like(t, float("nan")).as_subclass(Async),
    )
    filled = _FilledFunctionals(left)
    x = torch.arange(6.0).reshape(3, 2)
    for gather in (filled.all_gather_tensor, filled.all_gather_single):
        assert torch.equal(gather(x, gather_dim=0, group=None), torch.cat([x, x]))
    permuted = filled.permute_tensor(x.t(), [1, 0], None)
    assert type(permuted) is torch.Tensor and torch.equal(permuted, x.t())
    assert filled.AsyncCollectiveTensor is Async  # the rest is the module's own

    templates = ring._ring_templates()
    funcol = templates.ft_c
    with fake_collective_fixes():
        assert isinstance(templates.ft_c, _FilledFunctionals)
        assert templates.ft_c._funcol is funcol
    assert templates.ft_c is funcol


def test_fake_collective_fill_compiles_without_a_graph_break():
    """Ulysses calls the all-to-all inside compiled blocks: the fill must trace into one graph
    (a storage-pointer check broke it and recompiled per address, then ran the blocks eagerly)."""
    import torch

    from bench.fake_rank import _fill_all_to_all, _filling

    def nothing(*args, **kwargs):
        return None

    all_to_all = _filling(nothing, _fill_all_to_all)

    def ulysses_like(x):
        out = torch.empty_like(x)
        all_to_all(out, x)
        return out * 2

    torch._dynamo.reset()
    compiled = torch.compile(ulysses_like, fullgraph=True, backend="eager")
    kept = [torch.randn(4, 3) for _ in range(3)]  # alive together: every buffer at a new address
    with torch._dynamo.config.patch(error_on_recompile=True):
        for x in kept:
            assert torch.equal(compiled(x), x * 2)
