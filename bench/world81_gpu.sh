#!/usr/bin/env bash
# The 81-frame world's GPU batch (issue 42) on one H200, as stages of <= 570 s each (the device
# tool's 600 s a command). Every stage resumes: run it again and it continues where it stopped.
#
#   bash bench/world81_gpu.sh plan              # each stage's estimated device seconds and the sessions
#                                              # (estimates: bench/world81_plan.py); nothing runs
#   bash bench/world81_gpu.sh pretrain OUT      # make world-model-81 into WORK/pipeline_81 (+ its report);
#                                              # pauses at its budget (exit 75 -> "run again"), continues
#   bash bench/world81_gpu.sh curves OUT        # nft at seeds 0 1 2 + its negated twin at 0, 300 steps,
#                                              # side by side; each run resumes from its newest checkpoint
#   bash bench/world81_gpu.sh report OUT        # OUT/world81.{json,md,png} from what ran
#   bash bench/world81_gpu.sh vae OUT           # the trained VAE's reconstructions scored against the renders
#   RECIPES="awm" bash bench/world81_gpu.sh recipes OUT   # shipped recipes + twins at seed 0
#   bash bench/world81_gpu.sh peer OUT          # flow_grpo's own Wan recipe, seed 0 (.cache/peers/flow_grpo)
#
# Order (bench/world81_plan.py): pretrain, curves (as many times as it takes), report — the headline —
# then vae, recipes, peer in later sessions.
#
# State lives in WORK (default runs/world81: ignored by git, so it stays on a warm device machine
# between commands). After every stage the resumable part of WORK (the prior's folder, a paused
# pretraining's state, each run's newest checkpoint and logs; no videos) is copied to OUT/world81:
# copy that back into WORK here and pass WORK as the device tool's `carry` to continue on a fresh
# machine (bench/world81_plan.py --carry prints its size against the 64 MiB limit).
#
# DRY=1 prints each command ("CMD ...") instead of running it (tests/unit/test_world81_plan.py parses them).
# PRIOR_BLOCKS=1 trains the 1-block prior (halves the transformer's work; docs/learning.md,
# "The 81-frame world"); EVAL_EVERY sets the curves' held-out evaluation interval (default 15).
set -euo pipefail
stage=${1:?stage: plan | pretrain | curves | report | vae | recipes | peer}
out=${2:-}
work=${WORK:-runs/world81}
limit=${LIMIT:-570}   # seconds a stage may run: under the device tool's 600
py=${PY:-python}
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled
run() {  # a command, or with DRY=1 its words
  if [ -n "${DRY:-}" ]; then printf 'CMD'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
plan_args=(${PRIOR_BLOCKS:+--prior-blocks "$PRIOR_BLOCKS"} ${EVAL_EVERY:+--eval-every "$EVAL_EVERY"})
if [ "$stage" = plan ]; then
  [ -z "$out" ] || mkdir -p "$out"
  run $py bench/world81_plan.py "${plan_args[@]}" ${out:+--json "$out/plan.json"}
  exit 0
fi
[ -n "$out" ] || { echo "give OUT (a folder the results and the carried state go to)" >&2; exit 2; }
mkdir -p "$out" "$work"
# the prior: WORK's, else a committed one
model=$work/pipeline_81
if [ ! -f "$model/transformer/diffusion_pytorch_model.safetensors" ] \
   && [ -f miles/world/pipeline_81/transformer/diffusion_pytorch_model.safetensors ]; then
  model=miles/world/pipeline_81
fi
carry_out() { run $py bench/world81_plan.py --carry "$work" "$out/world81"; }
trap carry_out EXIT
recipes=(--model "$model" ${EVAL_EVERY:+--eval-every "$EVAL_EVERY"})
case "$stage" in
  pretrain)
    budget=$(awk "BEGIN { print ($limit - 60) / 60 }")   # minutes: leaves the save and the copy their time
    rc=0
    run timeout -k 15 "$limit" $py -m miles.pretrain_world_81 "$work/pipeline_81" --max-minutes "$budget" \
      --state-dir "$work/pretrain_state" ${PRIOR_BLOCKS:+--prior-blocks "$PRIOR_BLOCKS"} \
      2>&1 | tee -a "$out/pretrain_81.log" || rc=${PIPESTATUS[0]}
    if [ "$rc" = 75 ]; then echo "pretraining paused at its budget: run this stage again"; exit 75; fi
    [ "$rc" = 0 ] || exit "$rc"
    [ -n "${DRY:-}" ] || cp "$work/pretrain_report_81.json" "$out/"
    ;;
  curves | report)
    what=$([ "$stage" = curves ] && echo "--run --resume --time-limit $((limit - 90))" || echo "--report")
    # shellcheck disable=SC2086
    run $py bench/world81_recipes.py --out "$work/curves" --recipes nft --seeds 0 1 2 --negated --twin-seeds 0 \
      "${recipes[@]}" $what 2>&1 | tee -a "$out/curves.log"
    cp "$work"/curves/world81.* "$work/curves/plan.json" "$out/" 2>/dev/null || true
    ;;
  vae)
    run timeout -k 15 "$limit" $py bench/world81_vae_check.py --out "$out/vae_check_81.json" --shapes 81x480x832 \
      --vae "$model/vae" 2>&1 | tee "$out/vae_check.log"
    ;;
  recipes)
    run $py bench/world81_recipes.py --out "$work/recipes" --seeds 0 --negated --run --resume \
      --time-limit $((limit - 90)) "${recipes[@]}" ${RECIPES:+--recipes $RECIPES} 2>&1 | tee -a "$out/recipes.log"
    cp "$work"/recipes/world81.* "$out/" 2>/dev/null || true
    ;;
  peer)
    run timeout -k 15 "$limit" $py bench/peer_learning.py --flow-grpo .cache/peers/flow_grpo --out "$work/peer" \
      --recipe own --mode cfg --model "$model" --config configs/world_81.yaml \
      --num-frames 81 --height 480 --width 832 --prompts-per-rollout 2 --micro-batch 1 \
      --num-rollouts 150 --export-every 30 --time-limit $((limit - 90)) 2>&1 | tee "$out/peer.log"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
