"""The per-rank memory promise (miles/train/memory_budget.py) against hand-written formulas.

Every term of :class:`ResidentMemory` is recomputed here from the parameter counts with the
formulas written out (integers, exact), on the tiny model and on Wan2.2-A14B / Wan2.1-14B shapes
(meta modules: exact counts, no memory); HSDP divides the sharded terms by the shard group
(world / replicate_size) and nothing else; a budget the rollout cannot meet is refused with the fix.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from miles.config import parse_args
from miles.train.memory_budget import (
    ALLOCATOR_SLACK,
    GIB,
    MemoryBudgetError,
    ModelSizes,
    ResidentMemory,
    RolloutShape,
    activation_budget,
    model_sizes,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", str(ROOT / "configs" / "tiny_cpu.yaml")]

# Wan2.2-T2V-A14B (each expert) / Wan2.1-T2V-14B transformer config
WAN_14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
)


def _cfg(*flags: str):
    cfg, _ = parse_args([*TINY, *flags])
    return cfg


def _shape(**kw) -> RolloutShape:
    base = dict(
        tokens_per_rank=32760 // 8,
        latent_numel=16 * 21 * 60 * 104,
        num_frames=81,
        height=480,
        width=832,
        samples_per_rank=4,
        num_sde_steps=2,
        micro_batch=1,
        cfg_factor=2,
        text_tokens=512,
    )
    return RolloutShape(**{**base, **kw})


@functools.cache
def _expert_14b() -> tuple[ModelSizes, int]:
    """Exact counts of one 14B expert (meta device), and r=1 LoRA adapter parameters on the default
    targets: r·(in + out) per targeted Linear (peft's count; the tiny test checks it against peft)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        expert = WanTransformer3DModel(**WAN_14B)
    targets = _cfg().model.lora_target_modules
    per_rank = sum(
        m.in_features + m.out_features
        for name, m in expert.named_modules()
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    )
    return model_sizes([expert]), per_rank


def _a14b_sizes(lora_rank: int = 0) -> ModelSizes:
    """Two identical 14B experts (Wan2.2-A14B), adapters of ``lora_rank`` on the default targets."""
    one, per_rank = _expert_14b()
    return dataclasses.replace(one, expert_params=2 * one.expert_params, lora_params=2 * lora_rank * per_rank)


def _hand(
    cfg, sizes: ModelSizes, shape: RolloutShape, S: int, *, lora: bool, old=False, ref=False, rewards=0
) -> dict:
    """The module docstring's formulas, written out again."""
    c = 2 if cfg.model.dtype == "bfloat16" else 4
    v = 2 if cfg.model.vae_dtype == "bfloat16" else 4
    N, Nt = sum(sizes.expert_params), (sizes.lora_params if lora else sum(sizes.expert_params))
    weights = (c * N + 4 * Nt) / S if lora else 4 * N / S
    in_flight = (sizes.outside_blocks + 2 * sizes.largest_block) * c
    # model.text_encoder_dtype auto: bf16 on CUDA (ResidentMemory.of's default device type)
    te_all = sizes.text_encoder_params * (4 if cfg.model.text_encoder_dtype == "float32" else 2)
    te = 0 if cfg.model.text_encoder_offload else te_all
    h, w, f = shape.height, shape.width, shape.num_frames
    if cfg.model.vae_tiling:
        th, tw = min(h, 256), min(w, 256)
    else:
        th, tw = h, w
    decode = shape.micro_batch * (
        6 * f * h * w * 4 + sizes.vae_decoder_bytes * sizes.vae_base_dim * th * tw * v
    )
    return dict(
        weights=weights,
        grads=4 * Nt / S,
        optimizer=8 * Nt / S,
        ema=4 * Nt / S if cfg.train.ema_decay > 0 else 0,
        old_policy=weights if old else 0,
        reference=c * N / S if ref else 0,
        text_encoder=te,
        encode_visit=te_all if cfg.model.text_encoder_offload else 0,
        vae=sizes.vae_params * v,
        rewards=rewards,
        buffers=2 * shape.samples_per_rank * shape.num_sde_steps * shape.latent_numel * 4
        + 2 * shape.samples_per_rank * shape.text_tokens * sizes.text_dim * c,
        gathered_train=in_flight,
        gathered_rollout=max(sizes.expert_params) * c,
        rollout_workspace=shape.micro_batch
        * shape.cfg_factor
        * shape.tokens_per_rank
        * (16 * sizes.hidden_size + 2 * sizes.ffn_dim)
        * c,
        decode_workspace=decode,
        decode_beside_rollout=decode if cfg.rollout.overlap_decode else 0,
    )


def _check(resident: ResidentMemory, hand: dict) -> None:
    got = {k: v * GIB for k, v in resident.as_gib().items()}
    assert got.keys() == hand.keys()
    for key, value in hand.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-6), key


def test_tiny_terms_match_the_formulas():
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    folder = ROOT / ".cache" / "tiny-wan" / "two_expert"
    experts = [
        WanTransformer3DModel.from_pretrained(folder / sub) for sub in ("transformer", "transformer_2")
    ]
    vae = AutoencoderKLWan.from_pretrained(folder / "vae")
    from miles.models.wan import vae_decoder_memory

    sizes = model_sizes(experts, torch.nn.Linear(3, 5), vae, vae_decoder=vae_decoder_memory(vae.config))
    assert sizes.expert_params == tuple(sum(p.numel() for p in e.parameters()) for e in experts)
    assert (
        sizes.lora_params == 0
        and sizes.text_encoder_params == 20
        and sizes.vae_base_dim == vae.config.base_dim
        and sizes.vae_decoder_bytes == 51.0
    )
    shape = _shape(tokens_per_rank=16, latent_numel=16 * 2 * 8 * 8, num_frames=5, height=64, width=64)
    for flags, old, ref in [
        ([], False, False),
        (["--grpo.kl-beta", "0.01", "--train.ema-decay", "0.9"], False, True),
        (["--algorithm.name", "diffusion_nft", "--model.no-text-encoder-offload"], True, False),
        (["--model.dtype", "bfloat16", "--model.vae-dtype", "bfloat16", "--model.vae-tiling"], False, False),
    ]:
        cfg = _cfg(*flags)
        for S in (1, 4):
            _check(
                ResidentMemory.of(cfg, sizes, shape, S),
                _hand(cfg, sizes, shape, S, lora=False, old=old, ref=ref),
            )


def test_lora_counts_adapters_apart_and_keeps_the_base_in_the_compute_dtype():
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    folder = ROOT / ".cache" / "tiny-wan" / "two_expert"
    model = WanTransformer3DModel.from_pretrained(folder / "transformer")
    base = sum(p.numel() for p in model.parameters())
    cfg = _cfg("--model.lora-rank", "4", "--model.dtype", "bfloat16")
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=cfg.model.lora_target_modules))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sizes = model_sizes([model])
    assert sizes.expert_params == (base,) and sizes.lora_params == adapters > 0
    shape = _shape()
    _check(ResidentMemory.of(cfg, sizes, shape, 8), _hand(cfg, sizes, shape, 8, lora=True))


def test_a14b_lora_world8_real_sizes():
    """Wan2.2-A14B LoRA (rank 64) at 81x480x832, world 8, sp 8, bf16: the rehearsal's first config."""
    sizes = _a14b_sizes(lora_rank=64)
    assert 14.2e9 < sizes.expert_params[0] < 14.4e9 and sizes.expert_params[0] == sizes.expert_params[1]
    cfg = _cfg(
        "--model.lora-rank", "64", "--model.dtype", "bfloat16", "--model.text-encoder-dtype", "bfloat16"
    )
    shape = _shape()
    resident = ResidentMemory.of(cfg, sizes, shape, 8)
    _check(resident, _hand(cfg, sizes, shape, 8, lora=True))
    mem = resident.as_gib()
    # the frozen base of both experts in bf16 over 8 ranks; one expert gathered in bf16 for the rollout
    assert mem["weights"] == pytest.approx((2 * sum(sizes.expert_params) + 4 * sizes.lora_params) / 8 / GIB)
    assert 26.5 < mem["gathered_rollout"] < 26.8  # 14.3e9 x 2 bytes: one expert, not both
    assert resident.rollout_peak / GIB < 76  # the target for an 80 GB card (weights part)


def test_full_finetune_14b_world16_and_hsdp_divides_by_the_shard_group():
    sizes = _a14b_sizes()
    one = dataclasses.replace(sizes, expert_params=sizes.expert_params[:1])  # Wan2.1-14B
    cfg = _cfg("--model.dtype", "bfloat16", "--grpo.kl-beta", "0.01")
    shape = _shape(tokens_per_rank=32760 // 4)
    plain = ResidentMemory.of(cfg, one, shape, 16)
    _check(plain, _hand(cfg, one, shape, 16, lora=False, ref=True))
    # HSDP over 2 nodes of 8: shard groups of 8 hold twice the sharded state; the rest is the same
    hsdp = ResidentMemory.of(cfg, one, shape, 16 // 2)
    _check(hsdp, _hand(cfg, one, shape, 8, lora=False, ref=True))
    sharded = ("weights", "grads", "optimizer", "ema", "old_policy", "reference")
    for key, value in plain.as_gib().items():
        assert hsdp.as_gib()[key] == pytest.approx(value * (2 if key in sharded else 1)), key
    assert plain.as_gib()["weights"] == pytest.approx(4 * one.expert_params[0] / 16 / GIB)  # fp32 masters


def test_activation_budget_is_what_the_total_leaves():
    sizes = _a14b_sizes(lora_rank=64)
    cfg = _cfg("--model.lora-rank", "64", "--model.dtype", "bfloat16")
    resident = ResidentMemory.of(cfg, sizes, _shape(), 8)
    total = 76 * GIB
    left = activation_budget(total, resident)
    assert left == pytest.approx(total * (1 - ALLOCATOR_SLACK) - resident.train_fixed)
    # the promise: training's fixed part + activations + slack == the budget, and the rollout fits
    assert resident.train_fixed + left + ALLOCATOR_SLACK * total == pytest.approx(total)
    assert resident.rollout_peak <= total * (1 - ALLOCATOR_SLACK)


def test_budget_refusals_name_the_fix():
    sizes = _a14b_sizes(lora_rank=64)
    cfg = _cfg("--model.lora-rank", "64", "--model.dtype", "bfloat16")
    resident = ResidentMemory.of(cfg, sizes, _shape(), 8)
    with pytest.raises(
        MemoryBudgetError, match=r"the rollout alone needs \d+\.\d GiB per rank .*gathered_rollout"
    ) as e:
        activation_budget(20 * GIB, resident)
    assert "raise model.activation_memory_budget_gib" in str(e.value)
    # the rollout fits but training's fixed part does not (a large persistent term, resharded in rollout)
    heavy = ResidentMemory(weights=1 * GIB, grads=30 * GIB, optimizer=1 * GIB, gathered_rollout=5 * GIB)
    with pytest.raises(MemoryBudgetError, match="nothing is left for activations within 20 GiB"):
        activation_budget(20 * GIB, heavy)
    with pytest.raises(MemoryBudgetError, match="must be > 0"):
        activation_budget(0.0, heavy)


def _trainer_refuses_body(rank: int, world_size: int, out_dir: str) -> None:
    from miles.train.trainer import Trainer

    cfg, _ = parse_args(
        [*TINY, "--run.output-dir", out_dir, "--run.wandb-mode", "disabled"]
        + ["--model.activation-checkpointing", "budget", "--model.activation-memory-budget-gib", "0.001"]
    )
    with pytest.raises(MemoryBudgetError, match="the rollout alone needs .* but the budget of 0.001 GiB"):
        Trainer(cfg)


@pytest.mark.distributed
def test_trainer_refuses_a_budget_the_rollout_cannot_meet(tmp_path):
    """The real Trainer (1 gloo rank, the tiny model) refuses at startup, before any rollout."""
    from tests.dist_utils import run_pooled

    run_pooled(_trainer_refuses_body, 1, str(tmp_path))
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_reward_models_are_resident_bytes_counted_once():
    """The reward models' device bytes (``resident_bytes``: parameters and buffers, a model shared
    by two rewards once, tensors elsewhere not at all) join the persistent terms."""
    from miles.rewards.base import Reward, resident_bytes

    class Scorer(Reward):
        def __init__(self, *modules):
            self.a, self.b = (*modules, None, None)[:2]
            self.not_a_module = torch.ones(1000)

        def __call__(self, videos, prompts):
            raise NotImplementedError

    shared = torch.nn.Linear(10, 20)  # 220 fp32 values
    norm = torch.nn.BatchNorm1d(8).to(torch.float64)  # 16 parameters + 17 buffer values, 8 bytes each
    meta = torch.nn.Linear(4, 4, device="meta")  # not on the device: not counted
    rewards = [Scorer(shared, norm), Scorer(shared, meta), Scorer()]
    want = 220 * 4 + (16 + 8 + 8) * 8 + 8  # BatchNorm buffers: mean, var (float64), count (int64)
    assert resident_bytes(rewards, "cpu") == want
    assert resident_bytes(rewards, "cuda") == 0

    cfg = _cfg()
    sizes = _expert_14b()[0]
    base = ResidentMemory.of(cfg, sizes, _shape(), 4)
    with_rewards = ResidentMemory.of(cfg, sizes, _shape(), 4, reward_bytes=want)
    assert with_rewards.rewards == want
    assert with_rewards.persistent - base.persistent == pytest.approx(want)
    assert with_rewards.train_fixed - base.train_fixed == pytest.approx(want)


def test_decoding_during_the_rollout_adds_one_decode_workspace_to_its_peak():
    """``rollout.overlap_decode``: a micro-batch decodes while the next is sampled, so the rollout's
    peak holds the sampling's terms and one decode workspace at once; training's peak is unchanged."""
    cfg = _cfg()
    sizes = _expert_14b()[0]
    plain = ResidentMemory.of(cfg, sizes, _shape(), 4)
    ahead = ResidentMemory.of(_cfg("--rollout.overlap-decode"), sizes, _shape(), 4)
    _check(
        ahead,
        {**{k: v * GIB for k, v in plain.as_gib().items()}, "decode_beside_rollout": plain.decode_workspace},
    )
    sampling = plain.persistent + plain.gathered_rollout + plain.rollout_workspace
    assert plain.rollout_peak == max(sampling, plain.persistent + plain.decode_workspace)
    assert ahead.rollout_peak == pytest.approx(sampling + plain.decode_workspace, rel=1e-12)
    assert ahead.train_fixed == plain.train_fixed


class _LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """The peak of the bytes held by storages that ops create while the mode is on (CPU)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self._refs = {}, 0, 0, []

    def _free(self, key):
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    self._refs.append(weakref.ref(storage, lambda _, k=key: self._free(k)))
        return out


@pytest.mark.parametrize("family", ["wan2.1", "wan2.2", "ltx"])
def test_vae_decode_term_is_what_the_decoder_holds(family):
    """The decode workspace term against the live storages of a real AutoencoderKLWan decode (the
    Wan2.1 VAE's architecture, and the Wan2.2 VAE's: residual, patch 2), at a reduced width: the
    term is linear in the decoder's width (measured: 51.0 a channel at widths 32 and 96, 21.4 at
    64 and 256), so a narrow decoder checks the published one's coefficient. LTX-Video's
    AutoencoderKLLTXVideo decodes the whole clip at once: its term is per pixel of every frame."""
    from diffusers import AutoencoderKLLTXVideo, AutoencoderKLWan

    from bench.real_configs import VAE_WAN22
    from miles.models.config_folders_ltx import VAE_LTX_091

    torch.manual_seed(0)
    if family == "ltx":  # the published 0.9.1 decoder at 1/8 of its widths, a narrow encoder
        from miles.models.ltx import LTXModel

        narrow = dict(decoder_block_out_channels=(32, 64, 128), block_out_channels=(8, 16, 32, 32))
        vae = AutoencoderKLLTXVideo(**{**VAE_LTX_091, **narrow, "layers_per_block": (1,) * 5}).eval()
        model = LTXModel(
            path=None, transformers=[], pipeline=type("P", (), {"vae": vae}), scheduler_config={}
        )
        base, k, whole_clip = model.vae_decoder_memory()
        assert whole_clip and base == 32
        latents, temb = torch.randn(1, 128, 2, 4, 4), torch.zeros(1)
    else:
        config = (
            dict(base_dim=32) if family == "wan2.1" else {**VAE_WAN22, "base_dim": 32, "decoder_base_dim": 64}
        )
        vae = AutoencoderKLWan(**config).eval()
        from miles.models.wan import VAE_DECODER_BYTES, vae_decoder_memory

        base, k = vae_decoder_memory(vae.config)
        assert k == VAE_DECODER_BYTES[family]
        up = vae.config.scale_factor_spatial if family == "wan2.2" else 8
        latents, temb = torch.randn(1, vae.config.z_dim, 4, 64 // up, 64 // up), None
    from miles.train.memory_budget import _decode_bytes

    with torch.no_grad(), _LiveStorages() as live:
        video = vae.decode(latents, *([] if temb is None else [temb]), return_dict=False)[0]
        frames = ((video.float() / 2 + 0.5).clamp(0, 1)).permute(0, 2, 1, 3, 4).contiguous()
        del video
    f, h, w = frames.shape[1], frames.shape[3], frames.shape[4]
    shape = _shape(num_frames=f, height=h, width=w, micro_batch=1)
    per_frame = k * f if family == "ltx" else k  # LTX's k is per pixel of every frame (ResidentMemory.of)
    formula = _decode_bytes(shape, base, per_frame, 4, tiling=False)
    # the formula counts two fp32 videos; the decoder's peak holds one
    assert abs(live.peak + 12 * f * h * w - formula) <= 0.05 * formula, (live.peak, formula)
