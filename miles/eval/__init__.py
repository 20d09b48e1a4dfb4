"""Held-out evaluation, in the training loop and standalone (``python -m miles.eval``)."""

from miles.eval.evaluate import EvalSettings, evaluate, summarize, write_eval

__all__ = ["EvalSettings", "evaluate", "summarize", "write_eval"]
