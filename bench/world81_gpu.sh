#!/usr/bin/env bash
# The 81-frame world's GPU batch (issue 42) on one H200, as stages of <= 10 min each (the device
# tool's limit per command). Run a stage again to continue it: the curves resume from their
# checkpoints (every 10 rollouts, and on the time limit's SIGTERM). Everything lands under OUT.
#
#   bash bench/world81_gpu.sh pretrain OUT   # make world-model-81 into miles/world/pipeline_81 (+ its
#                                            # report), copied to OUT/pipeline_81 to commit (~3 MB prior)
#   bash bench/world81_gpu.sh vae OUT        # the trained VAE's reconstructions scored against the renders
#   bash bench/world81_gpu.sh curves OUT     # 4 curves side by side, 300 optimizer steps each: the best
#                                            # recipe (configs/world_81.yaml: DiffusionNFT) at seeds 0 1 2
#                                            # and its negated twin at seed 0; repeat until all finish
#   bash bench/world81_gpu.sh report OUT     # OUT/curves/world81.{json,md,png} from what ran
#   bash bench/world81_gpu.sh peer OUT       # flow_grpo's own Wan recipe on the 81-frame world, seed 0
#                                            # (needs a flow_grpo checkout in .cache/peers/flow_grpo)
#   RECIPES="nft awm" bash bench/world81_gpu.sh recipes OUT   # shipped recipes + twins at seed 0, all
#                                            # launched at once (choose two or three a stage)
#
# Time per stage (estimates from python -m miles.pretrain_world_81 --estimate and
# bench/world81_recipes.py's plan.json at an assumed 350 TFLOP/s; not measured): pretraining's prior
# ~5 min of its ~10; the four curves ~6 min of compute each alone, so ~3 stages of 9.5 min side by side.
set -euo pipefail
stage=${1:?stage: pretrain | vae | curves | report | peer | recipes}
out=${2:?OUT folder}
limit=${LIMIT:-570}   # seconds a stage may run: under the device tool's 600
py=${PY:-python}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled
case "$stage" in
  pretrain)
    timeout "$limit" $py -m miles.pretrain_world_81 miles/world/pipeline_81 ${DIT_STEPS:+--dit-steps "$DIT_STEPS"} \
      2>&1 | tee "$out/pretrain_81.log"
    cp -r miles/world/pipeline_81 miles/world/pretrain_report_81.json "$out/"
    ;;
  vae)
    timeout "$limit" $py bench/world81_vae_check.py --out "$out/vae_check_81.json" --shapes 81x480x832 \
      --vae miles/world/pipeline_81/vae 2>&1 | tee "$out/vae_check.log"
    ;;
  curves | report)
    what=$([ "$stage" = curves ] && echo "--run --resume --time-limit $limit" || echo "--report")
    # shellcheck disable=SC2086
    $py bench/world81_recipes.py --out "$out/curves" --recipes nft --seeds 0 1 2 --negated --twin-seeds 0 \
      $what 2>&1 | tee -a "$out/curves.log"
    ;;
  peer)
    timeout "$limit" $py bench/peer_learning.py --flow-grpo .cache/peers/flow_grpo --out "$out/peer" \
      --recipe own --mode cfg --model miles/world/pipeline_81 --config configs/world_81.yaml \
      --num-frames 81 --height 480 --width 832 --prompts-per-rollout 2 --micro-batch 1 \
      --num-rollouts 150 --export-every 30 --time-limit $((limit - 60)) 2>&1 | tee "$out/peer.log"
    ;;
  recipes)
    $py bench/world81_recipes.py --out "$out/recipes" --seeds 0 --negated --run --resume \
      --time-limit "$limit" ${RECIPES:+--recipes $RECIPES} 2>&1 | tee -a "$out/recipes.log"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
