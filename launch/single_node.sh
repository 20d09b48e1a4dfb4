#!/usr/bin/env bash
# One node: torchrun --standalone with NPROC processes, the rest of the arguments to train_grpo.py.
#
#   launch/single_node.sh 8 --config configs/wan2_1_t2v_1_3b.yaml --sequence-parallel-size 4
#   NPROC=4 launch/single_node.sh --config configs/tiny_cpu.yaml --sequence-parallel-size 2
#
# NPROC: processes (GPUs) on this node; a leading integer argument wins over the variable.
#        Default: the number of GPUs nvidia-smi lists, else 1.
# TORCHRUN: the torchrun to use. Default: .venv/bin/torchrun in the repository if present, else torchrun.
# Extra torchrun flags: TORCHRUN_ARGS="--max-restarts 0 ..." (word-split).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then
    NPROC="$1"
    shift
fi
if [[ -z "${NPROC:-}" ]]; then
    NPROC="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    [[ "${NPROC:-0}" -ge 1 ]] || NPROC=1
fi
if [[ -z "${TORCHRUN:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/torchrun" ]]; then TORCHRUN="$ROOT/.venv/bin/torchrun"; else TORCHRUN=torchrun; fi
fi
# After a Ctrl-C or SIGTERM the trainer saves a checkpoint (miles/train/stop.py); torchrun waits
# this long for it before killing the workers (torch's default is 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}"

# shellcheck disable=SC2086  # TORCHRUN_ARGS is meant to be word-split
exec "$TORCHRUN" --standalone --nnodes 1 --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} \
    "$ROOT/train_grpo.py" "$@"
