#!/usr/bin/env bash
# End-to-end test of the compose stack, for real: a Docker engine, genq's image, the default
# profile (Redis, two simulated SGLang servers, producer, consumers, monitor, rq-dashboard).
#
#   bash .ci/compose-test.sh        # alone, or from .ci/run
#
# 1. engine + base image (.ci/docker-engine.sh: apt, dockerd by hand, debootstrap; cached)
# 2. genq's image on that base          3. `up` with 2 consumers, wait until every prompt is done
# 4. export: every index exactly once   5. monitor and read-only dashboard answer on 127.0.0.1
# 6. --scale consumer=3: the third waits as a spare; kill the consumer driving sim0 and see the
#    spare take its server over         7. `down -v`, then stop the engine this script started
#    and undo its host network changes.
# If the engine cannot start, this fails: it never skips.
set -euo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME=genqci
export GENQ_BASE_IMAGE=${GENQ_BASE_IMAGE:-genq-base:bookworm}
export GENQ_IMAGE=${GENQ_IMAGE:-genq:ci}
export GENQ_RUN=ci GENQ_DEMO_PROMPTS=${GENQ_DEMO_PROMPTS:-600} GENQ_SERVER_LEASE=5
export GENQ_MAX_TOKENS=2048 GENQ_SIM_TIME_SCALE=200
# Published ports: free ones, so a shared machine's 8000/9181 do not matter.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GENQ_MONITOR_PORT=$(free_port); GENQ_DASHBOARD_PORT=$(free_port)
export GENQ_MONITOR_PORT GENQ_DASHBOARD_PORT
# Debian's 20.10 client first: a newer CLI earlier on PATH may lack the build plugins.
export PATH=/usr/bin:$PATH
# Chosen again once the engine script has run: on a fresh machine it installs docker-compose.
pick_compose() {
  if command -v docker-compose >/dev/null; then DC=(docker-compose); else DC=(docker compose); fi
}
pick_compose

declare -A T
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
fail() { echo "compose-test: FAILED: $*" >&2; "${DC[@]}" ps >&2 || true; "${DC[@]}" logs --no-color --tail 30 >&2 || true; exit 1; }
wait_until() {  # wait_until SECONDS WHAT COMMAND...
  local limit=$1 what=$2; shift 2
  local end=$(( $(date +%s) + limit ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || fail "no $what after ${limit}s"
    sleep 1
  done
}
# docker exec, not docker-compose exec: the polls below must be quick to be accurate.
redis_get() { docker exec "$(cat "$REDIS_CID")" redis-cli --raw get "$1" | tr -d '\r'; }
REDIS_CID=$(mktemp)

engine_was_up=0
/usr/bin/docker info >/dev/null 2>&1 && engine_was_up=1
cleanup() {
  local rc=$?
  "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  rm -f "$REDIS_CID"
  if [ "$engine_was_up" = 0 ]; then bash .ci/docker-engine.sh stop || rc=1; fi
  exit $rc
}
trap cleanup EXIT

# ------------------------------------------------------------------ 1-2. engine and images
s=$(now)
bash .ci/docker-engine.sh up || fail "the Docker engine or the base image is not available"
hash -r
pick_compose
T[engine_and_base]=$(since "$s")
"${DC[@]}" config -q
GENQ_MODEL=m GENQ_DATA=/srv/data GENQ_OUT=/srv/out \
  "${DC[@]}" -f docker-compose.yml -f docker-compose.gpu.yml config -q
s=$(now)
docker build -q --build-arg "BASE_IMAGE=$GENQ_BASE_IMAGE" -t "$GENQ_IMAGE" . >/dev/null
T[image_build]=$(since "$s")

# ------------------------------------------------------------------ 3. the pipeline, 2 consumers
s=$(now)
"${DC[@]}" up -d --scale consumer=2
"${DC[@]}" ps -q redis >"$REDIS_CID"
settled() {
  "${DC[@]}" exec -T producer genq status --json | python3 -c '
import json, sys
st = json.load(sys.stdin)
sys.exit(0 if st["done"] + st["failed"] == st["total"] > 0 else 1)'
}
wait_until 600 "settled run" settled
T[pipeline]=$(since "$s")
# What the consumers went through (restarts, lost leases, retries), for the record.
echo "consumer events:"; "${DC[@]}" logs --no-color consumer \
  | grep -o '"event":"[a-z_]*"' | sort | uniq -c | grep -v '"task_acked"' || true
docker ps -a --filter "label=com.docker.compose.service=consumer" --format '{{.Names}} {{.Status}}'

# ------------------------------------------------------------------ 4. export
"${DC[@]}" run --rm --no-deps -T consumer genq export --out /out/results.jsonl
"${DC[@]}" run --rm --no-deps -T consumer python -c "
import json
idx = sorted(json.loads(line)['index'] for line in open('/out/results.jsonl'))
assert idx == list(range($GENQ_DEMO_PROMPTS)), f'{len(idx)} records, not one per prompt'
print('export: one record for each of', len(idx), 'prompts')" || fail "export incomplete"

# ------------------------------------------------------------------ 5. monitor, dashboard
python3 - "$GENQ_MONITOR_PORT" "$GENQ_DASHBOARD_PORT" <<'PY' || fail "monitor or dashboard"
import json, sys, urllib.error, urllib.request
monitor, dashboard = (f"http://127.0.0.1:{p}" for p in sys.argv[1:3])
status = json.load(urllib.request.urlopen(f"{monitor}/api/status", timeout=10))
assert status["done"] == status["total"], status
queues = json.load(urllib.request.urlopen(f"{dashboard}/0/data/queues.json", timeout=10))
assert any(q["name"] == "genq-ci" for q in queues["queues"]), queues
try:
    urllib.request.urlopen(urllib.request.Request(f"{dashboard}/requeue/genq-ci", data=b""))
    raise SystemExit("the dashboard accepted a write")
except urllib.error.HTTPError as e:
    assert e.code == 403, e.code
print("monitor and read-only dashboard answer on 127.0.0.1")
PY

# ------------------------------------------------------------------ 6. spare takes over
"${DC[@]}" up -d --scale consumer=3
spare_waits() { "${DC[@]}" logs --no-color consumer | grep -q '"event":"spare_waiting"'; }
wait_until 60 "consumer waiting as a spare" spare_waits
lease=genq:server:http://sim0:30000
victim=$(redis_get "$lease"); victim=${victim%%|*}
[ -n "$victim" ] || fail "nobody leases sim0"
# A consumer's name is <container hostname>-<pid>; the hostname is the container id.
killed_at=$(date -u +%s.%N)
docker kill "${victim%-*}" >/dev/null
taken_over() { o=$(redis_get "$lease"); [ -n "$o" ] && [ "${o%%|*}" != "$victim" ]; }
wait_until 60 "takeover of sim0" taken_over
heir=$(redis_get "$lease"); heir=${heir%%|*}
docker logs "${heir%-*}" 2>&1 | grep -q '"event":"spare_waiting"' \
  || fail "sim0 went to $heir, which was not the spare"
# Takeover time from the heir's own log line, not from this loop's polling.
T[takeover]=$(docker logs "${heir%-*}" 2>&1 | grep '"event":"server_leased"' | tail -1 \
  | python3 -c '
import datetime, json, sys
at = json.loads(sys.stdin.read())["timestamp"].replace("Z", "+00:00")
print(f"{datetime.datetime.fromisoformat(at).timestamp() - float(sys.argv[1]):.1f}")' "$killed_at")
echo "sim0: $victim killed ($(docker inspect -f "{{.State.Status}}, restarts {{.RestartCount}}" "${victim%-*}")), taken over by the spare $heir in ${T[takeover]}s (lease ${GENQ_SERVER_LEASE}s)"

# ------------------------------------------------------------------ 7. down
# Service by service, dependents first (as `down` does), so a slow one shows by name.
s=$(now)
for svc in consumer monitor rq-dashboard producer sim0 sim1 redis; do
  t=$(now); "${DC[@]}" stop "$svc" >/dev/null 2>&1; T[stop_$svc]=$(since "$t")
done
"${DC[@]}" down -v --remove-orphans
T[down]=$(since "$s")
for k in engine_and_base image_build pipeline takeover down; do echo "time[$k]=${T[$k]}s"; done
for svc in consumer monitor rq-dashboard producer sim0 sim1 redis; do
  echo -n "stop[$svc]=${T[stop_$svc]}s "
done; echo
echo "COMPOSE E2E: OK ($GENQ_DEMO_PROMPTS prompts, 2 servers, 3 consumers)"
