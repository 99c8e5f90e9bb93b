#!/usr/bin/env bash
# array_entry.sh: one task of the areal worker job array -> one worker (role + replica).
#
# The array's task ids are handed out in the order of AREAL_LAYOUT, a comma-separated list
# of ROLE=COUNT (default: controller=1,weight-sync=1,generation=$AREAL_NUM_GENERATION,
# reward=$AREAL_NUM_REWARD, i.e. task 0 = controller, 1 = weight-sync, 2..N+1 = generation
# 0..N-1, N+2..N+M+1 = reward 0..M-1). Submit with --array=0-(total-1); a mismatch is
# refused here, with the right --array in the message. The trainer is not part of the
# array: it needs all its nodes at once (scripts/slurm/trainer.sbatch).
#
# The worker itself is started by scripts/systemd/areal-worker-exec ROLE-INDEX (through
# stall_restart.sh, which starts it again when it exits 3: stalled), so every
# variable documented there applies (AREAL_CONFIG, AREAL_NATS_URL, AREAL_SET, AREAL_SET_<ROLE>,
# credentials, AREAL_DRY_RUN=1 to print the command instead of running it).
# The default worker id is ROLE-INDEX-<host>; with several array jobs on one run give each a
# different AREAL_WORKER_ID prefix or layout.
set -euo pipefail

die() {
    echo "array_entry.sh: error: $*" >&2
    exit 2
}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -n "${SLURM_ARRAY_TASK_ID:-}" ] || die "SLURM_ARRAY_TASK_ID is not set; run as a task of an sbatch --array job"
task=$SLURM_ARRAY_TASK_ID
[[ $task =~ ^[0-9]+$ ]] || die "SLURM_ARRAY_TASK_ID='$task' is not a number"

layout=${AREAL_LAYOUT:-controller=1,weight-sync=1,generation=${AREAL_NUM_GENERATION:-1},reward=${AREAL_NUM_REWARD:-1}}

total=0
instance=
IFS=, read -r -a entries <<<"$layout"
for entry in "${entries[@]}"; do
    [[ $entry =~ ^([a-z-]+)=([0-9]+)$ ]] || die "AREAL_LAYOUT entry '$entry' is not ROLE=COUNT (layout: $layout)"
    role=${BASH_REMATCH[1]}
    count=${BASH_REMATCH[2]}
    if [ -z "$instance" ] && [ "$task" -lt $((total + count)) ]; then
        instance=$role-$((task - total))
    fi
    total=$((total + count))
done

[ "$total" -gt 0 ] || die "AREAL_LAYOUT '$layout' has no workers"
if [ -n "${SLURM_ARRAY_TASK_MAX:-}" ] && [ "$SLURM_ARRAY_TASK_MAX" -ne $((total - 1)) ]; then
    die "the layout '$layout' has $total tasks but the array ends at $SLURM_ARRAY_TASK_MAX; submit with --array=0-$((total - 1))"
fi
[ -n "$instance" ] || die "task $task is outside the layout '$layout' ($total tasks: --array=0-$((total - 1)))"

exec "$here/stall_restart.sh" "$here/../systemd/areal-worker-exec" "$instance"
