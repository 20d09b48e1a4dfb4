#!/usr/bin/env bash
# Issue 43's GPU batch on one H200 (speed: the profile, the training attention backends, the fair peer
# ratio and frame fit, low-precision attention, the MFU table), as stages of <= 570 s each (the device
# tool's limit per command is 600 s). Each stage is one device call; it works under SCRATCH (the
# machine's disk) and leaves at most 8 small files flat in OUT ($OUT: what comes back). A stage run
# again on a warm machine continues where SCRATCH left it (the fit search resumes its cases).
#
#   bash bench/speed_gpu.sh plan OUT        # the stages, their device-time estimates and the order
#   bash bench/speed_gpu.sh wheels OUT      # HERE, not on the device: the wheels into .whl (below)
#   bash bench/speed_gpu.sh profile OUT     # bench/profile_step.py at 1.3B, 81x480x832 -> profile_1p3b.json
#   bash bench/speed_gpu.sh backends OUT    # the training attention-backend sweep, first half
#   bash bench/speed_gpu.sh backends2 OUT   #   second half (CASES="backend:checkpointing ..." picks any)
#   bash bench/speed_gpu.sh peer-lora OUT   # flow_grpo vs miles, LoRA r 32 on both sides -> peer_lora.json
#   bash bench/speed_gpu.sh peer-full OUT   # flow_grpo vs miles, every weight on both sides -> peer_full.json
#   bash bench/speed_gpu.sh fit OUT         # the frame fit at 80 and 141 GiB, LoRA, both capped alike;
#                                           # repeat until it prints "fit done" (it resumes its cases)
#   bash bench/speed_gpu.sh precision OUT   # bench/attention_precision.py (issue 43 item 1, h43a's bench)
#   bash bench/speed_gpu.sh step-lowp OUT   # the whole step, FP8 Linears + INT8 self-attention, VAE bf16
#   bash bench/speed_gpu.sh mfu OUT         # bench/mfu_table.py over docs/bench/*.json + every stage's JSON
#                                           # (CPU: also here, after fetching: MFU_INPUTS=DIR)
#
# DRY=1 prints each command instead of running it (tests/unit/test_speed_gpu.py parses them all).
# The device has torch 2.11 + CUDA 13, python 3.12 and no diffusers: `wheels` downloads the pinned
# ones (and xformers 0.0.35 for the sweep, 3.1 MiB) into .whl, which each call carries
# (`echo /.whl/ >> .git/info/exclude` once; carry [".whl", ".cache/peers"]); every stage installs
# them into /tmp/site first. The peer stages need a flow_grpo checkout with scripts/train_wan2_1.py
# at FLOW_GRPO (default .cache/peers/flow_grpo): docs/learning.md's zhtmike/flow_grpo@9745241 (the
# fetch tool's yifan123/flow_grpo snapshot is 2025-07's, without the Wan script); `wheels` with
# FLOW_GRPO_GIT=<the fetched git dir> extracts its flow_grpo/, scripts/ and config/ there (~10 MB).
set -euo pipefail
stage=${1:?stage: plan | wheels | profile | backends | backends2 | peer-lora | peer-full | fit | precision | step-lowp | mfu}
out=${2:?OUT folder}
limit=${LIMIT:-570}
py=${PY:-python3}
scratch=${SCRATCH:-/tmp/speed43}
flow_grpo=${FLOW_GRPO:-.cache/peers/flow_grpo}
fit_frames=${FIT_FRAMES:-81 121 161 201 241}

# stage: seconds of device time (estimates from the committed JSONs' phase times, not measured as
# stages: step_variants_h200.json init 52-95 s, warm-up rollout + compile ~73 s, measured step ~41 s;
# peer_step_h200.json flow_grpo 2 steps ~125 s) | what it runs
declare -A estimate=(
  [profile]=260 [backends]=450 [backends2]=450 [peer-lora]=330 [peer-full]=340 [fit]=570 [precision]=570 [step-lowp]=330
  [mfu]=5
)
order="profile backends peer-lora precision | step-lowp peer-full backends2 fit fit mfu"

run() {  # a command, or with DRY=1 its words
  if [ -n "${DRY:-}" ]; then
    printf 'CMD'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

setup() {  # the carried wheels, and where this stage works
  mkdir -p "$out" "$scratch/results"
  # torchao (the fp8 extra) needs none of its compiled extensions, built for another CUDA
  export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
  if [ -d .whl ] && [ -z "${DRY:-}" ]; then
    rm -rf /tmp/site
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  echo "[speed] $stage: ~${estimate[$stage]:-?} s of device time (an estimate, not a measurement)"
}

keep() {  # keep SRC as OUT/NAME and SCRATCH/results/NAME (mfu reads those); a missing SRC is said
  if [ -n "${DRY:-}" ]; then return 0; fi
  if [ -f "$1" ]; then cp "$1" "$out/$2"; cp "$1" "$scratch/results/$2"; else echo "[speed] $1 not written"; fi
}

log() {  # the stage's log, its tail only (what comes back is small)
  if [ -n "${DRY:-}" ]; then cat; else tee "$scratch/$stage.log" | tail -c 200000 > "$out/$stage.log"; fi
}

stopped() {  # a bench cut by its time limit (or failed): what it wrote so far is still kept
  echo "[speed] $stage: the bench stopped early (exit status ${PIPESTATUS[0]:-?}); keeping what it wrote"
}

need_peer() {
  if [ ! -f "$flow_grpo/scripts/train_wan2_1.py" ] && [ -z "${DRY:-}" ]; then
    echo "no flow_grpo checkout at $flow_grpo (FLOW_GRPO=...; see this script's header)" >&2
    exit 2
  fi
}

backend_cases() {  # one step bench per backend:checkpointing, each in the stage's remaining time
  local start=$SECONDS case backend ckpt left name
  for case in $1; do
    backend=${case%%:*} ckpt=${case##*:} name=backend_${backend#_}_${ckpt}
    left=$((limit - (SECONDS - start) - 10))
    if [ "$left" -lt 150 ] && [ -z "${DRY:-}" ]; then echo "[speed] $case: no time left in this stage"; continue; fi
    if [ "$backend" = xformers ] && [ -z "${DRY:-}" ] && ! $py -c "import sys, xformers; sys.exit(not xformers._has_cpp_library)"; then
      # its wheel's _C.so is built for torch 2.10.0+cu128 (xformers/cpp_lib.json): said, not run
      echo "[speed] $case: xformers' kernels do not load here: $($py -c "import xformers._cpp_lib as c; print(c._cpp_library_load_exception)" 2>&1 | tail -1)"
      continue
    fi
    # the recipe's train phase (2 samples x 2 SDE steps x CFG) with a 4-step rollout: the update is
    # what is compared; the canary (log-probs recomputed as rolled out) is in each JSON
    run timeout "$left" $py bench/step_bench.py --out "$scratch/$name" --work "$scratch/work" --rewards jpeg \
      --rollouts 2 --num-steps 4 --sde-window 2 --attention-backend "$backend" --checkpointing "$ckpt" || true
    keep "$scratch/$name/jpeg.json" "$name.json"
  done
}

case "$stage" in
  plan)
    total=0
    for s in profile backends backends2 peer-lora peer-full fit precision step-lowp mfu; do
      printf '%-10s ~%4s s\n' "$s" "${estimate[$s]}"; total=$((total + estimate[$s]))
    done
    first=0
    for s in ${order%%|*}; do first=$((first + estimate[$s])); done
    echo "total ~$total s (estimates; fit may need a second call) against 1800 s of device time a session"
    echo "order: $order"
    echo "before '|': the first session, ~$first s (the machine's start counts too: leave a few minutes); after: the next"
    ;;
  wheels)  # here, where pip reaches the registry: the device has none
    mkdir -p .whl
    extra=""
    for dep in docstring_parser typeguard importlib_metadata pytest pluggy iniconfig pygments; do
      extra+=" $dep==$($py -c "import importlib.metadata as m; print(m.version('$dep'))")"
    done
    # shellcheck disable=SC2086
    run $py -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      diffusers==0.42.1 transformers==5.24.0 peft==0.21.2 tyro==1.0.17 xformers==0.0.35 $extra \
      sageattention==1.0.6 nvidia-cudnn-frontend==1.16.0 torchao==0.18.0  # precision: attn-lowp, cuDNN FP8, fp8 (5.4 MB)
    if [ -n "${FLOW_GRPO_GIT:-}" ]; then
      mkdir -p "$flow_grpo"
      git --git-dir="$FLOW_GRPO_GIT" archive 9745241 flow_grpo scripts config | run tar -x -C "$flow_grpo"
    fi
    if [ -z "${DRY:-}" ]; then du -sh .whl "$flow_grpo" 2>/dev/null || true; fi
    ;;
  profile)
    setup
    run timeout $((limit - 50)) $py bench/profile_step.py --out "$scratch/profile" --work "$scratch/work" --top 15 2>&1 | log || stopped
    keep "$scratch/profile/profile.json" profile_1p3b.json
    keep "$scratch/profile/profile.md" profile_1p3b.md
    # the attribution of kernels to phases on this GPU (the backward's thread too): seconds
    run timeout 45 $py -m pytest -q -p no:cacheprovider tests/gpu/test_profile_step_gpu.py 2>&1 | tail -5 \
      > "$out/profile_gpu_test.txt" || true
    ;;
  backends | backends2)
    setup
    first="_native_cudnn:budget _native_cudnn:none _native_flash:budget"
    second="_native_efficient:budget xformers:budget flex:budget"
    cases=${CASES:-$([ "$stage" = backends ] && echo "$first" || echo "$second")}
    backend_cases "$cases" 2>&1 | log || stopped
    ;;
  peer-lora | peer-full)
    setup
    need_peer
    train=${stage#peer-}
    run timeout "$limit" $py bench/peer_step.py --flow-grpo "$flow_grpo" --out "$scratch/peer_$train" \
      --steps 2 --train "$train" 2>&1 | log || stopped
    keep "$scratch/peer_$train/peer_step.json" "peer_$train.json"
    keep "$scratch/peer_$train/peer_step.md" "peer_$train.md"
    ;;
  fit)
    setup
    need_peer
    resume=()
    if [ -f "$scratch/fit/peer_step.json" ]; then
      cp "$scratch/fit/peer_step.json" "$scratch/fit_before.json"
      resume=(--fit-resume "$scratch/fit_before.json")
    fi
    # shellcheck disable=SC2086
    run timeout "$limit" $py bench/peer_step.py --flow-grpo "$flow_grpo" --out "$scratch/fit" --steps 1 \
      --num-steps 2 --train-steps 1 --train lora --fit-only --fit $fit_frames "${resume[@]}" 2>&1 | log || stopped
    keep "$scratch/fit/peer_step.json" peer_fit.json
    keep "$scratch/fit/peer_step.md" peer_fit.md
    if [ -f "$scratch/fit/peer_step.md" ]; then echo "[speed] fit done"; fi
    ;;
  precision)
    setup
    if [ ! -f bench/attention_precision.py ]; then
      echo "[speed] bench/attention_precision.py is not in this checkout (issue 43 item 1): skipped"
      exit 0
    fi
    run timeout $((limit - 70)) $py bench/attention_precision.py --out "$scratch/precision" 2>&1 | log || stopped
    # the INT8 kernel against its float formula, under USP ring 1, and a rollout's gap: ~1 min
    run timeout 60 $py -m pytest -q -p no:cacheprovider tests/gpu/test_attention_precision_gpu.py 2>&1 | tail -8 \
      > "$out/precision_gpu_test.txt" || true
    if [ -z "${DRY:-}" ]; then
      n=0
      for f in "$scratch"/precision/*.json "$scratch"/precision/*.md; do
        [ -f "$f" ] && [ "$n" -lt 6 ] && keep "$f" "precision_$(basename "$f")" && n=$((n + 1))
      done
    fi
    ;;
  step-lowp)  # the whole step with FP8 Linears and INT8 self-attention in the rollout, VAE in bf16:
    # against the committed bf16 step with the VAE in bf16 (step_variants_h200.json, vae_bf16)
    setup
    run timeout "$limit" $py bench/step_bench.py --out "$scratch/step_lowp" --work "$scratch/work" --rewards jpeg \
      --rollouts 2 --rollout-precision fp8 --attention-precision sage_int8 --vae-dtype bfloat16 2>&1 | log || stopped
    keep "$scratch/step_lowp/jpeg.json" step_lowp.json
    ;;
  mfu)
    setup
    inputs=(docs/bench/*.json)
    if [ -z "${DRY:-}" ]; then
      for f in "${MFU_INPUTS:-$scratch/results}"/*.json; do [ -f "$f" ] && inputs+=("$f"); done
    fi
    run $py bench/mfu_table.py --out "$out" --json "${inputs[@]}"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
