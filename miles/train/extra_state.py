"""What a checkpoint's ``trainer.json`` holds besides the counters: the lr scheduler's state
(``miles.train.schedule``), the algorithm's (a calibrated clip range, a raised KL coefficient) and
the over-optimisation guard's history (``miles.train.guard``). All JSON."""

from __future__ import annotations


def extra_state(lr_scheduler, algorithm, guard) -> dict:
    return {
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "algorithm": algorithm.state_dict(),
        "guard": guard.state_dict(),
    }


def load_extra_state(state: dict, lr_scheduler, algorithm, guard) -> None:
    """Restore what :func:`extra_state` saved (a checkpoint from before holds none of it: defaults)."""
    if lr_scheduler is not None and state.get("lr_scheduler"):  # the optimizer state holds the lr itself
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    algorithm.load_state_dict(state.get("algorithm") or {})
    guard.load_state_dict(state.get("guard") or {})
