"""What a run argument of ``python -m miles.compare`` names, and its per-sample held-out scores.

A run argument is one of

- a run directory: its export (``export/pipeline``, or ``export/merged`` for LoRA), else its newest
  complete checkpoint; its ``metrics.jsonl`` and ``eval.jsonl`` give the curves;
- an exported pipeline folder (``model_index.json``), e.g. the prior ``miles/world/pipeline``;
- a checkpoint folder (``COMPLETE``, ``trainer.json``): the base model and LoRA settings are the
  checkpoint's own, as ``python -m miles.eval --checkpoint`` loads it;
- an evaluation JSON a run or ``python -m miles.eval`` wrote (``<run>/eval/step_N.json``): its
  per-sample scores are read, nothing is sampled.

Models are sampled by ``miles.eval.evaluate`` with one config (prompts, seeds, rollout settings,
rewards and ``eval.seed``, which fixes the noise), so every run sees the same samples' noise.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

_STEP = re.compile(r"step_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Source:
    label: str
    kind: str  # "pipeline", "checkpoint" or "eval_json"
    path: Path
    run_dir: Path | None


def _newest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / "checkpoints"
    found = [p for p in root.glob("step_*") if _STEP.search(p.name) and (p / "COMPLETE").is_file()]
    return max(found, key=lambda p: int(_STEP.search(p.name).group(1)), default=None)


def resolve(spec: str, label: str | None = None) -> Source:
    """The source a run argument names (see the module docstring); a ValueError names what it expected."""
    path = Path(spec)
    if path.is_file() and path.suffix == ".json":
        run_dir = path.parent.parent if path.parent.name == "eval" else None
        return Source(label or (run_dir.name if run_dir else path.stem), "eval_json", path, run_dir)
    if not path.is_dir():
        raise ValueError(f"{spec}: no such run directory, pipeline, checkpoint or evaluation JSON")
    if (path / "model_index.json").is_file():
        run_dir = path.parent.parent if path.parent.name == "export" else None
        return Source(label or (run_dir.name if run_dir else path.name), "pipeline", path, run_dir)
    if (path / "COMPLETE").is_file() and (path / "trainer.json").is_file():
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
        return Source(label or (run_dir.name if run_dir else path.name), "checkpoint", path, run_dir)
    for export in ("export/pipeline", "export/merged"):
        if (path / export / "model_index.json").is_file():
            return Source(label or path.name, "pipeline", path / export, path)
    if (checkpoint := _newest_checkpoint(path)) is not None:
        return Source(label or path.name, "checkpoint", checkpoint, path)
    raise ValueError(
        f"{spec} holds no export (export/pipeline, export/merged), no complete checkpoint and is no "
        "pipeline folder: give a run directory, an exported pipeline, a checkpoint or an eval JSON"
    )


def scores_of_json(path: Path) -> dict:
    """The per-sample scores an evaluation JSON holds: ``names`` and ``scores`` keyed by (prompt, seed)."""
    samples = json.loads(Path(path).read_text())["samples"]
    names = [k for k in samples[0] if k not in ("prompt", "seed", "cell")]
    return {
        "names": names,
        "scores": {(s["prompt"], s["seed"]): {n: float(s[n]) for n in names} for s in samples},
    }


def scores_of_result(result: dict) -> dict:
    """The same from ``miles.eval.evaluate``'s result."""
    names = result["names"]
    return {
        "names": names,
        "scores": {
            (p, s): {n: float(result["scores"][k, i]) for k, n in enumerate(names)}
            for i, (p, s) in enumerate(zip(result["prompts"], result["seeds"]))
        },
    }


def load_model(source: Source, cfg, device: torch.device):
    """The model a pipeline or checkpoint source names, cast as the trainer computes, in eval mode."""
    from miles.config import ModelConfig
    from miles.eval.__main__ import _compute_in, load_checkpoint_weights
    from miles.files import verify_checkpoint
    from miles.models.wan import load_wan

    if source.kind == "checkpoint":
        verify_checkpoint(source.path)  # whole, and every file's sha256 as saved
        saved = json.loads((source.path / "trainer.json").read_text())["config"]["model"]
        model_cfg = ModelConfig(**saved)
    else:  # an export is a whole pipeline: no adapters to add
        model_cfg = dataclasses.replace(cfg.model, path=str(source.path), lora_rank=0)
    model = load_wan(model_cfg, device)
    if source.kind == "checkpoint":
        load_checkpoint_weights(model, source.path, model_cfg)
    for t in model.transformers:
        _compute_in(t.eval(), model_cfg.dtype)
    return model


def evaluate_source(source: Source, cfg, rewards, device: torch.device, out_dir: Path) -> dict:
    """Sample and score the held-out prompts with ``source``'s weights (``miles.eval.evaluate``);
    writes ``out_dir/<label>/eval.json`` and returns the per-sample scores."""
    from miles.data.prompts import load_prompts
    from miles.eval.evaluate import eval_settings, evaluate, write_eval

    if source.kind == "eval_json":
        return scores_of_json(source.path)
    held_out = load_prompts(cfg.eval.prompt_file)
    model = load_model(source, cfg, device)
    image_to_video = model.condition_mode is not None
    result = evaluate(
        model,
        rewards,
        [p.text for p in held_out],
        cfg.eval.num_seeds,
        eval_settings(cfg, model),
        negative_prompt=cfg.data.negative_prompt,
        max_sequence_length=cfg.data.max_sequence_length,
        device=device,
        keep_videos=False,
        images=[p.image for p in held_out] if image_to_video else None,
    )
    write_eval(result, out_dir / source.label, "eval")
    return scores_of_result(result)
