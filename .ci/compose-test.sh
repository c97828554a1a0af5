#!/usr/bin/env bash
# End-to-end test of the compose stack, for real: a Docker engine, genq's image, the default
# profile (Redis, two simulated SGLang servers, producer, consumers, monitor, rq-dashboard),
# driven by the README's commands as they are written there.
#
#   bash .ci/compose-test.sh        # alone, or from .ci/run
#
# 1. engine + base image (.ci/docker-engine.sh: apt, dockerd by hand, debootstrap; cached)
# 2. genq's image on that base; its entrypoint runs genq as the owner of /out, gives a
#    root-owned one to genq, and a consumer that cannot write /out fails in one line
# 3. `up -d`: one consumer per server; wait until every prompt is done
# 4. monitor (healthy) and read-only dashboard answer on 127.0.0.1
# 5. `up -d --scale consumer=3` adds a spare and recreates nothing; kill the consumer driving
#    sim0 and see the spare take its server over
# 6. `run --rm consumer genq export`: the file lands in the host's output directory, owned by
#    its owner, every index exactly once
# 7. `down -v` leaves the host's results in place
# 8. the README's block again, as written: `up -d` after `down -v` is a new run, written beside
#    the first run's output (./genq-out/RUN-EPOCH), which stays as it was; it completes and
#    exports; then stop the engine this script started and undo its host network changes.
# Settings go through an env file, as a user's `.env` (docs/DEPLOY.md): the same for every
# command. The output directory is a temporary one owned by a stand-in host user (uid 4321),
# so a developer's own ./genq-out is never touched.
# If the engine cannot start, this fails: it never skips.
set -euo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME=genqci
BASE_IMAGE=${GENQ_BASE_IMAGE:-genq-base:bookworm}
IMAGE=${GENQ_IMAGE:-genq:ci}
PROMPTS=${GENQ_DEMO_PROMPTS:-600}
LEASE=5
HOST_UID=4321
# Compose prefers the shell's variables to the env file's: none of the caller's reach it.
unset $(compgen -e | grep '^GENQ_') 2>/dev/null || true
WORK=$(mktemp -d)
OUT=$WORK/genq-out
mkdir "$OUT" && chown "$HOST_UID:$HOST_UID" "$OUT"
# Published ports: free ones, so a shared machine's 8000/9181 do not matter.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
MONITOR_PORT=$(free_port); DASHBOARD_PORT=$(free_port)
ENV_FILE=$WORK/env
cat >"$ENV_FILE" <<ENV
GENQ_BASE_IMAGE=$BASE_IMAGE
GENQ_IMAGE=$IMAGE
GENQ_RUN=ci
GENQ_DEMO_PROMPTS=$PROMPTS
GENQ_SERVER_LEASE=$LEASE
GENQ_MAX_TOKENS=2048
GENQ_SIM_TIME_SCALE=200
GENQ_MONITOR_PORT=$MONITOR_PORT
GENQ_DASHBOARD_PORT=$DASHBOARD_PORT
GENQ_OUT=$OUT
ENV
# Debian's 20.10 client first: a newer CLI earlier on PATH may lack the build plugins.
export PATH=/usr/bin:$PATH
# Chosen again once the engine script has run: on a fresh machine it installs docker-compose.
pick_compose() {
  if command -v docker-compose >/dev/null; then DC0=(docker-compose); else DC0=(docker compose); fi
  DC=("${DC0[@]}" --env-file "$ENV_FILE")
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
REDIS_CID=$WORK/redis.cid
project_ids() {  # the project's running containers, by service: "SERVICE ID" lines, sorted
  docker ps --no-trunc --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" \
    --format '{{.Label "com.docker.compose.service"}} {{.ID}}' | sort
}
consumers_running() { project_ids | grep -c '^consumer ' || true; }

engine_was_up=0
/usr/bin/docker info >/dev/null 2>&1 && engine_was_up=1
cleanup() {
  local rc=$?
  "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$WORK"
  if [ "$engine_was_up" = 0 ]; then bash .ci/docker-engine.sh stop || rc=1; fi
  exit $rc
}
trap cleanup EXIT

# ------------------------------------------------------------------ 1-2. engine and images
s=$(now)
GENQ_BASE_IMAGE=$BASE_IMAGE bash .ci/docker-engine.sh up \
  || fail "the Docker engine or the base image is not available"
hash -r
pick_compose
T[engine_and_base]=$(since "$s")
# The defaults, no settings at all: one consumer per server, ./genq-out at /out.
: >"$WORK/empty.env"
cfg=$("${DC0[@]}" --env-file "$WORK/empty.env" config)
grep -qE '^ +scale: 2$' <<<"$cfg" && grep -qE "$PWD/genq-out(:/out|$)" <<<"$cfg" \
  || fail "the default configuration: 2 consumers, ./genq-out at /out"
GENQ_MODEL=m GENQ_DATA=/srv/data "${DC[@]}" -f docker-compose.yml -f docker-compose.gpu.yml config -q
s=$(now)
docker build -q --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" . >/dev/null
T[image_build]=$(since "$s")
# The entrypoint: a root-owned /out (what Docker makes of a missing host directory) is given
# to genq; a user who cannot write /out gets one line from the consumer, not a traceback.
mkdir "$WORK/root-owned" "$WORK/not-writable"
[ "$(docker run --rm -v "$WORK/root-owned:/out" "$IMAGE" sh -c 'touch x; id -u')" = 10001 ] \
  && [ "$(stat -c %u "$WORK/root-owned/x")" = 10001 ] || fail "a root-owned /out is not genq's"
rc=0; err=$(docker run --rm --user 4322 -v "$WORK/not-writable:/out" "$IMAGE" \
  genq consume --out /out --server http://127.0.0.1:9 2>&1 >/dev/null) || rc=$?
[ "$rc" = 1 ] && [ "$(printf '%s\n' "$err" | wc -l)" = 1 ] \
  && [[ "$err" == "genq: error: cannot write to the output directory /out as uid 4322"* ]] \
  || fail "a consumer that cannot write /out: rc $rc, said: $err"
echo "entrypoint: /out's owner runs genq; root-owned -> genq; not writable -> one line: $err"

# ------------------------------------------------------------------ 3. the pipeline
s=$(now)
"${DC[@]}" up -d
[ "$(consumers_running)" = 2 ] || fail "up -d started $(consumers_running) consumers, not 2"
"${DC[@]}" ps -q redis >"$REDIS_CID"
settled() {
  "${DC[@]}" exec -T producer genq status --json | python3 -c '
import json, sys
st = json.load(sys.stdin)
sys.exit(0 if st["done"] + st["failed"] == st["total"] > 0 else 1)'
}
wait_until 600 "settled run" settled
T[pipeline]=$(since "$s")
"${DC[@]}" exec -T producer genq status
# What the consumers went through (restarts, lost leases, retries), for the record.
echo "consumer events:"; "${DC[@]}" logs --no-color consumer \
  | grep -o '"event":"[a-z_]*"' | sort | uniq -c | grep -v '"task_acked"' || true
docker ps -a --filter "label=com.docker.compose.service=consumer" --format '{{.Names}} {{.Status}}'

# ------------------------------------------------------------------ 4. monitor, dashboard
monitor_healthy() {
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$("${DC[@]}" ps -q monitor)")" = healthy ]
}
wait_until 90 "healthy monitor (answering, progress.json current)" monitor_healthy
[ "$(stat -c %u "$OUT/progress.json")" = "$HOST_UID" ] || fail "progress.json is not the host user's"
python3 - "$MONITOR_PORT" "$DASHBOARD_PORT" <<'PY' || fail "monitor or dashboard"
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

# ------------------------------------------------------------------ 5. a spare, then takeover
project_ids >"$WORK/before"
"${DC[@]}" up -d --scale consumer=3
project_ids >"$WORK/after"
gone=$(comm -23 "$WORK/before" "$WORK/after"); added=$(comm -13 "$WORK/before" "$WORK/after")
[ -z "$gone" ] || fail "--scale consumer=3 recreated or stopped running containers: $gone"
[ "$(printf '%s\n' "$added" | grep -c '^consumer ')" = 1 ] && [ "$(printf '%s\n' "$added" | wc -l)" = 1 ] \
  || fail "--scale consumer=3 added: ${added:-nothing}"
echo "scale: one consumer added, the $(wc -l <"$WORK/before") running containers kept"
# grep >/dev/null, not grep -q: -q quits at the first match, and the writer's SIGPIPE would fail
# the pipeline (pipefail) at random.
spare_waits() { "${DC[@]}" logs --no-color consumer | grep '"event":"spare_waiting"' >/dev/null; }
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
docker logs "${heir%-*}" 2>&1 | grep '"event":"spare_waiting"' >/dev/null \
  || fail "sim0 went to $heir, which was not the spare"
# Takeover time from the heir's own log line, not from this loop's polling.
T[takeover]=$(docker logs "${heir%-*}" 2>&1 | grep '"event":"server_leased"' | tail -1 \
  | python3 -c '
import datetime, json, sys
at = json.loads(sys.stdin.read())["timestamp"].replace("Z", "+00:00")
print(f"{datetime.datetime.fromisoformat(at).timestamp() - float(sys.argv[1]):.1f}")' "$killed_at")
echo "sim0: $victim killed ($(docker inspect -f "{{.State.Status}}, restarts {{.RestartCount}}" "${victim%-*}")), taken over by the spare $heir in ${T[takeover]}s (lease ${LEASE}s)"

# ------------------------------------------------------------------ 6. export to the host
"${DC[@]}" run --rm consumer genq export --out /out/results.jsonl
check_export() {  # check_export WHEN
  python3 - "$OUT/results.jsonl" "$PROMPTS" "$1" <<'PY'
import json, sys
idx = sorted(json.loads(line)["index"] for line in open(sys.argv[1]))
assert idx == list(range(int(sys.argv[2]))), f"{len(idx)} records, not one per prompt"
print(f"{sys.argv[3]}: {sys.argv[1]} holds one record for each of {len(idx)} prompts")
PY
}
check_export export || fail "export incomplete"
[ "$(stat -c %u "$OUT/results.jsonl")" = "$HOST_UID" ] || fail "results.jsonl is not the host user's"

# ------------------------------------------------------------------ 7. down
# Service by service, dependents first (as `down` does), so a slow one shows by name.
s=$(now)
for svc in consumer monitor rq-dashboard producer sim0 sim1 redis; do
  t=$(now); "${DC[@]}" stop "$svc" >/dev/null 2>&1; T[stop_$svc]=$(since "$t")
done
"${DC[@]}" down -v --remove-orphans
T[down]=$(since "$s")
check_export "after down -v" || fail "down -v took the host's results"

# ------------------------------------------------------------------ 8. the README's block again
# A user who runs it twice: Redis starts empty, the producer registers a fresh run, and the
# consumers find ./genq-out holding the first run's output (they refused it once: issue 30).
first=$(cd "$OUT" && sha256sum ci.*)  # the first run's shards and manifest
s=$(now)
"${DC[@]}" up -d
[ "$(consumers_running)" = 2 ] || fail "the second up -d started $(consumers_running) consumers"
"${DC[@]}" ps -q redis >"$REDIS_CID"
wait_until 600 "settled second run" settled
T[second_run]=$(since "$s")
"${DC[@]}" exec -T producer genq status
"${DC[@]}" up -d --scale consumer=3
"${DC[@]}" run --rm consumer genq export --out /out/results.jsonl
check_export "second run" || fail "the second run's export is incomplete"
epoch=$(docker exec "$(cat "$REDIS_CID")" redis-cli --raw hget genq:ci:meta epoch | tr -d '\r')
ls "$OUT/ci-$epoch"/ci.*.jsonl >/dev/null || fail "no shards of the second run in $OUT/ci-$epoch"
"${DC[@]}" down -v
[ "$(cd "$OUT" && sha256sum ci.*)" = "$first" ] || fail "the second run changed the first one's files"
echo "second run: complete in $OUT/ci-$epoch; the first run's $(wc -l <<<"$first") files unchanged"
for k in engine_and_base image_build pipeline takeover down second_run; do echo "time[$k]=${T[$k]}s"; done
for svc in consumer monitor rq-dashboard producer sim0 sim1 redis; do
  echo -n "stop[$svc]=${T[stop_$svc]}s "
done; echo
echo "COMPOSE E2E: OK ($PROMPTS prompts, 2 servers, 2 consumers then 3; the block twice)"
