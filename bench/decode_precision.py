"""The VAE decode in fp32 against bf16 (``model.vae_dtype``): its time, the frames' change, the reward's.

    python bench/decode_precision.py --out OUT                   # Wan2.1 VAE at 81x480x832 (GPU)
    python bench/decode_precision.py --out OUT --no-real --world # the world's trained VAE only (CPU: seconds)

Both decodes go through the trainer's own ``WanModel.decode`` (un-normalise, decode, [0, 1] fp32
frames), the bf16 one with a bf16 copy of the same VAE. Two cases:

- ``real``: the Wan2.1 VAE at its real config with random weights (``bench/real_configs.py``),
  ``--samples`` latents of ``--shape`` drawn from N(0, 1) (the sampler's normalised scale), decoded
  one at a time as the trainer's micro-batches of 1 are; seconds per video (mean of ``--repeats``
  after a warm-up) and the jpeg reward (the step bench's) of each decode. Random weights make
  its frames noise: the time is the real one, the reward change says little.
- ``world`` (``--world``): the world's trained VAE (``miles/world/pipeline``) on the latents of
  rendered held-out videos (their posterior means, normalised as the sampler's latents are): the
  world reward (``world_adherence``) of both decodes, on frames that look like what it was trained on.

For each: max and mean |Δ| of the frames (in [0, 1] units), each reward's mean and the largest
per-video change. Writes ``decode_precision.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _decode(vae, latents: torch.Tensor) -> torch.Tensor:
    from miles.models.wan import WanModel

    with torch.no_grad():
        return WanModel.decode(SimpleNamespace(pipeline=SimpleNamespace(vae=vae)), latents)


def _timed(vae, latents: list[torch.Tensor], repeats: int, device: torch.device) -> tuple[list, float]:
    """The frames of each latent (on the CPU) and the mean seconds per video after one warm-up."""
    _decode(vae, latents[0])
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        frames = [_decode(vae, z).cpu() for z in latents]
        seconds.append((time.perf_counter() - start) / sum(z.shape[0] for z in latents))
    return frames, sum(seconds) / len(seconds)


def compare(
    name: str, vae32, latents: list[torch.Tensor], rewards: dict, prompts: list[str], args, device
) -> dict:
    """Decode ``latents`` with ``vae32`` and its bf16 copy; times, frame change and reward change."""
    vae16 = copy.deepcopy(vae32).to(torch.bfloat16)
    out = {"case": name, "videos": sum(z.shape[0] for z in latents), "latent_shape": list(latents[0].shape)}
    frames = {}
    for dtype, vae in (("float32", vae32), ("bfloat16", vae16)):
        frames[dtype], out[f"{dtype}_s_per_video"] = _timed(vae, latents, args.repeats, device)
    a, b = torch.cat(frames["float32"]), torch.cat(frames["bfloat16"])
    out["frames_max_abs_diff"] = float((a - b).abs().max())
    out["frames_mean_abs_diff"] = float((a - b).abs().mean())
    out["speedup"] = out["float32_s_per_video"] / out["bfloat16_s_per_video"]
    for rname, reward in rewards.items():
        r32, r16 = reward(a, prompts), reward(b, prompts)
        out[rname] = {
            "float32_mean": float(r32.mean()),
            "bfloat16_mean": float(r16.mean()),
            "mean_change": float((r16 - r32).mean()),
            "max_abs_change": float((r16 - r32).abs().max()),
            "float32_std_over_videos": float(r32.std()) if len(r32) > 1 else 0.0,
        }
    print(f"[decode-precision] {json.dumps(out)}", flush=True)
    return out


def real_case(args, device) -> dict:
    from diffusers import AutoencoderKLWan

    from bench.real_configs import model_spec
    from miles.rewards.jpeg import JpegIncompressibility

    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLWan(**model_spec(args.model)["vae"]).float().eval()
    frames, height, width = args.shape
    shape = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(shape, generator=g).to(device) for _ in range(args.samples)]
    rewards = {"jpeg_incompressibility": JpegIncompressibility()}
    return compare(
        f"{args.model} VAE, random weights", vae, latents, rewards, [""] * args.samples, args, device
    )


def world_case(args, device) -> dict:
    from diffusers import AutoencoderKLWan

    from miles.pretrain_world import encode_videos
    from miles.rewards.world import WorldAdherence
    from miles.world import PIPELINE_DIR, heldout_prompts, render_prompt

    vae = AutoencoderKLWan.from_pretrained(PIPELINE_DIR / "vae").float().eval().to(device)
    prompts = heldout_prompts()[: args.world_videos]
    videos = torch.stack([render_prompt(p, seed=i) for i, p in enumerate(prompts)])  # (N, F, 3, H, W)
    with torch.no_grad():
        z = encode_videos(vae, (videos.permute(0, 2, 1, 3, 4) * 2 - 1).to(device)).to(device)
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    latents = [((z - mean) / std)]  # one batch: the world's micro-batches are large
    return compare("world VAE (trained), held-out renders", vae, latents, {"world_adherence": WorldAdherence()},
                   prompts, args, device)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="wan2.1-t2v-1.3b")
    ap.add_argument("--shape", type=int, nargs=3, default=[81, 480, 832], metavar=("FRAMES", "H", "W"))
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-real", action="store_true", help="skip the real-config VAE")
    ap.add_argument("--world", action="store_true", help="also the world's trained VAE and reward")
    ap.add_argument("--world-videos", type=int, default=64)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "cases": []}
    if not args.no_real:
        results["cases"].append(real_case(args, device))
    if args.world:
        results["cases"].append(world_case(args, device))
    (args.out / "decode_precision.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "| case | fp32 s/video | bf16 s/video | speed-up | max / mean abs Δ frame | reward: fp32 mean → bf16 (max abs Δ) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in results["cases"]:
        rw = "; ".join(
            f"{k} {v['float32_mean']:.4f} → {v['bfloat16_mean']:.4f} ({v['max_abs_change']:.2e})"
            for k, v in c.items()
            if isinstance(v, dict)
        )
        lines.append(
            f"| {c['case']} | {c['float32_s_per_video']:.3f} | {c['bfloat16_s_per_video']:.3f} | "
            f"{c['speedup']:.2f}x | {c['frames_max_abs_diff']:.2e} / {c['frames_mean_abs_diff']:.2e} | {rw} |"
        )
    (args.out / "decode_precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
