#!/usr/bin/env bash
# A one-node Slurm (Debian's slurm-wlm 22.05 + munge) on loopback, for tests/dist/test_slurm.py and for
# trying launch/slurm.sbatch by hand. Everything lives under DIR (config, state, logs); the daemons run as
# the current user (root in CI), on ports derived from nothing fixed (SlurmctldPort/SlurmdPort below).
#   bash scripts/slurm_local.sh start DIR    -> prints the SLURM_CONF to export; waits until the node is idle
#   bash scripts/slurm_local.sh stop DIR
# Settings that made it work here (../shared/notes/turn3-facts.md): proctrack/linuxproc, task/none,
# select/cons_tres, one node with this machine's CPUs and memory, munge with a key of its own. cred_expire
# is 10 s (default 120): a requeued job waits that long before it starts again, and must (started earlier
# it is killed: "Job credential revoked").
set -euo pipefail
cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: bash scripts/slurm_local.sh start|stop DIR" >&2; exit 2; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf="$dir/slurm.conf"
stop() {
  for f in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munged.pid"; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  sleep 1
}
if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "error: $cmd: start or stop" >&2; exit 2; }
for b in munged slurmctld slurmd sbatch scontrol sinfo; do
  command -v "$b" >/dev/null || { echo "error: $b is not installed (Debian: apt-get install slurm-wlm munge)" >&2; exit 3; }
done
host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
user=$(id -un)
mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
# munge: a key and a socket of its own
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$dir/munge/munge.key"
munged --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" --pid-file="$dir/munged.pid" \
  --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munge.seed" --force
port=$(( 6800 + RANDOM % 400 ))
cat > "$conf" <<CONF
ClusterName=longstraw-test
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$(( port + 400 ))
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
KillWait=30
JobRequeue=1
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$conf"
slurmctld -f "$conf"
slurmd -f "$conf"
for _ in $(seq 1 60); do
  state=$(sinfo -h -o %t 2>/dev/null || true)
  case "$state" in idle*|mix*|alloc*) echo "$conf"; exit 0;; esac
  sleep 1
done
echo "error: the node did not come up (sinfo: ${state:-nothing}); see $dir/slurmctld.log, $dir/slurmd.log" >&2
stop
exit 1
