"""Text embeddings of a rollout's prompts, each unique prompt encoded once, kept on the CPU.

    cache = PromptCache(model.pipeline, negative_prompt="", max_sequence_length=512,
                        device=device, offload=True)
    cache.start_rollout(prompts)          # one encoder visit: every new unique prompt
    pos = cache.embeds(prompts[sl])       # (B, L, D) on the CPU; the sampler moves it per forward
    neg = cache.negative()                # (1, L, D): encoded once per run

A rollout repeats each prompt over its GRPO group and, before this cache, every micro-batch
re-encoded its prompts and the constant negative prompt on every rank. Here each unique prompt
is encoded once per rollout (``start_rollout`` drops the previous rollout's rows, so the host
memory is bounded by one rollout's prompts) and the negative prompt once per run. The rows are
the pipeline's own ``encode_prompt`` output (padded to ``max_sequence_length``), so they equal
the batched encoding's rows — bitwise on the CPU in fp32 (``tests/unit/test_prompt_cache.py``).

``offload``: the text encoder (UMT5-XXL: 11.4 GB in bf16) is parked on the CPU and visits
``device`` only to encode, whether it was loaded onto the GPU or the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor


class PromptCache:
    """Encode-once text embeddings (CPU) for the prompts of one rollout and the negative prompt."""

    def __init__(
        self,
        pipeline,
        *,
        negative_prompt: str,
        max_sequence_length: int,
        device: torch.device | str,
        offload: bool,
        batch_size: int = 8,
        encode_texts=None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.pipeline = pipeline
        self.negative_prompt = negative_prompt
        self.max_sequence_length = max_sequence_length
        self.device = torch.device(device)
        self.offload = offload
        self.batch_size = batch_size
        self.encode_texts = encode_texts
        self._rows: dict[str, Tensor] = {}
        self._negative: Tensor | None = None
        self.num_encoder_visits = 0
        """How often the encoder ran (one visit to ``device`` per call that found new prompts)."""
        self.num_encoded = 0
        """Texts encoded so far, the negative prompt included."""
        if offload:
            pipeline.text_encoder.to("cpu")

    @contextlib.contextmanager
    def _encoder_on_device(self):
        encoder = self.pipeline.text_encoder
        encoder.to(self.device)
        try:
            yield
        finally:
            if self.offload and self.device.type != "cpu":
                encoder.to("cpu")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _encode(self, texts: list[str]) -> Tensor:
        """(N, L, D) embeddings of ``texts`` on the CPU, the pipeline's encoder output as is (or
        the model family's text condition: ``encode_texts(texts, max_sequence_length, device)``)."""
        if self.encode_texts is not None:
            embeds = self.encode_texts(texts, self.max_sequence_length, self.device)
        else:
            embeds, _ = self.pipeline.encode_prompt(
                prompt=texts,
                do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
                device=self.device,
            )
        self.num_encoded += len(texts)
        return embeds.cpu()

    @torch.no_grad()
    def prepare(self, prompts: Sequence[str]) -> None:
        """Encode, in one encoder visit, the negative prompt (first time only) and every prompt
        not cached yet (each unique prompt once, in batches of ``batch_size``)."""
        new = [p for p in dict.fromkeys(prompts) if p not in self._rows]
        if not new and self._negative is not None:
            return
        self.num_encoder_visits += 1
        with self._encoder_on_device():
            if self._negative is None:
                self._negative = self._encode([self.negative_prompt])
            for i in range(0, len(new), self.batch_size):
                texts = new[i : i + self.batch_size]
                for text, row in zip(texts, self._encode(texts)):
                    self._rows[text] = row

    def start_rollout(self, prompts: Sequence[str]) -> None:
        """Forget the previous rollout's prompts and encode this rollout's (one encoder visit)."""
        self._rows.clear()
        self.prepare(prompts)

    def embeds(self, prompts: Sequence[str]) -> Tensor:
        """(B, L, D) CPU embeddings of ``prompts``, one row each (encoding any not cached yet)."""
        if not prompts:
            raise ValueError("embeds() needs at least one prompt")
        self.prepare(prompts)
        return torch.stack([self._rows[p] for p in prompts])

    def negative(self) -> Tensor:
        """(1, L, D) CPU embedding of the negative prompt, encoded once per run."""
        if self._negative is None:
            self.prepare([])
        return self._negative
