"""The over-optimisation guard (``train.guard``): the trained reward rising while the held-out one falls.

Reward hacking shows as a training reward that keeps rising while what the reward stands for
falls on prompts the training never sees: the held-out score of a ``reward.gold`` reward (never
trained on), or else of the trained combination itself. At every held-out evaluation the guard
compares the last ``train.guard_window`` evaluation intervals: it fires when

    the training reward (mean of the rollouts since the previous evaluation; at the baseline
    evaluation, the first rollout's, sampled by the same weights) rose over the window, and
    the watched held-out mean fell by more than ``train.guard_margin`` over the same window.

Then, by ``train.guard``: ``warn`` prints it and trains on; ``stop`` also ends the run after this
evaluation (checkpoint as at any end) and names the best held-out evaluation and its checkpoint,
if one was saved at that step (``train.checkpoint_every`` = ``eval.every`` saves one at every
evaluation; ``train.keep_checkpoints 0`` keeps them); ``kl`` multiplies the KL coefficient by
``train.guard_kl_factor`` (the algorithm's ``scale_kl``; saved with the checkpoint) and trains on.
Every firing is one console line; the outcome line of a guarded run repeats the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Guard:
    action: str  # "off", "warn", "stop" or "kl"
    window: int
    margin: float
    watch: str  # the held-out metric's reward name (eval/<watch>/mean)
    rewards: list[float] = field(default_factory=list)  # training reward of each rollout since the last eval
    history: list[dict] = field(default_factory=list)  # per evaluation: step, train, heldout
    note: str = ""
    stopped: bool = False

    def train_reward(self, value: float) -> None:
        """One rollout's training reward mean. The baseline evaluation's training reward is the
        first rollout's (sampled by the same weights)."""
        if self.history and self.history[-1]["train"] is None and not self.rewards:
            self.history[-1]["train"] = float(value)
        self.rewards.append(float(value))

    def evaluation(self, step: int, metrics: dict) -> str | None:
        """A held-out evaluation's metrics (``eval/<name>/mean``); returns the firing line, or None."""
        key = f"eval/{self.watch}/mean"
        if self.action == "off" or key not in metrics:
            return None
        train = sum(self.rewards) / len(self.rewards) if self.rewards else None
        self.rewards = []
        self.history.append({"step": step, "train": train, "heldout": float(metrics[key])})
        if len(self.history) <= self.window:
            return None
        start, end = self.history[-1 - self.window], self.history[-1]
        if start["train"] is None or end["train"] is None:
            return None
        rose = end["train"] > start["train"]
        fell = start["heldout"] - end["heldout"] > self.margin
        if not (rose and fell):
            return None
        best = max(self.history, key=lambda h: h["heldout"])
        line = (
            f"over-optimisation guard ({self.action}): training reward rose {start['train']:.4f} -> "
            f"{end['train']:.4f} while held-out {self.watch} fell {start['heldout']:.4f} -> {end['heldout']:.4f} "
            f"(> {self.margin:g}) over steps {start['step']}-{end['step']}; best held-out {best['heldout']:.4f} "
            f"at step {best['step']}"
        )
        self.note = line
        self.stopped = self.action == "stop"
        return line

    def best_step(self) -> int | None:
        return max(self.history, key=lambda h: h["heldout"])["step"] if self.history else None

    def state_dict(self) -> dict:
        return {"rewards": self.rewards, "history": self.history, "note": self.note}

    def load_state_dict(self, state: dict) -> None:
        self.rewards = list(state.get("rewards", []))
        self.history = list(state.get("history", []))
        self.note = state.get("note", "")


def build_guard(cfg) -> Guard:
    """The guard of a run config: it watches the first gold reward, else the trained combination."""
    t = cfg.train
    watch = t.guard_reward or (cfg.reward.gold[0] if cfg.reward.gold else "reward")
    return Guard(action=t.guard, window=t.guard_window, margin=t.guard_margin, watch=watch)


def react(guard: Guard, step: int, metrics: dict, algorithm, train_cfg, run_dir, say) -> None:
    """After an evaluation: feed it to the guard and act on a firing (``say``: rank 0's print)."""
    from pathlib import Path

    line = guard.evaluation(step, metrics)
    if line is None:
        return
    if guard.action == "kl":
        beta = algorithm.scale_kl(train_cfg.guard_kl_factor)
        line += f"; KL coefficient raised to {beta:g}"
    elif guard.action == "stop":
        best = Path(run_dir) / "checkpoints" / f"step_{guard.best_step():06d}"
        if guard.best_step() == 0:
            kept = "the best are the initial weights, model.path"
        elif (best / "COMPLETE").is_file():
            kept = f"its checkpoint {best}"
        else:
            kept = "no checkpoint was saved at that step"
        line += f"; stopping after this evaluation ({kept})"
    guard.note = line
    say(f"[miles] {line}")
