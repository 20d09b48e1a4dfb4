"""Rewards for GRPO on decoded videos: a registry, the weighted mix, and the built-in rewards.

    rewards = build_rewards({"pickscore": 1.0, "jpeg_compressibility": 0.1},
                            {"pickscore": {"model_path": "/ckpt/PickScore_v1"}}, device="cuda", dtype="bfloat16")
    combined, per_reward = rewards(videos, prompts)  # videos (B, F, C, H, W) in [0, 1]

Built in: ``jpeg_compressibility``, ``jpeg_incompressibility`` (DDPO), ``pickscore`` (flow_grpo),
``sharpness`` (continuous, download-free), ``clipscore``, ``hpsv2`` (HPSv2.1), ``aesthetic`` (LAION),
``videoalign`` (a Qwen2-VL video reward), ``remote`` (a reward server), ``vlm_judge`` (an OpenAI-compatible VLM), ``world_adherence``.

Adding a reward: write its file (the reward, its options dataclass, ``@register_reward(name,
options=...)``) and import it below; its config section ``reward.NAME`` follows from the registry.
"""

from miles.rewards.aesthetic import Aesthetic
from miles.rewards.base import Reward, frames_to_uint8, sample_frame_indices
from miles.rewards.clipscore import CLIPScore
from miles.rewards.hpsv2 import HPSv2
from miles.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from miles.rewards.pickscore import PickScore
from miles.rewards.registry import (
    MultiReward,
    build_rewards,
    register_reward,
    registered_rewards,
    reward_option_classes,
)
from miles.rewards.remote import RemoteReward, RemoteRewardError
from miles.rewards.sharpness import Sharpness
from miles.rewards.tiny_clip import tiny_clip
from miles.rewards.videoalign import VideoAlign
from miles.rewards.vlm_judge import VLMJudge
from miles.rewards.world import WorldAdherence
from miles.rewards.world_i2v import WorldI2V

__all__ = [
    "Aesthetic",
    "CLIPScore",
    "HPSv2",
    "JpegCompressibility",
    "JpegIncompressibility",
    "MultiReward",
    "PickScore",
    "RemoteReward",
    "RemoteRewardError",
    "Reward",
    "Sharpness",
    "VideoAlign",
    "VLMJudge",
    "WorldAdherence",
    "WorldI2V",
    "build_rewards",
    "frames_to_uint8",
    "register_reward",
    "registered_rewards",
    "reward_option_classes",
    "sample_frame_indices",
    "tiny_clip",
]
