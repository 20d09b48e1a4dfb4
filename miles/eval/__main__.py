"""Evaluate an exported pipeline or a training checkpoint on a prompt file: JSON + a video grid.

    python -m miles.eval --config configs/world_cpu.yaml --model.path runs/world_cpu/export/pipeline \\
        --eval.prompt-file miles/world/prompts_heldout.txt --out runs/world_cpu/eval_export
    python -m miles.eval --config configs/world_cpu.yaml --checkpoint runs/world_cpu/checkpoints/step_000040 \\
        --out /tmp/eval --eval.sampler pipeline
    torchrun --nproc-per-node 4 -m miles.eval ...        # the samples split over 4 data-parallel ranks

The recipe gives the rollout settings (frames, size, steps, shift, CFG), the rewards and the eval
section (prompts, seeds, sampler); any field can be overridden as for ``train_grpo.py``. With
``--checkpoint`` the base model and LoRA settings come from the checkpoint's own config and its
trained weights are loaded on top (no process group or trainer needed), after every file of the
checkpoint was checked against the sha256 saved with it (a changed file is named, exit 2). Writes
``OUT/eval.json`` (summary and every sample's scores) and ``OUT/eval.mp4`` (the grid; GIF without an mp4 encoder) and prints
the summary. Sampling is the trainer's evaluation exactly (``miles.eval.evaluate``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from miles.config import Config, ConfigError, ModelConfig, parse_args
from miles.console import configure_library_progress, show_progress
from miles.files import check_writable, verify_checkpoint
from miles.parallel.gloo import one_worker_per_gloo_group


def load_checkpoint_weights(model, checkpoint: Path, model_cfg: ModelConfig) -> None:
    """Load a trainer checkpoint's weights (DCP) into the plain, unsharded experts of ``model``."""
    from torch import nn

    from miles.files import load_checkpoint_state
    from miles.models.fingerprint import check_base_model, model_fingerprint

    if not (checkpoint / "COMPLETE").is_file():
        raise ValueError(f"{checkpoint} is not a complete checkpoint (no COMPLETE marker)")
    if model_cfg.lora_rank > 0:
        from miles.models.lora import lora_config

        for t in model.transformers:
            t.add_adapter(lora_config(model_cfg))
    experts = nn.ModuleList(model.transformers)
    # Lean checkpoints hold the trained parameters only (LoRA: the adapters); the rest is the
    # model folder's, which must be the one the checkpoint was trained from.
    check_base_model(checkpoint, _saved(checkpoint).get("model_fingerprint"), model_fingerprint(model.path))
    trained = {k: v for k, v in experts.state_dict().items() if model_cfg.lora_rank == 0 or ".lora_" in k}
    state = {"model": trained}
    load_checkpoint_state(state, checkpoint, no_dist=True)  # data only (miles.files)
    experts.load_state_dict(state["model"], strict=model_cfg.lora_rank == 0)


def _saved(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer.json").read_text())


def _compute_in(transformer, dtype: str) -> None:
    """Cast as the trainer computes (miles.parallel.fsdp): every parameter in ``dtype`` except the
    ones diffusers keeps in fp32 outside the blocks."""
    if dtype == "float32":
        return
    keep = set(getattr(transformer, "_keep_in_fp32_modules", None) or [])
    for name, p in transformer.named_parameters():
        if name.startswith("blocks.") or not keep & set(name.split(".")):
            p.data = p.data.to(torch.bfloat16)


def _options(required: bool = True) -> argparse.ArgumentParser:
    """Eval's own options; every other flag is a config field, as for ``train_grpo.py``."""
    pre = argparse.ArgumentParser(
        prog="python -m miles.eval",
        add_help=False,
        description=__doc__.split("The recipe gives")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other option is a config field, given as for train_grpo.py (--config FILE, "
        "--eval.prompt-file FILE, --eval.num-seeds N, --model.path DIR, ...): `python train_grpo.py "
        "--help` lists them all.",
    )
    pre.add_argument(
        "--out", type=Path, required=required, help="folder for eval.json and the video grid (required)"
    )
    pre.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="a training checkpoint (runs/NAME/checkpoints/step_N): its base model, LoRA settings and "
        "trained weights (default: the model of --model.path / the recipe, untrained)",
    )
    pre.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return pre


def _parse(argv: list[str] | None) -> tuple[Config, Path, Path | None]:
    opts, rest = _options().parse_known_args(argv)
    cfg, _ = parse_args(rest)
    check_writable(opts.out, what="--out")  # found now, not after the sampling
    if opts.checkpoint is not None:
        verify_checkpoint(opts.checkpoint)  # whole, and every file's sha256 as saved
        saved = json.loads((opts.checkpoint / "trainer.json").read_text())["config"]["model"]
        cfg.model = ModelConfig(**saved)
    if not cfg.eval.prompt_file:
        raise ConfigError("give the prompts to evaluate: --eval.prompt-file FILE")
    return cfg, opts.out, opts.checkpoint


def main(argv: list[str] | None = None) -> int:
    from miles.data.prompts import check_prompt_images, load_prompts
    from miles.eval.evaluate import eval_settings, evaluate, summarize, write_eval
    from miles.models.family import family_of, model_folder
    from miles.rewards.from_config import build_configured_rewards
    from miles.rewards.shaping import EvalRewards

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:  # eval's own help, not the trainer's (and --out not needed)
        _options(required=False).print_help()
        return 0
    try:
        cfg, out, checkpoint = _parse(argv)
        configure_library_progress(show_progress(cfg.run.progress))  # no bars into a redirected log
        held_out = load_prompts(cfg.eval.prompt_file)
        prompts = [p.text for p in held_out]
        device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
        )
        device = device or torch.device("cpu")
        rewards = EvalRewards(*build_configured_rewards(cfg.reward, device))
        model = family_of(model_folder(cfg.model)).load(cfg.model, device)
        image_to_video = model.condition_mode is not None
        check_prompt_images(held_out, cfg.eval.prompt_file, image_to_video)  # image-to-video: an image each
        if checkpoint is not None:
            load_checkpoint_weights(model, checkpoint, cfg.model)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        one_worker_per_gloo_group()  # as the trainer: torch's two gloo workers race (issue 46)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    for t in model.transformers:
        _compute_in(t.eval(), cfg.model.dtype)
    settings = eval_settings(cfg, model)
    result = evaluate(
        model,
        rewards,
        prompts,
        cfg.eval.num_seeds,
        settings,
        negative_prompt=cfg.data.negative_prompt,
        max_sequence_length=cfg.data.max_sequence_length,
        device=device,
        dp_rank=rank,
        dp_size=world,
        dp_group=dist.group.WORLD if world > 1 else None,
        keep_videos=rank == 0 and cfg.eval.log_videos,
        images=[p.image for p in held_out] if image_to_video else None,
        progress=show_progress(cfg.run.progress),  # rank 0 on a terminal
    )
    if rank == 0:
        paths = write_eval(result, out, "eval")
        print(
            json.dumps(
                {"model": str(model.path), "checkpoint": str(checkpoint), **summarize(result)}, indent=1
            )
        )
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
