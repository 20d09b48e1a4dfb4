"""What the GPU tests of a rollout precision share (``test_fp8_rollout.py``,
``test_attention_precision_gpu.py``): a world of one rank over NCCL, a small Wan expert (fixed seed),
wrapped as the trainer wraps it, and its rollouts at a precision with their SDE steps rescored by
the training side. Plain functions, not fixtures: the GPU machine runs those tests without pytest as well."""

from __future__ import annotations

import os

import torch

SMALL_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    text_dim=256,
    freq_dim=256,
    ffn_dim=1024,
    num_layers=2,
    rope_max_seq_len=1024,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)
LATENT = (16, 5, 32, 32)  # (C, F, H, W) of the rollouts
SDE_STEPS = [0, 1, 2]
GUIDANCE, NOISE_LEVEL = 5.0, 0.7


def nccl_world(port: str) -> None:
    """A world of one rank over NCCL (once a process; ``port`` where none is set)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", port)
        dist.init_process_group("nccl", rank=0, world_size=1)


def wan_expert(config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """``WanTransformer3DModel(**config)`` from seed 0 on the GPU in ``dtype``."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**config).to("cuda", dtype)


def wrapped_expert(config: dict, port: str) -> torch.nn.Module:
    """The fp32 ``wan_expert`` through ``parallelize_expert`` (bf16 compute, cuDNN attention) on a
    world of one rank, as the trainer wraps an expert."""
    from miles.parallel.topology import ParallelDims, build_parallel_mesh
    from miles.train.parallelize import parallelize_expert

    nccl_world(port)
    mesh = build_parallel_mesh(ParallelDims(world_size=1, sequence_parallel_size=1), "cuda")
    model = wan_expert(config, torch.float32)
    parallelize_expert(model, mesh, attention_backend="_native_cudnn", param_dtype=torch.bfloat16)
    return model


def rescored_rollouts(model, precision_context, precisions) -> dict:
    """{precision: (rollout, log-probs (B, SDE steps))}: for each of ``precisions`` a rollout of
    ``model`` as the trainer samples one (unsharded, under ``precision_context([model], precision)``;
    6 steps, shift 3, SDE at steps 0-2, the text and initial latents fixed by seed 0, the noise by
    seed 1), and its SDE steps' log-probs recomputed by ``model`` (the training side)."""
    from miles.parallel.fsdp import unsharded_for_rollout
    from miles.rollout.sampler import compute_log_prob, sample_with_logprob

    g = torch.Generator().manual_seed(0)
    pos = torch.randn(2, 64, 256, generator=g).to("cuda", torch.bfloat16)
    neg = torch.randn(1, 64, 256, generator=g).to("cuda", torch.bfloat16)
    init = torch.randn(2, *LATENT, generator=g).cuda()
    options = dict(
        num_steps=6,
        shift=3.0,
        guidance_scales=[GUIDANCE],
        noise_level=NOISE_LEVEL,
        latents=init,
        sde_steps=SDE_STEPS,
    )
    runs = {}
    with torch.no_grad():
        for precision in precisions:
            with unsharded_for_rollout([model]), precision_context([model], precision):
                gen = torch.Generator(device="cuda").manual_seed(1)
                rollout = sample_with_logprob([model], pos, neg, LATENT, generator=gen, **options)
            with unsharded_for_rollout([model]):
                steps = [
                    compute_log_prob([model], rollout, k, pos, neg, [GUIDANCE], None, NOISE_LEVEL)[0]
                    for k in range(len(SDE_STEPS))
                ]
            runs[precision] = rollout, torch.stack(steps, dim=1)
    return runs
