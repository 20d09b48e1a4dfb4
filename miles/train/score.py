"""Score a rollout: decode its videos, reward them, gather the rewards over sp and dp, shape
them (``reward.normalize``) and normalise them within each prompt group into advantages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from miles.config import Config
from miles.eval.videos import to_uint8
from miles.grpo.advantages import group_advantages
from miles.models.family import FamilyModel
from miles.parallel.topology import ParallelMesh
from miles.rewards.shaping import shaped_reward
from miles.rollout.batch import RolloutBatch, Scores
from miles.train.overlap import decode_and_score

__all__ = ["NonFiniteError", "score"]


class NonFiniteError(RuntimeError):
    """A reward, loss or gradient norm that is NaN or inf: the run stops, keeping the last good checkpoint."""


def _score_inputs(model: FamilyModel, batch: RolloutBatch, sl: slice) -> tuple:
    """What the rewards score a micro-batch's videos against: its prompts, and for
    image-to-video its given first frames (rewards may check consistency with them)."""
    if model.condition_mode is None:
        return (batch.prompts[sl],)
    return (batch.prompts[sl], batch.images[sl])


def _decoded(model: FamilyModel, chunk, device: torch.device) -> torch.Tensor:
    """A micro-batch's frames: decoded during the rollout (``rollout.overlap_decode``), else now."""
    if chunk.video is None:
        return model.decode(chunk.rollout.final_latents)
    return chunk.video.result().to(device)


def score(
    batch: RolloutBatch,
    rewards,
    *,
    cfg: Config,
    model: FamilyModel,
    mesh: ParallelMesh,
    device: torch.device,
    keep_videos: bool = False,
    step: int = 0,
) -> Scores:
    """Decode and reward this rank's share of the micro-batches, then group-normalise.

    sp peers hold the same samples, so each decodes and scores only every sp-th micro-batch
    (the VAE decode is most of the cost) and a sum over the sp group — every sample has
    exactly one non-zero contributor, so the sum is exact — gives every peer all the rewards.
    Rewards are scored per micro-batch, the same composition in every layout, and gathered
    over dp for the group statistics. ``rewards``: the run's reward mix; ``keep_videos``: keep
    uint8 CPU copies of the decoded videos to log; ``step``: optimizer steps taken (for errors).
    Sets ``batch.advantages`` and ``batch.rewards`` (this rank's samples) and returns every dp
    rank's :class:`Scores`.
    """
    sp, sp_rank = mesh.sp_size, mesh.sp_rank
    n = batch.group_ids.numel()
    local = torch.zeros(1 + len(rewards.names), n, device=device)
    videos, video_prompts, video_rewards = [], [], []
    # A worker scores micro-batch k while this thread decodes k + 1 (miles.train.overlap).
    mine = [chunk for c, chunk in enumerate(batch.chunks) if c % sp == sp_rank]
    # Each video is dropped once scored; rank 0 keeps uint8 CPU copies when this rollout logs videos.
    logged = keep_videos
    results = decode_and_score(
        mine,
        lambda chunk: _decoded(model, chunk, device),
        lambda video, chunk: rewards(video, *_score_inputs(model, batch, chunk.slice)),
        lambda video, chunk: [to_uint8(v) for v in video] if logged else None,
    )
    for chunk, kept, (combined, per_reward) in results:
        sl = chunk.slice
        local[:, sl] = torch.stack([combined, *(per_reward[k] for k in rewards.names)]).to(device)
        if kept is not None:
            videos += kept
            video_prompts += batch.prompts[sl]
            video_rewards += combined.tolist()
    if sp > 1:
        dist.all_reduce(local, group=mesh.sp_group)
    gathered = [torch.empty_like(local) for _ in range(mesh.dp_size)]
    dist.all_gather(gathered, local, group=mesh.dp_group)
    everything = torch.cat(gathered, dim=1)
    local_ids = batch.group_ids.to(device)  # NCCL gathers device tensors only
    ids = [torch.empty_like(local_ids) for _ in range(mesh.dp_size)]
    dist.all_gather(ids, local_ids, group=mesh.dp_group)
    n = batch.group_ids.numel()
    per_reward_all = {name: everything[1 + i] for i, name in enumerate(rewards.names)}
    trained = everything[0]
    if any(mode != "none" for mode in cfg.reward.normalize.values()):
        trained = shaped_reward(per_reward_all, rewards.weights, cfg.reward.normalize, torch.cat(ids))
    advantages = group_advantages(
        trained,
        torch.cat(ids),
        global_std=cfg.grpo.global_std,
        adv_clip_max=cfg.grpo.adv_clip_max,
    )
    if cfg.grpo.negate_advantages:  # the negative control: must not learn
        advantages = -advantages
    mine = slice(mesh.dp_rank * n, (mesh.dp_rank + 1) * n)
    batch.advantages = advantages[mine].to(device)
    batch.rewards = trained[mine].to(device)  # the trained reward itself (DPO's reward margin)
    scores = Scores(
        reward_all=everything[0],
        shaped_all=trained,
        per_reward_all=per_reward_all,
        advantages_all=advantages,
        videos=videos or None,  # (F, H, W, 3) uint8 of the micro-batches this rank decoded, if logged
        video_prompts=video_prompts,
        video_rewards=video_rewards,
    )
    if not torch.isfinite(everything).all():
        raise NonFiniteError(f"a reward is NaN or inf at rollout {batch.rollout_index} (step {step + 1})")
    return scores
