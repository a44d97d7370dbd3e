#!/usr/bin/env bash
# Start a single-node Slurm on this machine: a private munged, slurmctld and slurmd on
# loopback ports, proctrack/linuxproc, no cgroups, no accounting database (finished
# jobs are logged by jobcomp/filetxt, which `sacct --completion` reads).
#
#   scripts/slurm/start.sh [STATE_DIR]     # default $PHASELENS_SLURM_DIR or /tmp/phaselens-slurm
#   export SLURM_CONF=STATE_DIR/slurm.conf # printed on the last line; sbatch/squeue need it
#   scripts/slurm/stop.sh [STATE_DIR]      # stops the three daemons
#
# Needs root (slurmd starts job steps as their user) and Debian's slurm-wlm + munge
# (scripts/setup-slurm.sh installs them). Ports: $PHASELENS_SLURMCTLD_PORT (16817) and
# $PHASELENS_SLURMD_PORT (16818). Idempotent: a running cluster in STATE_DIR is reused.
# Exit codes: 0 ok, 2 Slurm or munge not installed, 3 not root, 1 failed to start.
set -euo pipefail
dir=${1:-${PHASELENS_SLURM_DIR:-/tmp/phaselens-slurm}}
ctld_port=${PHASELENS_SLURMCTLD_PORT:-16817}
slurmd_port=${PHASELENS_SLURMD_PORT:-16818}

for b in munged slurmctld slurmd sbatch squeue sinfo scontrol; do
  if ! command -v "$b" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$b" ]; then
    echo "start.sh: '$b' not found: install Debian's slurm-wlm and munge (bash scripts/setup-slurm.sh)" >&2
    exit 2
  fi
done
export PATH="$PATH:/usr/sbin"
if [ "$(id -u)" != 0 ]; then
  echo "start.sh: needs root (slurmd runs job steps as the submitting user)" >&2
  exit 3
fi

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"
if alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid" && alive "$dir/munge/munged.pid"; then
  echo "start.sh: already running in $dir" >&2
  echo "export SLURM_CONF=$conf"
  exit 0
fi
# A half-started cluster: stop what is left, then start clean (keep the state dir).
"$(dirname "$0")/stop.sh" "$dir" >/dev/null 2>&1 || true

mkdir -p "$dir"/{state,spool,log,munge}
dir=$(cd "$dir" && pwd)
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"
chmod 755 "$dir"
chmod 700 "$dir/munge"
key="$dir/munge/munge.key"
if [ ! -s "$key" ]; then
  dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
fi
chmod 400 "$key"
sock="$dir/munge/munge.socket"
munged --force --socket="$sock" --key-file="$key" --pid-file="$dir/munge/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"

host=$(uname -n | cut -d. -f1)   # slurmd's own short host name (no `hostname` binary needed)
cpus=$(nproc)
mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
cat > "$conf" <<CONF
# Written by scripts/slurm/start.sh: a single-node Slurm for phaselens' grid tests.
ClusterName=phaselens
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
KillWait=5
MinJobAge=3600
InactiveLimit=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

slurmctld -f "$conf"
slurmd -f "$conf"
for _ in $(seq 1 60); do
  state=$(sinfo -h -o '%t' 2>/dev/null | head -n1 || true)
  case "$state" in
    idle|mix|alloc) echo "start.sh: single-node Slurm up ($host, $cpus CPUs, state $state; logs in $dir/log)" >&2
                    echo "export SLURM_CONF=$conf"
                    exit 0 ;;
  esac
  sleep 1
done
echo "start.sh: the node did not come up within 60 s (sinfo state: '${state:-none}'); see $dir/log/" >&2
tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
exit 1
