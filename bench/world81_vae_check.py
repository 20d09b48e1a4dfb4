"""Does the committed 8-channel world VAE reconstruct the world at larger shapes? (issue 42: "the VAE
may be the world's if its reconstructions score as the renders do")

    python bench/world81_vae_check.py --out docs/learning/world81/vae_check.json [--shapes 9x64x64 21x240x416]

For each shape: the held-out prompts' renders (seed 0) through ``miles/world/pipeline/vae``
(encode to the posterior mode, decode), each scored by ``world_adherence`` against its prompt, the
renders and the reconstructions side by side (mean of each check). 81 x 480 x 832 runs the same on
a GPU (a CPU takes minutes per video).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def check(shape, vae, device) -> dict:
    from miles.rewards.world import world_scores
    from miles.world.world import heldout_prompts, parse_prompt, render

    prompts = heldout_prompts()
    t0 = time.perf_counter()
    renders = torch.stack(
        [render(parse_prompt(p), 0, shape, device=device) for p in prompts]
    )  # (B, F, 3, H, W)
    recon = []
    with torch.no_grad():
        for video in renders:
            x = video.permute(1, 0, 2, 3)[None] * 2 - 1
            z = vae.encode(x).latent_dist.mode()
            recon.append(((vae.decode(z).sample[0].permute(1, 0, 2, 3) + 1) / 2).clamp(0, 1))
    recon = torch.stack(recon)
    out = {"shape": [shape.num_frames, shape.height, shape.width], "latent": list(z.shape[1:])}
    for name, videos in (("renders", renders), ("reconstructions", recon)):
        scores = world_scores(videos, prompts)
        out[name] = {k: round(float(v.mean()), 4) for k, v in scores.items()}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    from diffusers import AutoencoderKLWan

    from miles.world.world import Shape

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=["9x64x64", "21x240x416"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vae", default=str(ROOT / "miles/world/pipeline/vae"), help="an AutoencoderKLWan folder")
    args = p.parse_args()
    vae = AutoencoderKLWan.from_pretrained(args.vae, torch_dtype=torch.float32)
    vae = vae.to(args.device).eval()
    results = [check(Shape(*map(int, s.split("x"))), vae, args.device) for s in args.shapes]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"vae": args.vae, "results": results}, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
