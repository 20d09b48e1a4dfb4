# miles — one command each: `make test` (lint + every test this machine can run), `make e2e`.
# Every target depends on `setup`, so a fresh clone needs no manual step.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TINY_DIR ?= .cache/tiny-wan
NPROC ?= 4
TORCH_VERSION ?= 2.13.0
# torchrun through miles.launch: a refusal ends in one line and exit code 2, with no launcher traceback
TORCHRUN := $(PY) -m miles.launch --standalone --nproc-per-node $(NPROC)

.PHONY: setup lint format test test-fast e2e e2e-random e2e-gpu e2e-bands stress-sp tiny-model world-model world-model-ltx world-model-81 world-i2v-model bench bench-learning clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU wheel (https://download.pytorch.org/whl/cpu, or a local wheel) without a
	# GPU, so nothing pulls a multi-GB CUDA build; the CUDA one where nvidia-smi lists a GPU.
	launch/install_torch.sh $(PY) $(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

tiny-model: setup
	$(PY) -m miles.models.tiny $(TINY_DIR)

# Lint, then every test this machine can run (GPU tests skip themselves without CUDA); the 20
# slowest are listed at the end. ~15 min on 2 cores (docs/validation.md). Multi-rank bodies run on
# ranks kept while their folder runs (tests/dist_utils.py: run_pooled), and the e2e runs share
# torchrun launches (tests/e2e/conftest.py).
test: lint tiny-model
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m pytest -q --durations=20 tests

test-fast: setup tiny-model
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/unit

# The main job: GRPO on the pretrained tiny world (miles/world), 4 CPU processes as dp2 x sp2;
# the held-out evaluation (eval.jsonl, eval/step_N.{json,mp4}) rises from the pretrained baseline.
e2e: setup
	HF_HUB_OFFLINE=1 WANDB_MODE=offline OMP_NUM_THREADS=1 $(TORCHRUN) train_grpo.py \
		--config configs/world_cpu.yaml --sequence-parallel-size 2 --data.prompts-per-rank 4 --train.num-rollouts 10

# The random embedded tiny model (two experts) at dp2 x sp2: what the parity tests use.
e2e-random: tiny-model
	HF_HUB_OFFLINE=1 WANDB_MODE=offline OMP_NUM_THREADS=1 $(TORCHRUN) train_grpo.py \
		--config configs/tiny_cpu.yaml --sequence-parallel-size 2

# The I2V world (configs/world_i2v_cpu.yaml): the committed world weights in TI2V's image mode
# (a folder of symlinks and a model_index.json with expand_timesteps; nothing is trained).
world-i2v-model: setup
	$(PY) -m miles.world.i2v model .cache/world-i2v

# Rebuild the pretrained world pipeline (VAE + Wan prior, ~17 min on 2 cores) into WORLD_DIR;
# the committed copy is miles/world/pipeline.
WORLD_DIR ?= .cache/world-wan
world-model: setup
	$(PY) -m miles.pretrain_world $(WORLD_DIR)

# The world through the LTX-Video family (a tiny LTX VAE at 8x / 2x + a 4-block LTX prior, CPU, one
# thread, ~30 min) into WORLD_LTX_DIR, its report beside it (pretrain_report_ltx.json). The defaults
# rebuild the committed miles/world/pipeline_ltx (docs/learning.md, "The LTX world"):
# make world-model-ltx WORLD_LTX_DIR=miles/world/pipeline_ltx.
WORLD_LTX_DIR ?= .cache/world-ltx
world-model-ltx: setup
	$(PY) -m miles.pretrain_world_ltx $(WORLD_LTX_DIR)

# The 81-frame world's prior (a 16-channel world VAE + a 2-block Wan prior with 128-wide heads, one
# GPU, bf16, compiled; estimated ~7 min in all: python bench/world81_plan.py) into WORLD_81_DIR, its
# report beside it (pretrain_report_81.json). configs/world_81.yaml reads miles/world/pipeline_81,
# whose configs are committed: make world-model-81 WORLD_81_DIR=miles/world/pipeline_81.
# WORLD_81_MINUTES=8 pauses it after 8 minutes (exit 75; the same command continues it);
# WORLD_81_BLOCKS=1 trains the 1-block prior (docs/learning.md, "The 81-frame world").
WORLD_81_DIR ?= .cache/world-wan-81
WORLD_81_MINUTES ?=
WORLD_81_BLOCKS ?=
world-model-81: setup
	$(PY) -m miles.pretrain_world_81 $(WORLD_81_DIR) $(if $(WORLD_81_MINUTES),--max-minutes $(WORLD_81_MINUTES)) \
		$(if $(WORLD_81_BLOCKS),--prior-blocks $(WORLD_81_BLOCKS))

# The same recipe shape on one GPU.
e2e-gpu: tiny-model
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m miles.launch --standalone --nproc-per-node 1 train_grpo.py \
		--config configs/tiny_gpu.yaml

# Every SP band (sp1/dp4, u4r1, u2r2, u1r4, dp2xu2) for 5 rollouts, each run twice: a table in runs/bands.
e2e-bands: tiny-model
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) bench/e2e_bands.py --out runs/bands --double-run

# Native-crash stress (not part of `make test`): the sp layouts (u2r2, u4r1, u1r4, dp2xu2) launched in
# turn under heap checks with faulthandler in every rank, small copies off the main thread slowed to
# widen thread races (bench/chaos_memcpy.c); runs/sp_stress/stress.json counts crashes and diverged
# runs (docs/reliability.md). STRESS_RUNS launches per layout, STRESS_CHECK perturb|malloc|asan|memcheck|none,
# STRESS_CHAOS EVERY:NS (empty: off). MILES_GLOO_WORKERS=2 make stress-sp brings back issue 46's abort.
STRESS_RUNS ?= 3
STRESS_CHECK ?= perturb
STRESS_CHAOS ?= 4:100000
stress-sp: tiny-model
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 19 $(PY) bench/sp_stress.py --out runs/sp_stress \
		--runs $(STRESS_RUNS) --check $(STRESS_CHECK) $(if $(STRESS_CHAOS),--chaos $(STRESS_CHAOS))

# One-GPU benchmarks (needs CUDA): the trainer's step vs stock diffusers at Wan shapes.
bench: setup
	$(PY) bench/gpu_bench.py --out bench/results

# The learning benchmark (CPU, torchrun): dp4, dp2 x sp2 and the negated control; docs/learning.md.
bench-learning: setup
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/learning.py --out bench/results/learning

clean:
	rm -rf runs wandb .pytest_cache .ruff_cache
