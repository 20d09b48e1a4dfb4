#!/usr/bin/env bash
# One node: torchrun --standalone with NPROC processes, the rest of the arguments to train_grpo.py.
#
#   launch/single_node.sh 8 --config configs/wan2_1_t2v_1_3b.yaml --sequence-parallel-size 4
#   NPROC=4 launch/single_node.sh --config configs/tiny_cpu.yaml --sequence-parallel-size 2
#
# NPROC: processes (GPUs) on this node; a leading integer argument wins over the variable.
#        Default: the number of GPUs nvidia-smi lists, else 1.
# TORCHRUN: the torchrun to use. Default: python -m miles.launch (torchrun with quiet refusals).
# PYTHON: the python that runs miles.launch. Default: the repository's .venv python if present, else python3.
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
# The launcher: TORCHRUN if set; else torchrun through miles.launch (a refusal ends in one line and
# exit code 2, a Ctrl-C in 130, no launcher traceback), with the repository's venv if it has one.
if [[ -n "${TORCHRUN:-}" ]]; then
    LAUNCHER=("$TORCHRUN")
else
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
    fi
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    LAUNCHER=("$PYTHON" -m miles.launch)
fi
# After a Ctrl-C or SIGTERM the trainer saves a checkpoint (miles/train/stop.py); torchrun waits
# this long for it before killing the workers (torch's default is 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}"
# The resume command a run prints starts with this script and its process count, as typed
# (miles/launch.py: launch_prefix).
MILES_LAUNCH_WRAPPER="$(printf '%q %q' "$0" "$NPROC")"
export MILES_LAUNCH_WRAPPER

# shellcheck disable=SC2086  # TORCHRUN_ARGS is meant to be word-split
exec "${LAUNCHER[@]}" --standalone --nnodes 1 --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} \
    "$ROOT/train_grpo.py" "$@"
