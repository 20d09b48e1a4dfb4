"""CPU cost per clip of each reward, at the real scorers' sizes with random weights.

    python bench/reward_cost.py --out bench/results            # writes reward_cost_cpu.json
    python bench/reward_cost.py --out bench/results --only jpeg_incompressibility,clipscore

Each reward is built through its real loading path from a tiny random folder (no weights can be
downloaded here), then the CLIP scorers' models are swapped for randomly initialised models of
the real architectures (ViT-B/32 for clipscore, ViT-L/14 for aesthetic, ViT-H/14 for pickscore
and hpsv2) with their 224-pixel processors: the cost of a forward does not depend on the weight
values. ``videoalign`` is timed at the tiny build only (Qwen2-VL-2B in fp32 needs ~9 GB and
minutes per clip on two cores; time it on a GPU). Clips are 81 frames at 480x832 for the frame
rewards (which sample ``num_frames`` = 4 of them) and the world's 9 x 64 x 64 for
``world_adherence``. Two numbers per reward, each the median of ``--repeats`` calls on a batch of
``--batch`` clips divided by the batch, with ``torch.get_num_threads()`` threads: wall seconds, and
CPU seconds (``time.process_time``, all threads), which a busy shared machine inflates less. The
load average is recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from miles.rewards import build_rewards, tiny_clip
from miles.rewards.tiny_videoalign import tiny_videoalign

CLIP_ARCH = {  # (vision width, layers, heads, patch, mlp; text width, layers, heads, mlp; projection)
    "ViT-B/32": (768, 12, 12, 32, 3072, 512, 12, 8, 2048, 512),
    "ViT-L/14": (1024, 24, 16, 14, 4096, 768, 12, 12, 3072, 768),
    "ViT-H/14": (1280, 32, 16, 14, 5120, 1024, 24, 16, 4096, 1024),
}
REWARD_ARCH = {"clipscore": "ViT-B/32", "aesthetic": "ViT-L/14", "pickscore": "ViT-H/14", "hpsv2": "ViT-H/14"}


def real_size_clip(arch: str):
    """A random CLIPModel of ``arch`` and a 224-pixel processor reusing the tiny tokenizer."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    vw, vl, vh, patch, vm, tw, tl, th, tm, proj = CLIP_ARCH[arch]
    config = CLIPConfig(
        vision_config=dict(
            hidden_size=vw,
            num_hidden_layers=vl,
            num_attention_heads=vh,
            patch_size=patch,
            intermediate_size=vm,
        ),
        text_config=dict(hidden_size=tw, num_hidden_layers=tl, num_attention_heads=th, intermediate_size=tm),
        projection_dim=proj,
    )
    config.vision_config.image_size = 224
    torch.manual_seed(0)
    model = CLIPModel(config).eval().requires_grad_(False)
    return model, CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})


def build(name: str, tmp: Path):
    """The reward ``name`` built through its loader; CLIP scorers get a real-size random model."""
    clip = str(tmp / "clip")
    head = tmp / "head.pth"
    options = {
        "clipscore": dict(model_path=clip),
        "pickscore": dict(model_path=clip),
        "hpsv2": dict(model_path=tmp / "hps.pt", processor_path=clip),
        "aesthetic": dict(clip_path=clip, head_path=head),
        "videoalign": dict(model_path=tmp / "videoalign"),
    }
    reward = build_rewards({name: 1.0}, {name: options[name]} if name in options else None).rewards[name]
    if name in REWARD_ARCH:
        model, image_processor = real_size_clip(REWARD_ARCH[name])
        reward.model, reward.processor.image_processor = model, image_processor
        if name == "aesthetic":
            from miles.rewards.aesthetic import aesthetic_head

            dims = [model.config.projection_dim, 1024, 128, 64, 16, 1]
            state = {}
            for i, (a, b) in zip((0, 2, 4, 6, 7), zip(dims[:-1], dims[1:])):
                state.update(
                    {f"layers.{i}.weight": torch.randn(b, a) * 0.01, f"layers.{i}.bias": torch.zeros(b)}
                )
            reward.head = aesthetic_head(state)
    return reward


def prepare(tmp: Path) -> None:
    """The tiny folders the loaders read (and an OpenCLIP-format checkpoint for hpsv2)."""
    from transformers import CLIPModel

    from miles.rewards.hpsv2 import _TOP

    tiny_clip(tmp / "clip")
    tiny_videoalign(tmp / "videoalign")
    sd = CLIPModel.from_pretrained(tmp / "clip").state_dict()
    torch.save({"state_dict": to_open_clip(sd, _TOP)}, tmp / "hps.pt")
    dims = [16, 1024, 128, 64, 16, 1]
    state = {}
    for i, (a, b) in zip((0, 2, 4, 6, 7), zip(dims[:-1], dims[1:])):
        state.update({f"layers.{i}.weight": torch.zeros(b, a), f"layers.{i}.bias": torch.zeros(b)})
    torch.save(state, tmp / "head.pth")


def to_open_clip(sd: dict, top: dict) -> dict:
    """transformers CLIP tensors back under OpenCLIP names (the inverse of hpsv2's conversion)."""
    inv = {v: k for k, v in top.items()}
    out = {inv[k]: v for k, v in sd.items() if k in inv}
    out["visual.proj"], out["text_projection"] = (
        sd["visual_projection.weight"].t(),
        sd["text_projection.weight"].t(),
    )
    names = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj"}
    names.update({"mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"})
    for tower, prefix in (("vision_model", "visual.transformer."), ("text_model", "transformer.")):
        layer = 0
        while f"{tower}.encoder.layers.{layer}.layer_norm1.weight" in sd:
            p, q = f"{tower}.encoder.layers.{layer}.", f"{prefix}resblocks.{layer}."
            for kind in ("weight", "bias"):
                qkv = [sd[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv"]
                out[f"{q}attn.in_proj_{kind}"] = torch.cat(qkv)
                for a, b in names.items():
                    out[f"{q}{b}.{kind}"] = sd[f"{p}{a}.{kind}"]
            layer += 1
    return out


def clips(name: str, batch: int) -> tuple[torch.Tensor, list[str]]:
    if name == "world_adherence":
        from miles.world import render_prompt, train_prompts

        prompts = train_prompts()[:batch]
        return torch.stack([render_prompt(p, seed=i) for i, p in enumerate(prompts)]), prompts
    g = torch.Generator().manual_seed(0)
    return torch.rand(batch, 81, 3, 480, 832, generator=g), ["a red fox jumps over a lazy dog"] * batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    default = (
        "jpeg_incompressibility,sharpness,world_adherence,clipscore,aesthetic,pickscore,hpsv2,videoalign"
    )
    p.add_argument("--only", default=default, help="comma-separated rewards to time")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prepare(tmp)
        for name in args.only.split(","):
            reward = build(name, tmp)
            videos, prompts = clips(name, args.batch)
            reward(videos, prompts)  # warm-up
            wall, cpu = [], []
            for _ in range(args.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                reward(videos, prompts)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            size = "tiny build" if name == "videoalign" else REWARD_ARCH.get(name, "-")
            row = {"reward": name, "model": size, "clip": list(videos.shape[1:])}
            row.update(
                wall_s_per_clip=statistics.median(wall) / args.batch,
                cpu_s_per_clip=statistics.median(cpu) / args.batch,
            )
            row["load_avg_1min"] = os.getloadavg()[0]
            rows.append(row)
            print(
                f"{name:24s} {size:10s} wall {row['wall_s_per_clip']:8.3f} s/clip  cpu {row['cpu_s_per_clip']:8.3f} s/clip  "
                f"(clip {tuple(videos.shape[1:])}, load {row['load_avg_1min']:.1f})",
                flush=True,
            )
            del reward
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    (out / "reward_cost_cpu.json").write_text(
        json.dumps({"meta": meta, "batch": args.batch, "rows": rows}, indent=1)
    )
    print(f"wrote {out / 'reward_cost_cpu.json'}")


if __name__ == "__main__":
    main()
