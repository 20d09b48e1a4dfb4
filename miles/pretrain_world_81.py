"""Pretrain the world's prior at Wan2.1's shape: 81 frames at 480 x 832, 32,760 tokens a sample.

    python -m miles.pretrain_world_81 miles/world/pipeline_81 --max-minutes 8   # make world-model-81 (one GPU)
    python -m miles.pretrain_world_81 --estimate                               # the FLOPs, nothing run

This is ``miles.pretrain_world`` — the same stages, the same functions — with another
``Pretrain81Config``: the world at ``miles.world.SHAPE_81``, Wan's 16 latent channels, a prior with
Wan's head size, on a GPU in bf16 with compiled blocks, videos rendered on the GPU as needed, the
flow-matching noise drawn there, and the report scored by the trainer's own evaluation:

1. **VAE.** The world VAE's architecture (``WORLD_VAE``: 4x temporal / 8x spatial, Wan's
   compression) with Wan's 16 latent channels (``VAE_16``; the committed 9-frame VAE has 8), trained
   on random 192-px crops around the ball (its size scaled with the frame), 9-frame then 17-frame
   clips; 81 x 480 x 832 encodes to 16 x 21 x 60 x 104, as Wan2.1's VAE does. ``--vae-path``
   instead reuses a trained VAE folder (e.g. ``miles/world/pipeline/vae``: 8 channels).
2. **Prior.** A Wan-architecture transformer with Wan's head size (``PRIOR``: one 128-wide head, 2
   blocks, ffn 512, Wan's 256-wide frequency embedding; 2.9 MB of fp32 weights,
   ``prior_megabytes``; ``--prior-blocks 1`` halves its cost), on the tiny UMT5's 32-wide text,
   trained by rectified flow on the normalised latents of ``videos_per_prompt`` renders per
   training prompt (shift-3 time density, 10% captions dropped for CFG).
3. **Report.** ``OUT_DIR/../pretrain_report_81.json``: held-out and train adherence of the saved
   folder, sampled by the trainer's own evaluation (``miles.eval.evaluate``: ODE, ``eval_steps``,
   ``eval_guidance``, the noise of ``eval.seed`` 0), the times, the config and the FLOPs estimate.

**Resume**: ``--max-minutes`` pauses the run (its state saved, exit 75) and the same command
continues it (``miles.pretrain_resume``), so the pretraining fits the device's 10-minute commands.

Cost (``estimate``, ``--estimate``): at 32,760 tokens attention is 97% of a forward; the defaults
(4,000 steps of batch 8) come to 1.1e17 FLOPs, about 4 min at the 1.3B model's measured 449 TFLOP/s
train rate (``RATES``) — an estimate, not a measurement; ``bench/world81_plan.py`` adds the VAE,
encoding, evaluation and start-up. A CPU test runs every stage at a reduced ``Shape``
(``tests/unit/test_world_81.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.pretrain_resume import PAUSED_EXIT, Budget, cli_budget, run_paused_or_done
from miles.pretrain_world import WORLD_VAE, PretrainConfig, _autocast
from miles.pretrain_world import pretrain as pretrain_any_shape
from miles.world.world import SHAPE_81, heldout_prompts, train_prompts

PRIOR = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=1,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=32,  # the tiny UMT5's d_model (miles.models.tiny.TINY_TEXT_ENCODER)
    freq_dim=256,
    ffn_dim=512,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
"""The 81-frame prior: Wan2.1's block with Wan's head size, one 128-wide head, 2 blocks (sized by the
GPU budget: ``estimate`` and docs/learning.md, "The 81-frame world")."""
PRIOR_BLOCKS = (1, 2)
"""The sizes ``--prior-blocks`` offers: 2 (``PRIOR``, the committed configs) or 1, which halves every
transformer FLOP of the pretraining and of the RL curves (docs/learning.md, "The 81-frame world")."""
VAE_16 = dict(WORLD_VAE, z_dim=16)
"""The world VAE's architecture with Wan's 16 latent channels."""
RATES = {"train": 449.0, "forward": 542.0, "vae_fp32": 90.0}
"""TFLOP/s measured on one H200 at 32,760 tokens (BENCHMARKS.md, docs/bench/h200_r6.json): Wan2.1-1.3B's
compiled train step (449, AdamW included) and compiled rollout step (542); the Wan2.1 VAE's fp32 decode
at 81 x 480 x 832 (3.05 s, docs/bench/decode_precision_h200.json) over its 2.75e14 FLOPs (counted by
``torch.utils.flop_counter`` on meta tensors): 90. Borrowed for the prior and the world VAE, whose
kernels are the same kinds at the same token count (an estimate: one 128-wide head gives attention
1/12 of the 1.3B's tiles; not measured)."""


@dataclass(frozen=True)
class Pretrain81Config(PretrainConfig):
    """``PretrainConfig`` at ``SHAPE_81`` (defaults: ``make world-model-81`` on one H200)."""

    shape: tuple[int, int, int] = (SHAPE_81.num_frames, SHAPE_81.height, SHAPE_81.width)
    device: str = "cuda"
    dtype: str = "bfloat16"
    compile: bool = True
    vae: dict = field(default_factory=lambda: dict(VAE_16))
    prior: dict | None = field(default_factory=lambda: dict(PRIOR))
    vae_short_steps: int = 600
    """AdamW steps on 9-frame crops."""
    vae_long_steps: int = 200
    """AdamW steps on 17-frame crops."""
    vae_clip_frames: tuple[int, int] = (9, 17)
    crop: int = 192
    """Crop side (px): the big ball's diameter at 480 x 832 is ~135 px."""
    videos_per_prompt: int = 16
    """Renders per training prompt encoded for the prior (24 x 16 x 8.4 MB of fp32 latents on the GPU)."""
    encode_chunk: int = 1
    dit_steps: int = 4000
    dit_batch: int = 8
    device_noise: bool = True
    eval_seeds_heldout: int = 16
    eval_seeds_train: int = 4
    """Seeds per training prompt (0: the held-out prompts only)."""
    eval_steps: int = 10
    eval_micro_batch: int = 8
    eval_reserve_s: float = 90.0
    """The evaluation (~25 s on an H200 by ``estimate``, plus loading) starts only with this much left."""


def prior_megabytes(prior: dict = PRIOR) -> float:
    """fp32 weight size (MB, 1e6 bytes) of a ``WanTransformer3DModel`` of ``prior`` (built on meta)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**prior)
    return sum(p.numel() for p in model.parameters()) * 4 / 1e6


def forward_flops(shape: tuple[int, int, int], prior: dict = PRIOR, text_tokens: int = 64) -> int:
    """FLOPs of one sample's forward of ``prior`` at the video ``shape`` (F, H, W): per block 4 L^2 d
    (QK^T and PV) + 2 L (8 d^2 + 2 d ffn) (the linears) + 4 L T d (cross-attention). Within 0.3% of
    ``torch.utils.flop_counter``'s count at SHAPE_81 (``tests/unit/test_world_81.py``)."""
    f, h, w = shape
    tokens = ((f - 1) // 4 + 1) * (h // 16) * (w // 16)  # VAE 4x/8x, then the 1x2x2 patch
    d = prior["num_attention_heads"] * prior["attention_head_dim"]
    per_block = (
        4 * tokens * tokens * d
        + 2 * tokens * (8 * d * d + 2 * d * prior["ffn_dim"])
        + 4 * tokens * text_tokens * d
    )
    return prior["num_layers"] * per_block


def estimate(cfg: Pretrain81Config) -> dict:
    """FLOPs and estimated H200 seconds (``RATES``) of the prior's pretraining at ``cfg.shape``: a
    training step is 3 forwards of ``dit_batch`` samples; the evaluation samples ``eval_steps`` x 2
    (CFG) forwards a sample. The VAE's training, the encoding and the decodes are counted in
    ``bench/world81_plan.py``."""
    f, h, w = cfg.shape
    tokens = ((f - 1) // 4 + 1) * (h // 16) * (w // 16)
    d = cfg.prior["num_attention_heads"] * cfg.prior["attention_head_dim"]
    forward = forward_flops(cfg.shape, cfg.prior, cfg.max_sequence_length)
    train = 3 * forward * cfg.dit_batch * cfg.dit_steps
    eval_samples = 8 * cfg.eval_seeds_heldout + 24 * cfg.eval_seeds_train
    return {
        "tokens_per_sample": tokens,
        "forward_flops_per_sample": forward,
        "attention_share": round(4 * tokens * tokens * d * cfg.prior["num_layers"] / forward, 3),
        "prior_train_flops": train,
        "prior_train_s": round(train / (RATES["train"] * 1e12)),
        "eval_samples": eval_samples,
        "eval_transformer_s": round(eval_samples * cfg.eval_steps * 2 * forward / (RATES["forward"] * 1e12)),
        "rates_tflops": RATES,
        "prior_weights_mb": round(prior_megabytes(cfg.prior), 2),
    }


@torch.no_grad()
def evaluate_folder(cfg: Pretrain81Config, folder: Path, device: torch.device) -> dict:
    """Held-out and train ``world_adherence`` of the saved folder through ``miles.eval.evaluate``."""
    from miles.config import ModelConfig
    from miles.eval.evaluate import EvalSettings, evaluate
    from miles.models.wan import load_wan
    from miles.rewards import build_rewards

    model = load_wan(ModelConfig(path=str(folder)), device)
    rewards = build_rewards({"world_adherence": 1.0})
    settings = EvalSettings(
        latent_shape=model.latent_shape(*cfg.shape),
        num_steps=cfg.eval_steps,
        shift=3.0,
        guidance_scales=[cfg.eval_guidance],
        routing=model.routing,
        micro_batch_size=cfg.eval_micro_batch,
        seed=0,  # eval.seed's default: the recipe's in-loop evaluation draws this noise
    )
    out = {}
    for split, prompts, seeds in (
        ("heldout", heldout_prompts(), cfg.eval_seeds_heldout),
        ("train", train_prompts(), cfg.eval_seeds_train),
    ):
        if seeds == 0:
            continue
        with _autocast(cfg, device):
            result = evaluate(
                model, rewards, prompts, seeds, settings, negative_prompt="", keep_videos=False,
                max_sequence_length=cfg.max_sequence_length, device=device,
            )  # fmt: skip
        scores = result["scores"][0]
        out[split] = {
            "adherence": round(float(scores.mean()), 4),
            "se": round(float(scores.std() / len(scores) ** 0.5), 4) if len(scores) > 1 else None,
            "num_samples": len(scores),
        }
    return out


def pretrain(
    out_dir: Path,
    cfg: Pretrain81Config = Pretrain81Config(),
    budget: Budget | None = None,
    state_dir: Path | None = None,
) -> dict:
    """``miles.pretrain_world.pretrain`` at ``cfg``'s shape, scored by ``evaluate_folder``; the report
    adds the FLOPs ``estimate``. With a ``budget`` it may pause (``Paused``) and continue when called
    again."""
    report = pretrain_any_shape(out_dir, cfg, budget, evaluate_fn=evaluate_folder, state_dir=state_dir)
    report["estimate"] = estimate(cfg)
    return report


def write_configs(out_dir: Path, prior: dict = PRIOR) -> Path:
    """The folder's configs without weights (what is committed as ``miles/world/pipeline_81`` so
    that the recipe's dry run plans it): the 9-frame folder's index, scheduler, tokenizer and tiny
    UMT5 (weights included, 0.1 MB), and the configs of ``prior`` and ``VAE_16`` (latent statistics
    0 / 1 until ``make world-model-81`` writes the measured ones)."""
    import shutil

    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from miles.world import PIPELINE_DIR

    out_dir = Path(out_dir)
    for sub in ("scheduler", "text_encoder", "tokenizer"):
        shutil.copytree(PIPELINE_DIR / sub, out_dir / sub, dirs_exist_ok=True)
    shutil.copy(PIPELINE_DIR / "model_index.json", out_dir / "model_index.json")
    with torch.device("meta"):
        transformer = WanTransformer3DModel(**prior)
        vae = AutoencoderKLWan(**VAE_16, latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    transformer.save_config(out_dir / "transformer")
    vae.save_config(out_dir / "vae")
    return out_dir


def config_from_args(args) -> Pretrain81Config:
    """``Pretrain81Config`` with the command line's overrides (``--dit-steps``, ``--vae-path``,
    ``--prior-blocks``)."""
    overrides = {
        k: v for k, v in (("dit_steps", args.dit_steps), ("vae_path", args.vae_path)) if v is not None
    }
    if args.prior_blocks is not None:
        overrides["prior"] = dict(PRIOR, num_layers=args.prior_blocks)
    return dataclasses.replace(Pretrain81Config(), **overrides)


def parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m miles.pretrain_world_81", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "out_dir", nargs="?", type=Path, help="the pipeline folder to write (its report beside it)"
    )
    p.add_argument("--estimate", action="store_true", help="print the FLOPs estimate; nothing runs")
    p.add_argument("--configs", action="store_true", help="write only the configs into OUT_DIR")
    p.add_argument("--dit-steps", type=int, default=None, help="prior steps (default: Pretrain81Config's)")
    p.add_argument("--vae-path", default=None, help="reuse a trained AutoencoderKLWan folder")
    p.add_argument(
        "--prior-blocks", type=int, choices=PRIOR_BLOCKS, default=None,
        help="the prior's blocks (default 2, PRIOR; 1 halves the transformer's cost: docs/learning.md)",
    )  # fmt: skip
    p.add_argument(
        "--max-minutes", type=float, default=None, help="pause (exit 75) after this long; rerun to continue"
    )
    p.add_argument(
        "--state-dir", type=Path, default=None, help="a paused run's state (default: .OUT_DIR.resume)"
    )
    return p


def main(argv: list[str]) -> None:
    p = parser()
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    if args.estimate:
        print(json.dumps(estimate(cfg), indent=1))
        return
    if args.out_dir is None:
        p.error("give OUT_DIR (e.g. miles/world/pipeline_81)")
    if args.configs:
        print(write_configs(args.out_dir, cfg.prior))
        return
    budget = cli_budget(args.max_minutes)
    report = run_paused_or_done(lambda: pretrain(args.out_dir, cfg, budget, args.state_dir))
    if report is None:
        raise SystemExit(PAUSED_EXIT)
    path = args.out_dir.parent / "pretrain_report_81.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for split in ("train", "heldout"):
        if split in report:
            r = report[split]
            print(f"{split:8s} adherence {r['adherence']:.3f} (SE {r['se']}; {r['num_samples']} samples)")
    print(f"wall time {report['times']['total_s'] / 60:.1f} min; report: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
