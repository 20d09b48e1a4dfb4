"""Rank-aware console output shared by the trainer and the standalone tools: which rank this process
is, whether it draws progress bars (rank 0 on a terminal only), and the loading bars of diffusers and
transformers."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from tqdm import tqdm


def rank() -> int:
    return (
        dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    )


def show_progress(enabled: bool = True) -> bool:
    """Whether this process draws progress bars: rank 0 only, and only on a terminal (in a log file
    a bar is a stream of carriage returns and escape codes)."""
    return enabled and rank() == 0 and sys.stderr.isatty()


def configure_library_progress(show: bool) -> None:
    """The loading and saving bars of diffusers and transformers ("Loading pipeline components",
    "Loading weights", "Writing model shards"): on where ``show``, else off."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    for lib in (diffusers_logging, transformers_logging):
        (lib.enable_progress_bar if show else lib.disable_progress_bar)()


def progress_bar(items=None, desc: str = "", show: bool = False, total: int | None = None) -> tqdm:
    """A progress bar where ``show`` (:func:`show_progress`: rank 0 on a terminal), cleared when
    done; elsewhere a no-op with the same interface."""
    return tqdm(items, desc=desc, total=total, leave=False, disable=not show)
