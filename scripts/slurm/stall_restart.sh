#!/usr/bin/env bash
# stall_restart.sh COMMAND...: run one worker (COMMAND) and start it again when its own watchdog
# found it stalled. Used by array_entry.sh and trainer_entry.sh, so a Slurm task outlives a
# worker that hung without dying.
#
# The worker runs with AREAL_SELF_WATCHDOG=exit: frozen (its event loop stopped beating) or wedged
# (work waits and none is finished within its threshold, docs/design.md "Stalls"), it exits 3.
# Exit 3 starts it again, up to AREAL_STALL_RESTARTS times (default 3); any other exit ends the
# task with that code. SIGTERM and SIGINT (scancel, the end of the allocation) go to the worker.
# With AREAL_DRY_RUN=1 the command runs once, as is (it prints its command line).
set -uo pipefail

STALLED=3
export AREAL_SELF_WATCHDOG=exit
[ $# -ge 1 ] || { echo "stall_restart.sh: error: usage: stall_restart.sh COMMAND [ARG...]" >&2; exit 2; }
[ -z "${AREAL_DRY_RUN:-}" ] || exec "$@"

max=${AREAL_STALL_RESTARTS:-3}
[[ $max =~ ^[0-9]+$ ]] || { echo "stall_restart.sh: error: AREAL_STALL_RESTARTS='$max' is not a number" >&2; exit 2; }
child=
trap '[ -z "$child" ] || kill -TERM "$child" 2>/dev/null' TERM INT
restarts=0
while true; do
    "$@" &
    child=$!
    wait "$child"
    code=$?
    while kill -0 "$child" 2>/dev/null; do  # a trapped signal interrupted wait: wait for the exit
        wait "$child"
        code=$?
    done
    child=
    if [ "$code" -ne "$STALLED" ] || [ "$restarts" -ge "$max" ]; then
        exit "$code"
    fi
    restarts=$((restarts + 1))
    echo "stall_restart.sh: the worker stalled (exit $STALLED); restart $restarts/$max" >&2
done
