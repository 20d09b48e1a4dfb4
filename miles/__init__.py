"""miles: RL post-training of Wan video diffusion transformers with USP sequence parallelism."""

import logging


class _NoTorchvisionNotice(logging.Filter):
    """Drops transformers' notice that an image processor (``CLIPImageProcessor``, asked for by
    diffusers' pipeline loading even for a model without one) falls back to its PIL backend without
    torchvision: torchvision is not a dependency, so that backend is the one every run uses, and the
    notice printed once per rank in runs that have no image processor at all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_NoTorchvisionNotice())
