"""The dry run: groups from the topology's pure functions, tokens, exact parameter counts, refusals.

The tiny recipe runs through ``train_grpo.py --dry-run`` in a subprocess (the user's command)
and in process; a Wan2.1-T2V-1.3B folder made of configs only (no weights) checks real shapes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.config import ConfigError, parse_args
from miles.parallel.topology import ParallelDims
from miles.parallel.topology_checks import check_ulysses_within_node
from miles.train.dry_run import DryRunError, dry_run

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", "configs/tiny_cpu.yaml"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
for _name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
    ENV.pop(_name, None)

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json
WAN21_1_3B = {
    "_class_name": "WanTransformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}
WAN21_VAE = {  # no scale_factor_* keys, like the published file: diffusers' defaults (4, 8) apply
    "_class_name": "AutoencoderKLWan",
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tiny recipe's model dir is relative to the repository
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        monkeypatch.delenv(name, raising=False)


def _plan(argv: list[str], **kwargs) -> dict:
    cfg, opts = parse_args(argv)
    return dry_run(cfg, world_size=opts.world_size, verbose=False, **kwargs)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train_grpo.py", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_prints_groups_tokens_and_exact_param_count():
    from diffusers import WanTransformer3DModel

    proc = _run_cli(*TINY, "--dry-run", "--world-size", "8", "--sequence-parallel-size", "4")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    dims = ParallelDims(world_size=8, sequence_parallel_size=4, ulysses_degree=0, num_attention_heads=4)
    assert (dims.dp, dims.ulysses, dims.ring) == (2, 4, 1)
    assert "dp 2 x sp 4 (ulysses 4 x ring 1); ulysses auto" in out
    for kind, groups in [
        ("dp", dims.dp_groups()),
        ("sp", dims.sp_groups()),
        ("ulysses", dims.ulysses_groups()),
        ("ring", dims.ring_groups()),
    ]:
        shown = " ".join(str(g) for g in groups[:4]) + (
            f" ... ({len(groups)} groups)" if len(groups) > 4 else ""
        )
        assert f"{kind + ' groups':<15} {shown}\n" in out, kind
    # 5 frames 64x64 -> latent (16, 2, 8, 8) -> (2/1)(8/2)(8/2) = 32 tokens, 8 per sp rank
    assert "latent (16, 2, 8, 8) -> 32 tokens/sample" in out
    assert "8 tokens per sp rank (ceil(S/sp) = ceil(32/4))" in out
    assert "blocks.0   input 'hidden_states'  split dim 1" in out
    assert "proj_out   output 0               gather dim 1" in out

    folder = ROOT / ".cache/tiny-wan/two_expert"
    real = sum(
        p.numel()
        for sub in ("transformer", "transformer_2")
        for p in WanTransformer3DModel.from_pretrained(folder / sub).parameters()
    )
    assert f"= {real:,} (" in out


def test_in_process_report_matches_the_topology_and_the_real_model():
    from diffusers import WanTransformer3DModel

    # bf16, as a GPU run computes (cudnn is the CUDA default for bf16; fp32 gets native SDPA)
    rep = _plan(
        [
            *TINY,
            "--world-size",
            "8",
            "--sequence-parallel-size",
            "4",
            "--ulysses-degree",
            "2",
            "--model.dtype",
            "bfloat16",
        ]
    )
    dims = ParallelDims(world_size=8, sequence_parallel_size=4, ulysses_degree=2)
    mesh = rep["mesh"]
    assert (mesh["dp"], mesh["sp"], mesh["ulysses"], mesh["ring"]) == (2, 4, 2, 2)
    assert not mesh["ulysses_auto"]
    assert mesh["groups"] == {
        "dp": dims.dp_groups(),
        "sp": dims.sp_groups(),
        "ulysses": dims.ulysses_groups(),
        "ring": dims.ring_groups(),
    }
    seq = rep["sequence"]
    assert seq["latent_shape"] == [16, 2, 8, 8]
    assert (seq["tokens_per_sample"], seq["tokens_per_sp_rank"], seq["tokens_per_rank_in_attention"]) == (
        32,
        8,
        16,
    )
    assert seq["text_tokens"] == 64
    assert rep["sp_plan"]["ring_kernel"] == {"cuda": "_native_cudnn", "cpu": "cpu_flash"}
    folder = ROOT / ".cache/tiny-wan/two_expert"
    real = [
        sum(p.numel() for p in WanTransformer3DModel.from_pretrained(folder / sub).parameters())
        for sub in ("transformer", "transformer_2")
    ]
    assert rep["params"]["per_expert"] == real
    assert rep["params"]["trainable"] == sum(real)
    mem = rep["memory_gib"]
    assert mem["params"] == pytest.approx(sum(real) * 4 / 8 / 2**30)  # fp32, sharded over 8
    assert mem["optimizer"] == pytest.approx(2 * mem["params"])


def test_lora_count_matches_peft():
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    rep = _plan([*TINY, "--world-size", "2", "--model.lora-rank", "4"])
    model = WanTransformer3DModel.from_pretrained(ROOT / ".cache/tiny-wan/two_expert/transformer")
    model.requires_grad_(False)
    cfg, _ = parse_args([*TINY, "--model.lora-rank", "4"])
    model.add_adapter(LoraConfig(r=4, lora_alpha=64.0, target_modules=cfg.model.lora_target_modules))
    per_expert = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert rep["params"]["lora_adapters"] == 2 * per_expert  # two experts, same shapes
    assert rep["params"]["trainable"] == 2 * per_expert


def test_bad_layout_fails_with_a_clear_message():
    proc = _run_cli(*TINY, "--dry-run", "--world-size", "6", "--sequence-parallel-size", "4")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "world size 6 is not divisible by --sequence-parallel-size 4" in proc.stderr
    assert "divisors of the world size [1, 2, 3, 6]" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv,env,match",
    [
        (
            ["--world-size", "8", "--sequence-parallel-size", "4", "--ulysses-degree", "3"],
            {},
            "not divisible by",
        ),
        (
            ["--world-size", "8", "--sequence-parallel-size", "8", "--ulysses-degree", "8"],
            {},
            "must divide both",
        ),
        (
            ["--world-size", "8", "--sequence-parallel-size", "4", "--ulysses-degree", "2"]
            + ["--fsdp-attention-backend", "flex"],
            {},
            "has no ring-attention kernel",
        ),
        (["--world-size", "8", "--sequence-parallel-size", "4"], {"LOCAL_WORLD_SIZE": "2"}, "span two nodes"),
    ],
)
def test_refusals_name_the_fix(monkeypatch, argv, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        _plan([*TINY, *argv])
    except (DryRunError, ConfigError) as e:
        assert re.search(match, str(e)), str(e)
    else:
        raise AssertionError(f"{argv} should have been refused")


def test_world_size_from_env_and_node_note(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rep = _plan([*TINY, "--sequence-parallel-size", "4", "--ulysses-degree", "2"])
    assert (rep["world_size"], rep["world_size_source"], rep["local_world_size"]) == (4, "$WORLD_SIZE", 2)
    assert "Ulysses groups stay inside a node; ring groups cross nodes" in rep["mesh"]["node_note"]


def test_check_ulysses_within_node():
    dims = ParallelDims(world_size=16, sequence_parallel_size=16, ulysses_degree=16, num_attention_heads=16)
    check_ulysses_within_node(dims, None)  # unknown: no check
    check_ulysses_within_node(dims, 16)  # one node
    with pytest.raises(ValueError, match=r"Choose --ulysses-degree among \[1, 2, 4, 8\]"):
        check_ulysses_within_node(dims, 8)
    check_ulysses_within_node(ParallelDims(world_size=16, sequence_parallel_size=16, ulysses_degree=8), 8)


def _wan21_folder(root: Path) -> Path:
    folder = root / "Wan2.1-T2V-1.3B-Diffusers"
    (folder / "transformer").mkdir(parents=True)
    (folder / "vae").mkdir()
    (folder / "transformer/config.json").write_text(json.dumps(WAN21_1_3B))
    (folder / "vae/config.json").write_text(json.dumps(WAN21_VAE))
    index = {
        "_class_name": "WanPipeline",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_real_wan21_shape_from_configs_only(tmp_path):
    folder = _wan21_folder(tmp_path)
    argv = [
        *TINY,
        "--model.path",
        str(folder),
        "--model.dtype",
        "bfloat16",
        "--model.activation-checkpointing",
        "full",
        "--data.max-sequence-length",
        "512",
        "--rollout.num-frames",
        "81",
        "--rollout.height",
        "480",
        "--rollout.width",
        "832",
        "--world-size",
        "8",
        "--sequence-parallel-size",
        "8",
        "--ulysses-degree",
        "0",
    ]
    rep = _plan(argv)
    assert 1.2e9 <= rep["params"]["transformer"] <= 1.5e9
    assert rep["params"]["per_expert"] == [rep["params"]["transformer"]]
    with torch.device("meta"):
        from diffusers import WanTransformer3DModel

        meta = WanTransformer3DModel(**{k: v for k, v in WAN21_1_3B.items() if not k.startswith("_")})
    assert rep["params"]["transformer"] == sum(p.numel() for p in meta.parameters())
    seq = rep["sequence"]
    assert seq["latent_shape"] == [16, 21, 60, 104]
    assert seq["tokens_per_sample"] == 21 * 60 * 104 // 4 == 32760
    assert seq["tokens_per_sp_rank"] == 32760 // 8
    assert seq["text_tokens"] == 512
    mesh = rep["mesh"]
    # auto: the largest divisor of sp 8 that divides 12 heads
    assert mesh["ulysses_auto"] and (mesh["ulysses"], mesh["ring"]) == (4, 2)
    mem = rep["memory_gib"]
    # fp32 master weights whatever model.dtype (the trainer loads them so; FSDP2 casts for compute)
    assert mem["params"] == pytest.approx(rep["params"]["transformer"] * 4 / 8 / 2**30)
    assert 0 < mem["activations"] < mem["train_peak"] < 141  # fits an H200 per the estimate
    assert any("will refuse" in w for w in rep["warnings"])  # no text_encoder/tokenizer folders

    # Less checkpointing, more activations; a budget lands in between and within it.
    acts = {}
    for mode in ("none", "selective", "full", "budget"):
        rep_mode = _plan(
            [*argv, "--model.activation-checkpointing", mode, "--model.activation-memory-budget-gib", "30"]
        )
        acts[mode] = rep_mode["memory_gib"]["activations"]
    assert acts["none"] > acts["selective"] > acts["full"]
    # Compiled blocks (auto: on for the CUDA target) keep less without checkpointing than eager ones.
    eager = _plan([*argv, "--model.activation-checkpointing", "none", "--model.compile", "off"])["memory_gib"]
    D, F = 1536, 8960
    assert acts["none"] / eager["activations"] == pytest.approx((36 * D + 4 * F) / (70 * D + 4 * F))
    assert acts["full"] < acts["budget"] <= 30 + acts["none"] / 30  # + one block recomputing
    # The budget is the per-rank total: one the rollout alone cannot meet is refused, as the trainer would.
    with pytest.raises(DryRunError, match="memory budget .estimated.: the rollout alone needs"):
        _plan(
            [
                *argv,
                "--model.activation-checkpointing",
                "budget",
                "--model.activation-memory-budget-gib",
                "0.01",
            ]
        )
    # 16 ranks of sp 16: 32,760 tokens do not split 16 ways: padded to 16 x 2,048 (8 pad tokens).
    plan16 = _plan(
        [*argv[:-6], "--world-size", "16", "--sequence-parallel-size", "16", "--ulysses-degree", "4"]
    )
    assert plan16["sequence"]["tokens_per_sp_rank"] == 2048 and plan16["sequence"]["pad_tokens"] == 8


# ---------------------------------------------------------------------------------------------
# The dry run refuses every input the real run refuses (through the entry point, in process).


def _dry_input_case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(flags, the key part of the message) of one bad input."""
    if case == "non_utf8_prompt_file":
        prompts = tmp_path / "p.txt"
        prompts.write_bytes(b"a cat\n\xff dog\n")
        return ["--data.prompt-file", str(prompts)], f"{prompts}:2: not UTF-8 text"
    if case == "missing_eval_prompt_file":
        return [
            "--eval.prompt-file",
            str(tmp_path / "none.txt"),
        ], f"prompt file not found: {tmp_path}/none.txt"
    if case == "fewer_prompts_than_a_rollout":  # 16 built-in prompts; dp 8 x 4 = 32
        return ["--data.prompts-per-rank", "4"], "16 prompts are fewer than one rollout needs (dp size 8"
    if case == "unknown_reward":
        return ["--reward.weights.sharpnes", "1"], "reward.weights names an unknown reward 'sharpnes'"
    if case == "reward_without_its_model":
        return ["--reward.weights.pickscore", "1"], "set reward.pickscore.model_path to a local folder"
    if case == "gold_reward_without_its_weights":
        flags = ["--reward.gold", "hpsv2", "--reward.hpsv2.processor-path", str(tmp_path)]
        return flags, "set reward.hpsv2.model_path to a local file or folder: download HPS_v2.1_compressed.pt"
    if case == "normalize_an_untrained_reward":
        return ["--reward.normalize", "sharpness", "group"], "reward.normalize names 'sharpness'"
    if case == "image_reward_for_text_model":
        return ["--reward.weights.world_i2v", "1"], "given first frame, but the model is text-to-video"
    if case == "run_output_dir_is_a_file":
        (tmp_path / "f").write_text("")
        return ["--run.output-dir", str(tmp_path / "f")], f"{tmp_path}/f is a file, so the run directory"
    if case == "no_resume_into_a_previous_run":
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
        flags = ["--run.output-dir", str(tmp_path), "--run.name", "run", "--train.no-resume"]
        return flags, "holds a previous run (metrics.jsonl with 1 rows)"
    if case == "clip_range_0":
        return ["--grpo.clip-range", "0"], "grpo.clip_range must be > 0"
    if case == "resume_with_another_seed":
        from tests.unit.test_bad_input import _plant_checkpoint

        _plant_checkpoint(tmp_path / "run", [("run.seed", 5)])
        flags = ["--run.output-dir", str(tmp_path), "--run.name", "run"]
        return flags, "run.seed (the prompt order and the rollout noise): the checkpoint has 5, this launch 0"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "non_utf8_prompt_file",
        "missing_eval_prompt_file",
        "fewer_prompts_than_a_rollout",
        "unknown_reward",
        "reward_without_its_model",
        "gold_reward_without_its_weights",
        "normalize_an_untrained_reward",
        "image_reward_for_text_model",
        "run_output_dir_is_a_file",
        "no_resume_into_a_previous_run",
        "clip_range_0",
        "resume_with_another_seed",
    ],
)
def test_dry_run_refuses_what_the_real_run_refuses(tmp_path, capsys, case):
    import train_grpo

    flags, message = _dry_input_case(tmp_path, case)
    try:
        code = train_grpo.main([*TINY, "--dry-run", "--world-size", "8", *flags])
    except SystemExit as e:  # tyro exits by itself on a config that fails validation
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert "miles dry run" not in captured.out  # refused before the plan is printed


def test_dry_run_reports_prompts_and_warnings(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"\xef\xbb\xbfa red ball\n" + b"a very long prompt about a ball\n" * 3)
    rep = _plan(
        [*TINY, "--data.prompt-file", str(prompts), "--train.learning-rate", "0"]
        + ["--data.max-sequence-length", "12"]
    )  # the tiny tokenizer: ~1 token a character
    assert (
        rep["inputs"] == f"4 prompts from {prompts}; rewards jpeg_incompressibility 1; run dir runs/tiny_cpu"
    )
    assert "learning rate 0: the weights will not change (train.learning_rate)" in rep["warnings"]
    assert any(
        w.startswith(f"3 of 4 prompts in {prompts} are longer than data.max_sequence_length = 12")
        for w in rep["warnings"]
    ), rep["warnings"]
    assert not any("longer than" in w for w in _plan(TINY)["warnings"])


def test_hsdp_divides_the_sharded_state_by_the_shard_group():
    plain = _plan([*TINY, "--world-size", "8", "--sequence-parallel-size", "2"])
    hsdp = _plan(
        [*TINY, "--world-size", "8", "--sequence-parallel-size", "2", "--parallel.replicate-size", "2"]
    )
    assert (hsdp["mesh"]["replicate"], hsdp["mesh"]["shard"]) == (2, 4)
    assert hsdp["mesh"]["shard_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hsdp["mesh"]["dp"] == plain["mesh"]["dp"] == 4  # data parallelism is unchanged
    n = plain["params"]["transformer"]
    assert plain["memory_gib"]["params"] == pytest.approx(4 * n / 8 / 2**30)
    for key in ("params", "grads", "optimizer"):
        assert hsdp["memory_gib"][key] == pytest.approx(2 * plain["memory_gib"][key]), key
    for key in ("gathered_in_flight", "rollout_unsharded", "decode", "vae"):
        assert hsdp["memory_gib"][key] == pytest.approx(plain["memory_gib"][key]), key
    with pytest.raises(DryRunError, match="do not hold whole sequence-parallel groups"):
        _plan([*TINY, "--world-size", "8", "--sequence-parallel-size", "4", "--parallel.replicate-size", "4"])


def test_per_token_timesteps_term_is_what_a_block_saves():
    """The dry run's per-token-timestep term (Wan2.2 TI2V) against the storages autograd saves in
    a real Wan block fed one timestep per sample and then one per token, the modulation input in
    bf16 as the model passes it: eager blocks keep 32·D bytes a token more, compiled ones (Inductor
    recomputes the fp32 products in backward) nothing more."""
    from diffusers import WanTransformer3DModel

    from miles.train.dry_run import _block_bytes_per_token

    torch.manual_seed(0)
    D, F, B, T = 256, 768, 2, 256
    model = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=128, ffn_dim=F, num_layers=1)
    block = model.blocks[0].to(torch.bfloat16).train()
    x = torch.randn(B, T, D, dtype=torch.bfloat16, requires_grad=True)
    context, rope = torch.randn(B, 512, D, dtype=torch.bfloat16), torch.randn(1, T, 1, 128)

    def saved(run, temb):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(x, context, temb, (rope, rope))
        for given in (x, context, temb, rope):
            storages.pop(given.untyped_storage().data_ptr(), None)
        return sum(storages.values())

    eager_term = 32 * D
    for compiled, run in ((False, block), (True, torch.compile(block))):
        per_token, per_sample = (torch.randn(B, *s, D, dtype=torch.bfloat16) for s in ((T, 6), (6,)))
        measured = (saved(run, per_token) - saved(run, per_sample)) / (B * T)
        formula = [_block_bytes_per_token(D, F, 2, compiled, p)["none"] for p in (False, True)]
        term = formula[1] - formula[0]
        assert term == (0 if compiled else eager_term), (compiled, term)
        assert abs(measured - term) <= 0.05 * eager_term, (compiled, measured / D, term / D)


def test_the_trainer_runs_the_plan_the_dry_run_prints(tmp_path):
    """One plan (``miles.train.plan``): the dry run prints ``format_report(plan)`` and warns about a
    folder of configs only, which the real run's strict plan (what ``Trainer`` calls) refuses."""
    from miles.train.dry_run import format_report
    from miles.train.plan import PlanError, plan_run

    folder = _wan21_folder(tmp_path)
    cfg, _ = parse_args(
        [*TINY, "--model.path", str(folder), "--run.output-dir", str(tmp_path / "runs")]
        + ["--sequence-parallel-size", "2"]
    )
    plan = plan_run(cfg, 4, device_type="cpu")
    report = dry_run(cfg, 4, device_type="cpu", verbose=False)
    assert format_report(plan) == format_report(report)
    assert (plan.dims.dp, plan.dims.sp, plan.dims.ulysses) == (2, 2, 2)
    assert any("the real run will refuse this folder" in w for w in report["warnings"])
    with pytest.raises(PlanError, match="lacks the 'text_encoder' folder"):
        plan_run(cfg, 4, device_type="cpu", strict=True)


def test_attention_backend_follows_the_compute_dtype():
    """On CUDA the default backend is cudnn SDPA for bf16 and diffusers' native SDPA for fp32 (cudnn
    has no fp32 kernel: the world recipe in fp32 on the H200 failed inside torch.compile with "No
    available kernel"); an explicit half-only backend with fp32 is refused at plan time, naming the fix."""
    from miles.train.plan import PlanError, plan_run

    base = ["--config", "configs/world_cpu.yaml"]
    fp32 = plan_run(parse_args([*base, "--model.dtype", "float32"])[0], 1, device_type="cuda")
    bf16 = plan_run(parse_args([*base, "--model.dtype", "bfloat16"])[0], 1, device_type="cuda")
    cpu = plan_run(parse_args([*base, "--model.dtype", "bfloat16"])[0], 1, device_type="cpu")
    assert (fp32.attention_backend, bf16.attention_backend, cpu.attention_backend) == (
        None,
        "_native_cudnn",
        None,
    )
    cfg = parse_args([*base, "--model.dtype", "float32", "--fsdp-attention-backend", "_native_cudnn"])[0]
    with pytest.raises(PlanError, match="no float32 kernel.*model.dtype bfloat16"):
        plan_run(cfg, 1, device_type="cuda")
    assert plan_run(cfg, 1, device_type="cpu").attention_backend == "_native_cudnn"  # the check is CUDA's
    # --deterministic-mode: torch's strict mode excludes cudnn attention (a cudnn-only call raises; the
    # world's deterministic variant failed to start on the H200): flash by default, explicit cudnn refused
    det = [*base, "--model.dtype", "bfloat16", "--deterministic-mode"]
    assert plan_run(parse_args(det)[0], 1, device_type="cuda").attention_backend == "_native_flash"
    with pytest.raises(PlanError, match="deterministic mode excludes cudnn attention"):
        plan_run(parse_args([*det, "--fsdp-attention-backend", "_native_cudnn"])[0], 1, device_type="cuda")
    # ring > 1 in fp32 on CUDA: no kernel (flash and cudnn are half-only); warned where no GPU is visible
    ring = [*base, "--model.dtype", "float32", "--sequence-parallel-size", "2", "--ulysses-degree", "1"]
    plan = plan_run(parse_args(ring)[0], 2, device_type="cuda")
    assert any(
        "ring attention (ring degree 2) on CUDA has bf16/fp16 kernels only" in w for w in plan.warnings
    )
    assert not any(
        "ring attention" in w for w in plan_run(parse_args(ring)[0], 2, device_type="cpu").warnings
    )
