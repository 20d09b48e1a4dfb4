"""The over-optimisation guard (``train.guard``, ``miles.train.guard``): it fires when the training
reward rose while the watched held-out reward fell by more than the margin over the window, and
not otherwise; its actions; its config checks."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, parse_args
from miles.train.guard import Guard, build_guard, react


def _feed(guard: Guard, points: list[tuple[float | None, float]]) -> list[str | None]:
    """(training reward of the interval, held-out) per evaluation; the first is the baseline."""
    out = []
    for i, (train, heldout) in enumerate(points):
        if train is not None:
            guard.train_reward(train - 0.01)
            guard.train_reward(train + 0.01)  # two rollouts per interval: their mean is ``train``
        out.append(guard.evaluation(10 * i, {"eval/gold/mean": heldout}))
    return out


def test_fires_only_when_the_training_reward_rises_and_the_heldout_falls_past_the_margin():
    hacked = [(None, 0.40), (0.50, 0.42), (0.55, 0.41), (0.60, 0.39)]
    fired = _feed(Guard("warn", window=2, margin=0.02, watch="gold"), hacked)
    assert fired[:3] == [None, None, None]  # window 2 needs 3 evaluations; 0.42 -> 0.41 is within the margin
    assert fired[3] is not None  # 0.50 -> 0.60 while 0.42 -> 0.39 (> 0.02) over steps 10-30
    assert (
        "0.5000 -> 0.6000" in fired[3]
        and "0.4200 -> 0.3900" in fired[3]
        and "best held-out 0.4200 at step 10" in fired[3]
    )
    learning = [(None, 0.40), (0.50, 0.42), (0.55, 0.45), (0.60, 0.47)]
    assert _feed(Guard("warn", 2, 0.02, "gold"), learning) == [None] * 4
    collapsing = [(None, 0.40), (0.50, 0.42), (0.45, 0.35), (0.40, 0.30)]  # both fall: not hacking
    assert _feed(Guard("warn", 2, 0.02, "gold"), collapsing) == [None] * 4
    assert _feed(Guard("off", 2, 0.02, "gold"), hacked) == [None] * 4


def test_the_baseline_evaluation_takes_the_first_rollouts_training_reward():
    g = Guard("warn", window=1, margin=0.0, watch="gold")
    g.evaluation(0, {"eval/gold/mean": 0.40})
    for r in (0.30, 0.50):  # the first rollout (sampled by the baseline's weights), then one more
        g.train_reward(r)
    line = g.evaluation(4, {"eval/gold/mean": 0.35})
    assert g.history[0]["train"] == 0.30 and g.history[1]["train"] == 0.40
    assert line is not None and "rose 0.3000 -> 0.4000" in line and "fell 0.4000 -> 0.3500" in line


class _Algo:
    def __init__(self):
        self.kl = 1e-3

    def scale_kl(self, factor):
        self.kl *= factor
        return self.kl


def test_actions_stop_names_the_best_checkpoint_and_kl_raises_the_coefficient(tmp_path):
    class T:
        guard_kl_factor = 4.0

    (tmp_path / "checkpoints" / "step_000010").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000010" / "COMPLETE").write_text("")
    lines = []
    stop = Guard("stop", 2, 0.02, "gold")
    for i, (train, heldout) in enumerate([(None, 0.40), (0.50, 0.42), (0.55, 0.41), (0.60, 0.39)]):
        if train is not None:
            stop.train_reward(train)
        react(stop, 10 * i, {"eval/gold/mean": heldout}, None, T, tmp_path, lines.append)
    assert stop.stopped and len(lines) == 1 and str(tmp_path / "checkpoints/step_000010") in lines[0]
    assert stop.note == lines[0][len("[miles] ") :]
    algo, kl = _Algo(), Guard("kl", 2, 0.02, "gold")
    for i, (train, heldout) in enumerate([(None, 0.40), (0.50, 0.42), (0.55, 0.41), (0.60, 0.39)]):
        if train is not None:
            kl.train_reward(train)
        react(kl, 10 * i, {"eval/gold/mean": heldout}, algo, T, tmp_path, lines.append)
    assert algo.kl == pytest.approx(4e-3) and not kl.stopped and "KL coefficient raised to 0.004" in lines[-1]
    resumed = Guard("stop", 2, 0.02, "gold")
    resumed.load_state_dict(stop.state_dict())
    assert resumed.history == stop.history and resumed.best_step() == 10


def test_config_watches_gold_first_and_refuses_what_cannot_work():
    cfg, _ = parse_args(["--config", "configs/world_cpu.yaml", "--train.guard", "warn"])
    assert build_guard(cfg).watch == "reward"  # no gold reward: the trained mix's held-out mean
    cfg, _ = parse_args(
        [
            "--config",
            "configs/world_cpu.yaml",
            "--train.guard",
            "stop",
            "--reward.gold",
            "jpeg_compressibility",
        ]
    )
    assert build_guard(cfg).watch == "jpeg_compressibility"
    with pytest.raises(ConfigError, match="train.guard kl raises"):
        parse_args(["--config", "configs/world_cpu.yaml", "--train.guard", "kl"])
    with pytest.raises(ConfigError, match="eval.every > 0"):
        parse_args(["--config", "configs/world_cpu.yaml", "--train.guard", "warn", "--eval.every", "0"])
    with pytest.raises(ConfigError, match="is not evaluated"):
        parse_args(
            ["--config", "configs/world_cpu.yaml", "--train.guard", "warn", "--train.guard-reward", "x"]
        )
