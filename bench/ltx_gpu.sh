#!/usr/bin/env bash
# Issue 45's GPU batch on one H200, in one device call (<= 570 s): the LTX-Video family on CUDA.
#
#   bash bench/ltx_gpu.sh OUT
#
# Beside each other on the one GPU:
# - the memory rehearsal of configs/ltx_video_2b.yaml (bench/memory_rehearsal.py --cases ltx-2b):
#   rank 0 of its world 8 = dp 2 x sp 4, random weights at the published LTX-Video 2B configs,
#   161x512x704 (7,392 tokens), a 4-step rollout, two optimizer steps, the export whole with its
#   bytes to /dev/null; peak memory per phase against the dry run's (memory is per process: the
#   curves beside it do not change it, its wall times are not clean);
# - the LTX world's curves on the GPU path (bench/learning.py --gpu --config configs/world_ltx_cpu.yaml:
#   one process per run, bf16, compiled blocks, not deterministic; a second layout beside the CPU's
#   dp4): DiffusionNFT lr 1e-4 and its negated twin at run.seed 0, 1, 2, and Flow-GRPO (CFG-free)
#   lr 1e-4 with its twin at seed 0, 300 optimizer steps or the time limit, held-out every 10
#   rollouts over 8 unseen prompts x 16 seeds (eval.seed fixed: the same noise for every run).
#
# The GPU machine has no diffusers: carry .whl (bash bench/speed_gpu.sh wheels OUT, here). Results:
# OUT/reh (the rehearsal's JSON and Markdown), OUT/curves/<seed>/ (learning.json, learning.md, logs).
# DRY=1 prints the commands.
set -euo pipefail
out=${1:?OUT folder}
limit=${LIMIT:-570}
py=${PY:-python3}
scratch=${SCRATCH:-/tmp/ltx45}
rollouts=${ROLLOUTS:-150}
run() { if [ -n "${DRY:-}" ]; then printf 'CMD'; printf ' %q' "$@"; printf '\n'; else "$@"; fi; }
mkdir -p "$out" "$scratch"
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${DRY:-}" ]; then
  rm -rf /tmp/site
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
start=$SECONDS
curve_limit=$((limit - 120))   # leaves the last evaluations, the tables and the copy their time
evals=(--eval.every 10 --eval.num-seeds 16 --run.wandb-mode disabled)
pids=()
curves() {  # NAME SEED RUNS... [-- FLAGS]
  local name=$1 seed=$2; shift 2
  local cmd=($py bench/learning.py --gpu --parallel --config configs/world_ltx_cpu.yaml --out "$scratch/$name"
    --num-rollouts "$rollouts" --time-limit "$curve_limit" "$@" --run.seed "$seed" "${evals[@]}")
  if [ -n "${DRY:-}" ]; then run "${cmd[@]}"; return; fi
  mkdir -p "$scratch/$name"
  "${cmd[@]}" > "$scratch/$name.log" 2>&1
}
bg() {  # in the background (with DRY=1 in turn: one printed line each)
  if [ -n "${DRY:-}" ]; then "$@"; else "$@" & pids+=($!); fi
}
for seed in 0 1 2; do
  bg curves "nft-s$seed" "$seed" --runs nft-dp4-lr1e-4 nft-dp4-negated-lr1e-4 --
done
bg curves grpo-s0 0 --runs dp4-lr1e-4 dp4-negated-lr1e-4 -- --algorithm.name flow_grpo
reh=(timeout $((limit - 60)) $py bench/memory_rehearsal.py --out "$out/reh" --work "$scratch/reh"
  --cases ltx-2b --num-steps 4 --export-to-null)
if [ -n "${DRY:-}" ]; then run "${reh[@]}"; else "${reh[@]}" > "$out/rehearsal.log" 2>&1 || echo "[ltx] rehearsal exit $?"; fi
for pid in "${pids[@]+"${pids[@]}"}"; do wait "$pid" || echo "[ltx] a curve batch exited $?"; done
for name in nft-s0 nft-s1 nft-s2 grpo-s0; do
  mkdir -p "$out/curves/$name"
  cp "$scratch/$name.log" "$out/curves/$name/" 2>/dev/null || true
  cp "$scratch/$name"/learning.{json,md} "$scratch/$name"/*.log "$out/curves/$name/" 2>/dev/null || true
done
echo "[ltx] done in $((SECONDS - start)) s"
