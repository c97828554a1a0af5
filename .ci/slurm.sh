#!/usr/bin/env bash
# A real one-node Slurm on this machine, for the Slurm test (tests/test_slurm.py). Idempotent.
#
#   bash .ci/slurm.sh          # install, configure, start; prints `export SLURM_CONF=…`
#   bash .ci/slurm.sh stop     # stop the daemons this script started, and nothing else
#
# Debian's slurm-wlm (22.05) and munge from apt; munged with the key apt made (or one made here);
# slurmctld and slurmd started by hand (no systemd) on ports of their own, with their state, logs
# and pid files under GENQ_SLURM_DIR (default /var/tmp/genq-slurm). The node claims at least
# 8 CPUs (config_overrides): the test's array tasks are light (a simulator and a consumer each)
# and a 2-core CI box should still run three at once. Slurm's own commands find the cluster
# through SLURM_CONF.
set -euo pipefail

DIR=${GENQ_SLURM_DIR:-/var/tmp/genq-slurm}
CONF=$DIR/slurm.conf
die() { echo "slurm: error: $*" >&2; exit 1; }

install_packages() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then  # apt's postinst makes one; some images skip it
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge
  munge -n >/dev/null 2>&1 && return  # a munged answers already: the machine's own
  su -s /bin/sh munge -c /usr/sbin/munged
  pgrep -u munge -n -x munged >"$DIR/munged.started"  # ours: `stop` ends it
}

write_conf() {
  local cpus mem
  cpus=$(( $(nproc) > 8 ? $(nproc) : 8 ))
  mem=$(free -m | awk '/Mem:/{print int($2 * 0.8)}')
  mkdir -p "$DIR/ctld" "$DIR/d" "$DIR/log"
  cat >"$CONF" <<CONF
ClusterName=genqci
SlurmctldHost=$(hostname)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/d
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${GENQ_SLURMCTLD_PORT:-6917}
SlurmdPort=${GENQ_SLURMD_PORT:-6918}
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=30
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$(hostname) CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$(hostname) Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  install_packages
  mkdir -p "$DIR"
  start_munge
  export SLURM_CONF=$CONF
  if ! alive "$DIR/slurmctld.pid"; then
    write_conf
    slurmctld -f "$CONF"
  fi
  alive "$DIR/slurmd.pid" || slurmd -f "$CONF"
  for _ in $(seq 1 60); do
    sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)' && {
      echo "export SLURM_CONF=$CONF"; return; }
    sleep 1
  done
  tail -20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  die "the node did not come up within 60 s (logs: $DIR/log)"
}

stop() {
  for pid in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munged.started"; do
    alive "$pid" && kill "$(cat "$pid")"
    rm -f "$pid"
  done
}

case ${1:-start} in
  start) start ;;
  install) install_packages ;;  # the packages only: .ci/run's background
  stop) stop ;;
  *) die "usage: $0 [start|install|stop]" ;;
esac
