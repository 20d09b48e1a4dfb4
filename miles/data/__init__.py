"""Prompt sets and the per-rank group sampler."""

from miles.data.prompts import TINY_PROMPTS, GroupBatch, GroupSampler, Prompt, load_prompts

__all__ = ["TINY_PROMPTS", "GroupBatch", "GroupSampler", "Prompt", "load_prompts"]
