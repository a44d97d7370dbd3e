#!/usr/bin/env bash
# Idempotent: install Debian's Slurm (slurmctld, slurmd, client tools) and munge, for
# `phaselens grid --slurm` and its end-to-end test (tests/it/grid_slurm.rs), which starts a
# private single-node cluster with scripts/slurm/start.sh. Nothing is started here:
# the Debian packages' own services are not enabled by this script (the test's cluster
# uses its own config, ports, munge key and state directory).
set -euo pipefail
if command -v sbatch >/dev/null 2>&1 && { command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; } \
   && { command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ]; }; then
  echo "setup-slurm: ok (already installed: slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm 2>/dev/null || echo "?"))"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "setup-slurm: not root: install slurm-wlm and munge yourself (apt-get install slurm-wlm munge); the Slurm tests are skipped until then" >&2
  exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
echo "setup-slurm: ok (slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm 2>/dev/null || echo "?"))"
