"""The world's supervised data: renders of the TRAINING prompts as a video JSONL for ``algorithm.name sft``.

    python -m miles.world.sft_data .cache/world_sft            # 24 prompts x 16 renders, frame folders
    python -m miles.world.sft_data .cache/world_sft_i2v --with-image   # + each first frame, for I2V
    train_grpo.py --config configs/world_cpu.yaml --algorithm.name sft \\
        --data.prompt-file .cache/world_sft/train.jsonl

Perfect data for the world: every video is the renderer's own output for its caption (lossless PNG
frames), so SFT on it is the supervised reference for what RL reaches on the held-out prompts, which
neither sees. Render k of a prompt uses seed ``SEED_OFFSET + k``, seeds pretraining never drew
(it used 0.. and 10 000..), so the data is new videos of the same training prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from miles.world.world import read_prompt_file, render_prompt

SEED_OFFSET = 1_000_000


def write_world_sft(
    out_dir: str | Path, videos_per_prompt: int = 16, split: str = "train", with_image: bool = False
) -> Path:
    """Render ``videos_per_prompt`` videos of every prompt of ``split`` into frame folders under
    ``out_dir`` and write ``out_dir/<split>.jsonl``; returns its path. ``with_image``: each line also
    gives its video's first frame as ``image`` (image-to-video, ``configs/world_i2v_cpu.yaml``).
    Rewrites nothing that is already complete (the JSONL is written last, atomically)."""
    from PIL import Image

    out_dir = Path(out_dir)
    jsonl = out_dir / f"{split}.jsonl"
    if jsonl.is_file() and len(jsonl.read_text().splitlines()) == videos_per_prompt * len(
        read_prompt_file(split)
    ):
        return jsonl
    lines = []
    for p, prompt in enumerate(read_prompt_file(split)):
        for k in range(videos_per_prompt):
            folder = out_dir / split / f"{p:03d}_{k:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            video = render_prompt(prompt, SEED_OFFSET + k)  # (F, 3, H, W) in [0, 1]
            frames = (video.permute(0, 2, 3, 1).numpy() * 255.0).round().astype(np.uint8)
            for f, frame in enumerate(frames):
                Image.fromarray(frame).save(folder / f"{f:03d}.png")
            record = {"video": str(folder.relative_to(out_dir)), "prompt": prompt}
            if with_image:
                record["image"] = str((folder / "000.png").relative_to(out_dir))
            lines.append(json.dumps(record))
    tmp = jsonl.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(jsonl)
    return jsonl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="folder for the JSONL and its frame folders")
    p.add_argument("--videos-per-prompt", type=int, default=16, help="renders of each prompt (seeds differ)")
    p.add_argument("--split", choices=("train", "heldout"), default="train", help="which prompts to render")
    p.add_argument("--with-image", action="store_true", help="give each video's first frame as 'image' (I2V)")
    args = p.parse_args()
    print(write_world_sft(args.out_dir, args.videos_per_prompt, args.split, args.with_image))


if __name__ == "__main__":
    main()
