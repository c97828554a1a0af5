#!/usr/bin/env bash
# Make a Docker engine and genq's base image available on a machine that cannot reach any image
# registry (a CI box, an air-gapped GPU host). Idempotent: every step is skipped when already done.
#
#   bash .ci/docker-engine.sh            # engine up + base image built (cached by name)
#   bash .ci/docker-engine.sh prepare    # only the packages and the base image's files
#   bash .ci/docker-engine.sh stop       # stop the engine this script started, undo its host
#                                        # network changes (docker0, iptables chains, ip_forward)
#
# Steps: Debian's docker.io (Engine 20.10) and docker-compose (1.29) from apt; dockerd started by
# hand (no systemd here); a base image made with debootstrap from the Debian mirror apt already
# uses, holding python3, venv and redis-server, with this machine's extra CA certificates so pip
# inside a build can verify HTTPS. The image is tagged under the names the Dockerfile and
# docker-compose.yml use, so nothing tries to pull.
#
# Env: GENQ_BASE_IMAGE (default genq-base:bookworm), REDIS_IMAGE (default redis:7-bookworm),
#      ROOTFS (default /var/cache/genq-rootfs), DOCKERD_LOG (default /var/log/genq-dockerd.log)
set -euo pipefail

BASE=${GENQ_BASE_IMAGE:-genq-base:bookworm}
REDIS_IMAGE=${REDIS_IMAGE:-redis:7-bookworm}
ROOTFS=${ROOTFS:-/var/cache/genq-rootfs}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/genq-dockerd.log}
# Marks that this script (not the machine's owner) started dockerd, so `stop` only stops ours.
STARTED_MARK=/run/genq-dockerd.started
# The Debian 20.10 client: the v28 CLI that may sit first on PATH has no buildx/compose plugins.
DOCKER=/usr/bin/docker
[ -x "$DOCKER" ] || DOCKER=docker

die() { echo "docker-engine: error: $*" >&2; exit 1; }

install_packages() {
  # Only what is missing: a machine with Docker CE and compose v2 keeps its own.
  local need=()
  if ! "$DOCKER" info >/dev/null 2>&1 && ! command -v dockerd >/dev/null \
      && [ ! -x /usr/sbin/dockerd ]; then
    need+=(docker.io)
  fi
  command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 \
    || need+=(docker-compose)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  [ ${#need[@]} -eq 0 ] && return
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
}

start_engine() {
  if "$DOCKER" info >/dev/null 2>&1; then return; fi
  # The package's postinst does not start it (no systemd); start it by hand, in the background.
  # Remember the host's forwarding setting so `stop` restores it rather than guessing.
  cat /proc/sys/net/ipv4/ip_forward >"$STARTED_MARK.ip_forward"
  nohup "$(command -v dockerd || echo /usr/sbin/dockerd)" >"$DOCKERD_LOG" 2>&1 &
  echo $! >"$STARTED_MARK"
  for _ in $(seq 1 60); do "$DOCKER" info >/dev/null 2>&1 && return; sleep 1; done
  tail -20 "$DOCKERD_LOG" >&2 || true
  die "dockerd did not answer within 60 s (log: $DOCKERD_LOG)"
}

apt_mirror() {
  local m=""
  [ -f /etc/apt/sources.list.d/debian.sources ] \
    && m=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  [ -n "$m" ] || m=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$m" ] || die "no Debian mirror found in the apt sources"
  echo "$m"
}

make_rootfs() {
  [ -x "$ROOTFS/usr/bin/python3" ] && return
  rm -rf "$ROOTFS"
  debootstrap --variant=minbase --include=python3,python3-venv,redis-server,ca-certificates \
    bookworm "$ROOTFS" "$(apt_mirror)"
}
build_base() {
  if "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
    echo "base image $BASE exists; reusing it"
  else
    make_rootfs
    # The host's apt sources (bookworm, -updates, -security), so builds can install more.
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
      rm -f "$ROOTFS/etc/apt/sources.list"
      cp /etc/apt/sources.list.d/debian.sources "$ROOTFS/etc/apt/sources.list.d/"
    fi
    # Egress from this machine is re-signed by a local CA: without it pip fails with
    # CERTIFICATE_VERIFY_FAILED. Copied at every build because the machine's CA file can change.
    mkdir -p "$ROOTFS/usr/local/share/ca-certificates" "$ROOTFS/etc/ssl/certs"
    cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/" \
      2>/dev/null || true
    cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    tar -C "$ROOTFS" -c . | "$DOCKER" import \
      -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
      -c 'ENV LANG=C.UTF-8' - "$BASE" >/dev/null
    echo "base image $BASE built"
  fi
  # The same image serves as Redis (it holds redis-server) so compose never pulls redis.
  "$DOCKER" tag "$BASE" "$REDIS_IMAGE"
}

stop_engine() {
  [ -f "$STARTED_MARK" ] || { echo "dockerd was not started by this script; leaving it"; return; }
  local pid
  pid=$(cat "$STARTED_MARK")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  fi
  clean_host_net
  rm -f "$STARTED_MARK"
}

clean_host_net() {
  # dockerd created docker0, turned on ip_forward, set FORWARD to DROP and added DOCKER* chains.
  set +e
  iptables -D FORWARD -j DOCKER-USER 2>/dev/null
  iptables -D FORWARD -j DOCKER-ISOLATION-STAGE-1 2>/dev/null
  iptables -D FORWARD -o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT 2>/dev/null
  iptables -D FORWARD -o docker0 -j DOCKER 2>/dev/null
  iptables -D FORWARD -i docker0 ! -o docker0 -j ACCEPT 2>/dev/null
  iptables -D FORWARD -i docker0 -o docker0 -j ACCEPT 2>/dev/null
  for c in DOCKER DOCKER-ISOLATION-STAGE-1 DOCKER-ISOLATION-STAGE-2 DOCKER-USER; do
    iptables -F "$c" 2>/dev/null; iptables -X "$c" 2>/dev/null
  done
  iptables -P FORWARD ACCEPT
  iptables -t nat -D PREROUTING -m addrtype --dst-type LOCAL -j DOCKER 2>/dev/null
  iptables -t nat -D OUTPUT ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER 2>/dev/null
  iptables -t nat -D POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE 2>/dev/null
  iptables -t nat -F DOCKER 2>/dev/null; iptables -t nat -X DOCKER 2>/dev/null
  ip link del docker0 2>/dev/null
  cat "$STARTED_MARK.ip_forward" 2>/dev/null >/proc/sys/net/ipv4/ip_forward \
    || echo 0 >/proc/sys/net/ipv4/ip_forward
  rm -f "$STARTED_MARK.ip_forward"
  set -e
  echo "host network restored: DOCKER iptables rules left=$(iptables-save | grep -c DOCKER)," \
       "ip_forward=$(cat /proc/sys/net/ipv4/ip_forward)"
}

case "${1:-up}" in
  up) install_packages; start_engine; build_base ;;
  prepare) install_packages; make_rootfs ;;  # the slow downloads, no engine: .ci/run's background
  stop) stop_engine ;;
  *) die "usage: $0 [up|prepare|stop]" ;;
esac
