"""The tiny world with its first frame given: image-to-video prompt sets and the I2V world model.

    python -m miles.world.i2v prompts miles/world/i2v   # (re)write the committed prompt sets
    python -m miles.world.i2v model .cache/world-i2v    # the I2V world pipeline (make world-i2v-model)

**Prompt sets.** Each record is a caption of the world's grammar with the first frame of a render
of it: ``{"prompt": "a big red ball moving left", "image": "images/train_00.png", "seed": 10000}``.
The image fixes the ball's colour, size and start; the text says the motion (and repeats colour
and size, as the T2V prior was captioned). The splits are the world's Latin-square split
(``miles.world.world``): the 24 training triples with ``NUM_TRAIN_IMAGES`` images each (48
prompts) and the 8 held-out triples with ``NUM_HELDOUT_IMAGES`` each (16), every image its own
render seed. The held-out seeds (20000 on) are disjoint from pretraining's (prior 0-47, VAE pool
10000-10015, training triples only); some training images are frames of the VAE pool's renders.

**Model.** ``build_i2v_world`` writes a Wan2.2-TI2V-style folder (a ``WanPipeline`` with
``expand_timesteps: true``, run with ``model.task: i2v``: the first latent frame is the encoded
image, kept clean by a per-token timestep of 0) whose components are symlinks to the committed
T2V world pipeline (``miles/world/pipeline``): no weights are copied and none are trained. The
T2V prior was never trained with a clean first frame; ``docs/learning.md`` measures how far it
follows one anyway, and what RL adds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from miles.world.world import all_attributes, is_heldout, prompt_for, render

PROMPT_DIR = Path(__file__).with_name("i2v")
"""The committed I2V prompt sets: ``train.jsonl``, ``heldout.jsonl`` and ``images/``."""
T2V_PIPELINE = Path(__file__).with_name("pipeline")
NUM_TRAIN_IMAGES = 2
NUM_HELDOUT_IMAGES = 2
SEED_OFFSET = {"train": 10_000, "heldout": 20_000}
"""First render seed of each split; record k of a split uses ``SEED_OFFSET[split] + k``."""


def i2v_records(split: str) -> list[dict]:
    """The records of ``split`` (``train`` or ``heldout``): prompt, image file name and render seed,
    triple-major (the order of ``all_attributes``), then image."""
    if split not in SEED_OFFSET:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(SEED_OFFSET)}")
    held = split == "heldout"
    per = NUM_HELDOUT_IMAGES if held else NUM_TRAIN_IMAGES
    triples = [a for a in all_attributes() if is_heldout(a) == held]
    records = []
    for k, (attrs, _) in enumerate((a, j) for a in triples for j in range(per)):
        seed = SEED_OFFSET[split] + k
        records.append({"prompt": prompt_for(attrs), "image": f"images/{split}_{k:02d}.png", "seed": seed})
    return records


def first_frame(prompt: str, seed: int) -> torch.Tensor:
    """The given first frame of a record: frame 0 of its render, (3, H, W) uint8."""
    from miles.world.world import parse_prompt

    return (render(parse_prompt(prompt), seed)[0] * 255).round().clamp(0, 255).to(torch.uint8)


def write_prompt_sets(out_dir: Path) -> list[Path]:
    """Write ``train.jsonl``, ``heldout.jsonl`` and their PNGs under ``out_dir``; returns the JSONL paths."""
    from PIL import Image

    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    paths = []
    for split in SEED_OFFSET:
        records = i2v_records(split)
        for r in records:
            pixels = first_frame(r["prompt"], r["seed"]).permute(1, 2, 0).numpy()
            Image.fromarray(pixels).save(out_dir / r["image"], optimize=True)
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths


def build_i2v_world(out_dir: Path, t2v: Path = T2V_PIPELINE) -> Path:
    """A TI2V-style folder at ``out_dir``: ``t2v``'s components (symlinked) with ``expand_timesteps``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = json.loads((t2v / "model_index.json").read_text())
    for name, spec in index.items():
        if isinstance(spec, list) and spec[0] is not None:
            link = out_dir / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to((t2v / name).resolve(), target_is_directory=True)
    index["expand_timesteps"] = True
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("prompts", "model"):
        raise SystemExit("usage: python -m miles.world.i2v {prompts|model} OUT_DIR")
    if argv[0] == "prompts":
        print("wrote", *write_prompt_sets(Path(argv[1])))
    else:
        print("I2V world pipeline written to", build_i2v_world(Path(argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
