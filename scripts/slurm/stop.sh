#!/usr/bin/env bash
# Stop the single-node Slurm started by scripts/slurm/start.sh (slurmd, slurmctld,
# munged, by their pid files). `--clean` also removes the state directory.
#   scripts/slurm/stop.sh [STATE_DIR] [--clean]
set -uo pipefail
clean=0
args=()
for a in "$@"; do
  if [ "$a" = --clean ]; then clean=1; else args+=("$a"); fi
done
dir=${args[0]:-${PHASELENS_SLURM_DIR:-/tmp/phaselens-slurm}}
[ -d "$dir" ] || { echo "stop.sh: no cluster state in $dir" >&2; exit 0; }
stop() {
  local pidfile=$1 name=$2
  [ -f "$pidfile" ] || return 0
  local pid
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null; fi
    echo "stop.sh: stopped $name ($pid)" >&2
  fi
  rm -f "$pidfile"
}
stop "$dir/slurmd.pid" slurmd
stop "$dir/slurmctld.pid" slurmctld
stop "$dir/munge/munged.pid" munged
if [ "$clean" = 1 ]; then rm -rf "$dir"; echo "stop.sh: removed $dir" >&2; fi
exit 0
