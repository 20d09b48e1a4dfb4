"""The tiny-world recipe (``configs/world_cpu.yaml``) at dp2, deterministic: what the world tests
(learning, held-out evaluation) share. Their runs go through the session's 2-process torchrun launch
(``tests/e2e/conftest.py``: ``SHARED_RUNS``)."""

WORLD = ["--config", "configs/world_cpu.yaml", "--run.wandb-mode", "disabled", "--run.no-progress"]
WORLD += ["--deterministic-mode"]
NPROC = 2
