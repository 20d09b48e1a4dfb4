#!/usr/bin/env bash
# One node of a multi-node run: start it on every node (same arguments, its own NODE_RANK).
#
#   # on each of 2 nodes (node A is the rendezvous host):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=nodeA MASTER_PORT=29500 NPROC_PER_NODE=8 \
#       launch/multi_node.sh --config configs/wan2_2_a14b.yaml --sequence-parallel-size 16
#
# Environment:
#   NNODES          number of nodes (required)
#   NODE_RANK       this node's index, 0 .. NNODES-1 (required). The c10d rendezvous ignores
#                   it (torchrun warns so) and gives each node a contiguous block of global
#                   ranks in arrival order; RDZV_BACKEND=static makes it the node's position.
#   MASTER_ADDR     host of the rendezvous, reachable from every node (required)
#   MASTER_PORT     its TCP port (default 29500)
#   NPROC_PER_NODE  processes (GPUs) per node (default: the GPUs nvidia-smi lists, else 1)
#   RDZV_BACKEND    c10d (default: fault-tolerant join, any arrival order) or static
#   RDZV_ID         rendezvous id shared by the nodes of one job (default: $SLURM_JOB_ID, else "miles")
#   TORCHRUN        torchrun to use (default: python -m miles.launch, torchrun with quiet refusals)
#   PYTHON          the python that runs miles.launch (default: the repository's .venv python if
#                   present, else python3)
#   TORCHRUN_ARGS   extra torchrun flags, word-split (e.g. "--max-restarts 0")
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun waits, after a SIGINT/SIGTERM, for the workers
#                   to save their checkpoint before it kills them (default here 100; torch's is 30)
#
# The rest of the arguments go to train_grpo.py. Ranks are contiguous per node, so Ulysses
# groups (contiguous ranks) stay inside a node when --ulysses-degree divides NPROC_PER_NODE
# (checked at startup) and the ring crosses nodes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (this node, 0 .. NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (the rendezvous host, reachable from every node)}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-miles}}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    [[ "${NPROC_PER_NODE:-0}" -ge 1 ]] || NPROC_PER_NODE=1
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
export NPROC_PER_NODE  # read by the dry run
# The resume command a run prints starts with this script, as typed (miles/launch.py: launch_prefix);
# slurm.sbatch sets its own.
MILES_LAUNCH_WRAPPER="${MILES_LAUNCH_WRAPPER:-$(printf '%q' "$0")}"
export MILES_LAUNCH_WRAPPER
# A stopped run saves a checkpoint at its next safe point (miles/train/stop.py): give it time.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}"

# shellcheck disable=SC2086  # TORCHRUN_ARGS is meant to be word-split
exec "${LAUNCHER[@]}" \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend "$RDZV_BACKEND" \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id "$RDZV_ID" \
    ${TORCHRUN_ARGS:-} \
    "$ROOT/train_grpo.py" "$@"
