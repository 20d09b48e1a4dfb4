"""Prompts the text encoder will cut short: one warning per prompt file, alike in the dry run and the
real run (both call :func:`truncation_warnings` with the model folder's tokenizer).

The text encoder sees at most ``data.max_sequence_length`` tokens; a longer prompt is truncated
without an error, so the run warns once per file with the count before the first rollout.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from miles.config import Config
from miles.data.prompts import TINY_PROMPTS, truncation_warning


def truncation_warnings(cfg: Config, tokenizer: Any, prompts: Sequence, held_out: Sequence) -> list[str]:
    """The warning line for the training prompts and for the held-out ones that are too long."""
    found = []
    for texts, source in ((prompts, cfg.data.prompt_file or TINY_PROMPTS), (held_out, cfg.eval.prompt_file)):
        if texts and (w := truncation_warning(texts, tokenizer, cfg.data.max_sequence_length, source)):
            found.append(w)
    return found


def warn_truncated_prompts(
    cfg: Config, tokenizer: Any, prompts: Sequence, held_out: Sequence, rank: int
) -> None:
    """Rank 0 prints :func:`truncation_warnings` as ``[miles] warning: ...`` lines on stderr."""
    if rank != 0 or tokenizer is None:
        return
    for warning in truncation_warnings(cfg, tokenizer, prompts, held_out):
        print(f"[miles] warning: {warning}", file=sys.stderr, flush=True)
