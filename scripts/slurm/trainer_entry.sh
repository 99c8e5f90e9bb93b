#!/usr/bin/env bash
# trainer_entry.sh: the trainer on one node of a multi-node Slurm allocation (run by srun,
# one task per node). Every node starts one torchrun agent; the agents meet through the
# c10d rendezvous on the allocation's first host, so rank 0 may land on any node.
#
#   nodes        SLURM_JOB_NUM_NODES (or SLURM_NNODES)
#   ranks/node   AREAL_GPUS_PER_NODE, else SLURM_GPUS_ON_NODE, else 1
#   rendezvous   first host of `scontrol show hostnames "$SLURM_JOB_NODELIST"`:AREAL_RDZV_PORT (29500)
#   rdzv id      SLURM_JOB_ID (unique per job, so a requeued job never meets a stale one)
#
# Then scripts/systemd/areal-worker-exec trainer runs torchrun ... -m workers.cli --role
# trainer; everything documented there applies (AREAL_CONFIG, AREAL_NATS_URL, AREAL_SET,
# credentials, AREAL_DRY_RUN=1 to print the command instead of running it).
set -euo pipefail

die() {
    echo "trainer_entry.sh: error: $*" >&2
    exit 2
}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}
[ -n "$nodes" ] || die "SLURM_JOB_NUM_NODES is not set; run under sbatch/srun (scripts/slurm/trainer.sbatch)"
[ -n "${SLURM_JOB_NODELIST:-}" ] || die "SLURM_JOB_NODELIST is not set; run under sbatch/srun"
[ -n "${SLURM_JOB_ID:-}" ] || die "SLURM_JOB_ID is not set; run under sbatch/srun"

hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${hosts%%$'\n'*}
[ -n "$head_node" ] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' printed no host"

export AREAL_TORCHRUN_NNODES=$nodes
export AREAL_TORCHRUN_NPROC_PER_NODE=${AREAL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
export AREAL_TORCHRUN_RDZV_ENDPOINT=$head_node:${AREAL_RDZV_PORT:-29500}
export AREAL_TORCHRUN_RDZV_ID=$SLURM_JOB_ID
# One worker id per node; torchrun ranks > 0 never talk to the bus.
export AREAL_WORKER_ID=${AREAL_WORKER_ID:-trainer-$SLURM_JOB_ID-${SLURM_NODEID:-0}}

exec "$here/stall_restart.sh" "$here/../systemd/areal-worker-exec" trainer
