#!/usr/bin/env bash
# =====================================================================================================
# Stop the single-node Slurm cluster started by slurm/local/up.sh.
#
#   slurm/local/down.sh            # stop slurmd, slurmctld and munged (their pid files), keep the state
#   slurm/local/down.sh --purge    # ... and delete SLURM_LOCAL_DIR
#
# Only the processes named in the state folder's pid files are signalled.  Idempotent.
#
# Knobs (environment):
#   SLURM_LOCAL_DIR   the state folder up.sh used                       (${TMPDIR:-/tmp}/gaugeopt-slurm)
# =====================================================================================================
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the header above, without the comment marks
    awk '/^# =+$/ {n++; next} n == 1 {sub(/^# ?/, ""); print} n > 1 {exit}' "${BASH_SOURCE[0]}"
    exit 0
fi
set -uo pipefail

STATE="${SLURM_LOCAL_DIR:-${TMPDIR:-/tmp}/gaugeopt-slurm}"
PURGE=0
[[ "${1:-}" == "--purge" ]] && PURGE=1

stop() {  # stop <pidfile>: SIGTERM, wait up to 5 s, then SIGKILL
    local pidfile="$1" pid
    [[ -f "$pidfile" ]] || return 0
    pid="$(cat "$pidfile" 2>/dev/null)"
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$pidfile"
}

stop "$STATE/slurmd.pid"
stop "$STATE/slurmctld.pid"
stop "$STATE/munged.pid"
if ((PURGE)); then
    rm -rf "$STATE"
fi
echo "slurm-local: stopped${PURGE:+}$( ((PURGE)) && echo ' and purged' ) ($STATE)" >&2
