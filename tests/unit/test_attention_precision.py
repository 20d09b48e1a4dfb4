"""``rollout.attention_precision`` on CPU: the float reference of the INT8 kernel, the switch of the
rollout's self-attention (and back to bf16 for training), the correction it turns on, and every
refusal, the same in the dry run and the real run. The kernel itself: ``tests/gpu/test_attention_precision_gpu.py``.

The kernel is stood in for by :func:`sage_int8_reference` (or a spy around it): on CPU the tests
check the plumbing, not a speed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from miles.config import AlgorithmConfig, Config, ConfigError, GRPOConfig, RolloutConfig, TrainConfig
from miles.rollout import attention as lowp
from miles.rollout.attention import (
    KERNELS,
    check_attention_precision,
    rollout_attention,
    sage_int8_reference,
    self_attention_processors,
)
from tests.models import TINY_WAN

BACKEND = AttentionBackendName(KERNELS["sage_int8"].diffusers_backend)
OK = dict(model_dtype="bfloat16", ring=1, deterministic=False, head_dim=128, package_found=True)


def _qkv(b=1, s=300, h=2, d=128, seed=0, k_offset=0.0):
    """Random Q, K, V; ``k_offset`` added to K's first 4 channels in every token: the outlier
    channels that SageAttention's smoothing removes."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    offset = torch.zeros(d)
    offset[:4] = k_offset
    return q, k + offset, v


def _exact(q, k, v):
    """float64 SDPA in diffusers' (B, S, H, D) layout."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# The float reference


def test_int8_round_trip_is_per_block_and_rounds_half_away_from_zero():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 150, 3, 8, generator=g)
    out = lowp._quantize_int8_blocks(x, 64)
    for b in range(2):
        for h in range(3):
            for start in range(0, 150, 64):  # written out block by block in float64
                blk = x[b, start : start + 64, h].double()
                scale = blk.abs().max() / 127
                levels = blk / scale
                expect = torch.trunc(levels + 0.5 * torch.sign(levels)) * scale
                torch.testing.assert_close(
                    out[b, start : start + 64, h].double(), expect, rtol=1e-6, atol=1e-7
                )
                assert (out[b, start : start + 64, h].double() / scale).round().abs().max() == 127


def test_reference_without_int8_is_exact_attention():
    """K's smoothing leaves softmax unchanged (q·mean(k) is one constant per row); what is left is
    P and V in fp16, far below INT8's error."""
    q, k, v = _qkv(k_offset=20.0)
    ref = sage_int8_reference(q, k, v, quantize=False)
    torch.testing.assert_close(ref.double(), _exact(q, k, v), rtol=0, atol=2e-3)


def test_reference_int8_error_is_small_and_smoothing_keeps_it_small_under_a_key_offset():
    q, k, v = _qkv(k_offset=0.0)
    exact = _exact(q, k, v)
    err = (sage_int8_reference(q, k, v).double() - exact).abs().mean() / exact.abs().mean()
    assert 1e-4 < err < 3e-2  # it does quantize, and stays within a few percent
    # a common offset on every key's first channels (SageAttention's outliers): the same error
    q, k_off, v = _qkv(k_offset=20.0)
    exact_off = _exact(q, k_off, v)
    err_off = (sage_int8_reference(q, k_off, v).double() - exact_off).abs().mean() / exact_off.abs().mean()
    assert err_off < 1.5 * err
    # without the smoothing the offset would take the INT8 range: the same quantization, unsmoothed
    scale = 128**-0.5 * math.log2(math.e)
    qf = lowp._quantize_int8_blocks(q * scale, 128)
    kf = lowp._quantize_int8_blocks(k_off, 64)
    p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", qf, kf) * math.log(2), dim=-1)
    raw = torch.einsum("bhqk,bkhd->bqhd", p, v).double()
    assert (raw - exact_off).abs().mean() / exact_off.abs().mean() > 2 * err_off


# ---------------------------------------------------------------------------------------------
# The switch: the rollout's self-attention only, restored for training


def _tiny(seed=0):
    torch.manual_seed(seed)
    return WanTransformer3DModel(**TINY_WAN).eval()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, 4, 3, 8, 8, generator=g),
        torch.tensor([500.0]),
        torch.randn(1, 7, TINY_WAN["text_dim"], generator=g),
    )


def _spy(calls):
    def kernel(q, k, v, scale):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return sage_int8_reference(q, k, v, scale)

    return kernel


def test_the_rollout_self_attention_switches_and_training_gets_bf16_back():
    model = _tiny()
    x, t, ctx = _inputs()
    calls = []
    with torch.no_grad():
        ref = model(x, t, ctx, return_dict=False)[0]
        with rollout_attention([model], "sage_int8", kernel=_spy(calls)):
            assert all(p._attention_backend == BACKEND for p in self_attention_processors(model))
            assert all(b.attn2.processor._attention_backend is None for b in model.blocks)  # cross stays
            low = model(x, t, ctx, return_dict=False)[0]
        after = model(x, t, ctx, return_dict=False)[0]
    tokens = 3 * 4 * 4
    # one call per block, self-attention only (keys = the video's tokens, never the 7 text tokens)
    assert calls == [((1, tokens, 4, 16), (1, tokens, 4, 16))] * TINY_WAN["num_layers"]
    assert not torch.equal(low, ref)
    assert (low - ref).abs().max() < 0.05 * ref.abs().max()
    assert torch.equal(after, ref)
    assert all("_attention_backend" not in vars(p) for p in self_attention_processors(model))
    # registered once per process (a compiled block sees the same function every rollout), and it
    # runs nothing outside the rollout's context
    entry = _AttentionBackendRegistry._backends[BACKEND]
    with rollout_attention([model], "sage_int8", kernel=sage_int8_reference):
        assert _AttentionBackendRegistry._backends[BACKEND] is entry
    q, k, v = _qkv(s=8, d=16)
    with pytest.raises(RuntimeError, match="outside rollout_attention"):
        entry(query=q, key=k, value=v)


def test_the_switch_is_undone_on_error_and_bf16_changes_nothing():
    model = _tiny()
    with pytest.raises(RuntimeError, match="boom"):
        with rollout_attention([model], "sage_int8", kernel=sage_int8_reference):
            raise RuntimeError("boom")
    assert all("_attention_backend" not in vars(p) for p in self_attention_processors(model))
    with rollout_attention([model], "bf16"):
        assert all("_attention_backend" not in vars(p) for p in self_attention_processors(model))
    with pytest.raises(ValueError, match="must be one of"):
        with rollout_attention([model], "int4"):
            pass


def test_compiled_blocks_compile_once_for_the_rollout_and_once_for_training():
    """The backend function is registered once and is a graph break: after the first rollout and
    training forward, further ones compile nothing new (no guard on the registry or the kernel)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _tiny()
    for block in model.blocks:
        block.compile(backend="eager")  # dynamo's guards and graphs, no inductor
    x, t, ctx = _inputs()
    graphs, outs = [], []
    with torch.no_grad():
        for _ in range(3):
            with rollout_attention([model], "sage_int8", kernel=sage_int8_reference):
                low = model(x, t, ctx, return_dict=False)[0]
            outs.append((low, model(x, t, ctx, return_dict=False)[0]))
            graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[0] > 0 and graphs[1] == graphs[2] == graphs[0]
    assert torch.equal(outs[0][0], outs[2][0]) and torch.equal(outs[0][1], outs[2][1])
    assert not torch.equal(outs[0][0], outs[0][1])
    with torch.no_grad():
        assert torch.equal(outs[0][1], _tiny()(x, t, ctx, return_dict=False)[0])  # training: eager bf16's


def test_under_usp_ring_1_the_backend_reaches_the_local_attention():
    """USP installed (one process: ulysses and ring of size 1): the marked self-attention goes through
    ``usp_attention``, whose local attention is diffusers' dispatch with the processor's ``backend=``:
    the same kernel, the same numbers as without USP."""
    from miles.sequence_parallel.attention import apply_dispatch_sp_attention

    model = _tiny()
    x, t, ctx = _inputs()
    plain_calls, usp_calls = [], []
    with torch.no_grad():
        with rollout_attention([model], "sage_int8", kernel=_spy(plain_calls)):
            plain = model(x, t, ctx, return_dict=False)[0]
        remove = apply_dispatch_sp_attention(model, None, None)
        try:
            with rollout_attention([model], "sage_int8", kernel=_spy(usp_calls)):
                usp = model(x, t, ctx, return_dict=False)[0]
        finally:
            remove()
    assert usp_calls == plain_calls and len(usp_calls) == TINY_WAN["num_layers"]
    assert torch.equal(usp, plain)


def test_a_family_without_self_attention_modules_is_refused():
    block = torch.nn.Module()
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([block])
    with pytest.raises(ValueError, match="no self-attention module named attn1"):
        with rollout_attention([model], "sage_int8", kernel=sage_int8_reference):
            pass


def test_a_masked_or_causal_call_is_refused_by_the_backend():
    fn = lowp._backend_function("sage_int8")
    q, k, v = _qkv(s=8, d=16)
    with rollout_attention([_tiny()], "sage_int8", kernel=sage_int8_reference):
        torch.testing.assert_close(fn(q, k, v), sage_int8_reference(q, k, v))
    with pytest.raises(ValueError, match="without a mask"):
        fn(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match="without a mask"):
        fn(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# The correction: the same path as rollout.precision fp8


def test_low_precision_attention_turns_the_correction_on():
    from miles.algorithms import build_algorithm

    assert build_algorithm(Config()).correction is None
    cfg = Config(rollout=RolloutConfig(attention_precision="sage_int8", tis_cap=3.0))
    assert cfg.rollout.differs_from_training
    assert build_algorithm(cfg).correction is not None
    with pytest.raises(ConfigError, match="rollout.attention_precision bf16"):
        Config(
            algorithm=AlgorithmConfig(name="grpo_guard"),
            rollout=RolloutConfig(attention_precision="sage_int8"),
        )
    # tis_cap is read: no "set but never read" warning
    from miles.config import config_warnings

    assert not any("tis_cap" in w for w in config_warnings(cfg))
    assert any("tis_cap" in w for w in config_warnings(Config(rollout=RolloutConfig(tis_cap=3.0))))


def test_the_correction_uses_the_bf16_recompute_of_an_int8_rollout():
    """A rollout sampled with the INT8 stand-in: the trainer's first step recomputes the bf16
    log-probs (outside the switch: training's attention) and logs the gap to the rollout's."""
    from miles.algorithms import Policy, build_algorithm
    from miles.rollout.batch import MicroBatch, RolloutBatch
    from miles.rollout.sampler import compute_log_prob, sample_with_logprob

    cfg = Config(
        rollout=RolloutConfig(num_steps=4, attention_precision="sage_int8"),
        grpo=GRPOConfig(clip_range=0.05),
        train=TrainConfig(steps_per_rollout=1, micro_batch_size=2),
    )
    model = _tiny()
    g = torch.Generator().manual_seed(3)
    pos, neg = (
        torch.randn(2, 7, TINY_WAN["text_dim"], generator=g),
        torch.randn(1, 7, TINY_WAN["text_dim"], generator=g),
    )
    sample = dict(num_steps=4, shift=3.0, guidance_scales=[4.0], noise_level=0.7, sde_steps=[0, 1])
    with torch.no_grad(), rollout_attention([model], "sage_int8", kernel=sage_int8_reference):
        ro = sample_with_logprob(
            [model], pos, neg, (4, 3, 8, 8), generator=torch.Generator().manual_seed(5), **sample
        )
    with torch.no_grad():
        bf16 = torch.stack(
            [compute_log_prob([model], ro, k, pos, neg, [4.0], None, 0.7)[0] for k in range(2)], 1
        )
    gap = (bf16 - ro.log_probs).abs().mean()
    assert gap > 0
    batch = RolloutBatch(
        ["p"] * 2, [None] * 2, torch.tensor([0, 0]), torch.arange(2), 0,
        [MicroBatch(slice=slice(0, 2), pos=pos, neg=neg, rollout=ro)], [0, 1],
        advantages=torch.tensor([1.0, -1.0]),
    )  # fmt: skip
    policy = Policy(
        transformers=[model], guidance_scales=[4.0], routing=None, reference=None,
        generator=lambda *parts: torch.Generator().manual_seed(0),
    )  # fmt: skip
    stats = build_algorithm(cfg).accumulate(policy, batch, batch.chunks, step_in_rollout=0)
    assert stats["tis_logp_gap"] == pytest.approx(float(gap), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Refusals


def test_every_refusal_names_its_fix():
    assert check_attention_precision("bf16", "cpu", model_dtype="float32", ring=4, deterministic=True) == []
    cases = [
        (dict(device_type="cpu"), "this run is on cpu"),
        (dict(model_dtype="float32"), "set model.dtype bfloat16"),
        (dict(ring=2), "ring degree is 2: set --ulysses-degree equal to --sequence-parallel-size"),
        (dict(deterministic=True), "drop --deterministic-mode"),
        (dict(head_dim=16), r"head dims \(64, 96, 128\); this model's is 16"),
        (dict(capability=(7, 5)), "compute capability >= 8.0.*sm 75"),
        (dict(package_found=False, cuda_visible=True, capability=(9, 0)), r"pip install -e '.\[attn-lowp\]'"),
    ]
    for change, message in cases:
        kwargs = {"device_type": "cuda", **OK, "capability": (9, 0), **change}
        with pytest.raises(ValueError, match=message) as e:
            check_attention_precision("sage_int8", **kwargs)
        assert "or set rollout.attention_precision bf16" in str(e.value)
    with pytest.raises(ValueError, match="must be one of"):
        check_attention_precision("int4", "cuda", **OK)
    assert check_attention_precision("sage_int8", "cuda", capability=(9, 0), **OK) == []
    assert check_attention_precision("sage_int8", "cuda", capability=(8, 0), **OK) == []


def test_host_facts_warn_where_no_gpu_is_visible():
    """A dry run on a CPU host of a CUDA recipe: the package and the capability are the GPU host's."""
    kw = {**OK, "package_found": False, "cuda_visible": False}
    warnings = check_attention_precision("sage_int8", "cuda", **kw)
    assert len(warnings) == 2
    assert "pip install -e '.[attn-lowp]'" in warnings[0] and "checked again at startup" in warnings[0]
    assert "no CUDA device visible" in warnings[1]


def test_a_value_outside_the_choices_is_refused_by_the_config():
    from miles.config import parse_args

    with pytest.raises((ConfigError, SystemExit)):
        parse_args(["--config", "configs/tiny_cpu.yaml", "--rollout.attention-precision", "int4"])
    cfg, _ = parse_args(["--config", "configs/tiny_cpu.yaml", "--rollout.attention-precision", "sage_int8"])
    assert cfg.rollout.attention_precision == "sage_int8"


def test_a_yaml_value_outside_the_choices_names_them(tmp_path):
    from miles.config import parse_args

    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  attention_precision: int4\n")
    with pytest.raises(ConfigError, match="sage_int8"):
        parse_args(["--config", str(recipe)])


# ---------------------------------------------------------------------------------------------
# The plan: the dry run refuses what the real run refuses


def _plan(extra, device_type="cuda", world_size=1, strict=False):
    from miles.config import parse_args
    from miles.train.plan import plan_run

    args = ["--config", "configs/tiny_cpu.yaml", "--model.dtype", "bfloat16", "--rollout.attention-precision"]
    cfg, _ = parse_args(args + extra)
    return plan_run(cfg, world_size, device_type=device_type, strict=strict)


def _any_head_dim(monkeypatch):
    """The tiny models' heads are 16 wide, which the kernel does not take; the plumbing is tested."""
    spec = dataclasses.replace(KERNELS["sage_int8"], head_dims=(16, 64, 96, 128))
    monkeypatch.setitem(KERNELS, "sage_int8", spec)


def _gpu_host(monkeypatch, package: bool, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if package else None) if name in ("sageattention", "triton") else real(name, *a)
        ),
    )


def test_plan_refuses_the_tiny_head_dim_in_the_dry_run_and_the_real_run():
    from miles.train.plan import PlanError

    messages = []
    for device_type in ("cuda", "cpu"):
        with pytest.raises(PlanError) as e:
            _plan(["sage_int8"], device_type)
        messages.append(str(e.value))
    assert "this run is on cpu" in messages[1]
    assert "head dims (64, 96, 128); this model's is 16" in messages[0]


def test_dry_run_row_and_warnings_on_a_cpu_host(monkeypatch):
    from miles.train.dry_run import format_report

    if torch.cuda.is_available():
        pytest.skip("checks what a host without a GPU reports")
    _any_head_dim(monkeypatch)
    plan = _plan(["sage_int8"])
    assert any("rollout.attention_precision sage_int8: no CUDA device visible" in w for w in plan.warnings)
    assert plan.sequence["rollout_attention_precision"] == "sage_int8"
    text = format_report(plan)
    assert "rollout in sage_int8 self-attention (bf16 old log-probs, importance weights capped at 2)" in text
    plan_bf16 = _plan(["bf16"])
    assert "self-attention (" not in format_report(plan_bf16)
    assert plan.resident == plan_bf16.resident  # no weight copy: the memory plan is bf16's


def test_dry_run_and_real_run_refuse_alike_on_a_gpu_host(monkeypatch):
    """Where a GPU is visible (the real run, or a dry run on the GPU host) the host's facts refuse."""
    from miles.train.plan import PlanError

    _any_head_dim(monkeypatch)
    _gpu_host(monkeypatch, package=False)
    for strict in (False, True):  # the dry run's plan, the real run's (strict)
        with pytest.raises(
            PlanError, match=r"needs sageattention and triton .*pip install -e '.\[attn-lowp\]'"
        ):
            _plan(["sage_int8"], strict=strict)
    _gpu_host(monkeypatch, package=True, capability=(7, 5))
    with pytest.raises(PlanError, match="this GPU is sm 75"):
        _plan(["sage_int8"])
    _gpu_host(monkeypatch, package=True)
    plan = _plan(["sage_int8"])
    assert not any("attention_precision" in w for w in plan.warnings)


def test_plan_refuses_ring_and_deterministic_mode_with_every_other_refusal(monkeypatch):
    from miles.train.plan import PlanError

    _any_head_dim(monkeypatch)
    with pytest.raises(PlanError) as e:
        _plan(["sage_int8", "--sequence-parallel-size", "2", "--ulysses-degree", "1"], world_size=2)
    assert "ring degree is 2" in str(e.value)
    with pytest.raises(PlanError, match="drop --deterministic-mode"):
        _plan(["sage_int8", "--deterministic-mode"])
    with pytest.raises(PlanError, match="set model.dtype bfloat16"):
        _plan(["sage_int8", "--model.dtype", "float32"])


# ---------------------------------------------------------------------------------------------
# The bench, end to end at its tiny CPU case


def test_bench_tiny_writes_every_key(tmp_path):
    from bench.attention_precision import main

    env_before = dict(os.environ)
    main(["--out", str(tmp_path), "--tiny", "--repeats", "1"])
    # nothing left behind for later tests' subprocesses (a MASTER_PORT left set made them bind it)
    assert dict(os.environ) == env_before
    result = json.loads((tmp_path / "attention_precision.json").read_text())
    assert set(result) == {"meta", "kernel", "rollout"} and result["meta"]["tiny"]
    (kernel,) = result["kernel"]
    assert {"bf16_ms", "lowp_ms", "speedup", "bf16_tflops", "lowp_tflops"} <= set(kernel)
    assert "emulation" in kernel["kernel_impl"] and kernel["cudnn_fp8_error"] == "CUDA only"
    assert kernel["err_lowp_vs_reference"] == 0.0  # on CPU the kernel is the reference
    assert kernel["err_lowp_vs_exact"] > 2 * kernel["err_bf16_vs_exact"] > 0  # INT8 is coarser than bf16
    (rollout,) = result["rollout"]
    assert rollout["bf16/bf16"]["rescore_abs_gap_max"] == 0.0  # the canary: bf16's recompute is exact
    low = rollout["bf16/sage_int8"]
    assert low["logp_abs_gap_mean"] > 0 and len(low["logp_gap"]) == 2  # 3 steps, the last an ODE step
    assert {"speedup", "tis_weight_mean", "final_latent_rel_l2"} <= set(low)
    assert set(rollout["runs"]) | set(rollout["unavailable"]) == {
        "bf16/bf16",
        "fp8/bf16",
        "bf16/sage_int8",
        "fp8/sage_int8",
    }
    assert "no time here is a speed-up" in (tmp_path / "attention_precision.md").read_text()
