#!/usr/bin/env bash
# scripts/real-sglang-200.sh: 200 prompts through genq against a real SGLang 0.5.23 launched
# without --max-running-requests (only --enable-metrics, for its counters); prints the export's
# token sums next to the server's own counters. PORT and RPORT (a private Redis) may be set.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-31977}
RPORT=${RPORT:-31978}
export PORT MAX_RUNNING= EXTRA_ARGS="--enable-metrics"
scripts/real-sglang.sh start
redis-server --port $RPORT --bind 127.0.0.1 --save "" --appendonly no --daemonize yes >/dev/null
export REDIS_URL=redis://127.0.0.1:$RPORT/0 GENQ_RUN=real200
W=$(mktemp -d)
python3 -c "
import json
with open('$W/d.jsonl','w') as f:
    for i in range(200): f.write(json.dumps({'id':f'p{i}','messages':[{'role':'user','content':f'Write program number {i}.'}]})+'\n')"
metric() { curl -s http://127.0.0.1:$PORT/metrics | awk -v n="sglang:$1_tokens_total" 'index($0, n)==1 {s+=$NF} END {printf "%d", s}'; }
p0=$(metric prompt); g0=$(metric generation)
python3 -m genq produce $W/d.jsonl --once --max-tokens 32 >/dev/null 2>&1
start=$(date +%s)
python3 -m genq consume --server http://127.0.0.1:$PORT --out $W/out --burst > $W/consume.log 2>&1
end=$(date +%s)
p1=$(metric prompt); g1=$(metric generation)
python3 -m genq export --out $W/export.jsonl >/dev/null 2>&1
python3 - <<PY
import json
recs=[json.loads(l) for l in open("$W/export.jsonl")]
from collections import Counter
print("records", len(recs), "finish", dict(Counter(r["finish_reason"] for r in recs)))
print("completion_tokens", sum(r["completion_tokens"] for r in recs), "server generation delta", $g1-$g0)
print("prompt_tokens", sum(r["prompt_tokens"] for r in recs), "server prompt delta", $p1-$p0)
print("content empty (thinking never closed)", sum(r["content"]=="" for r in recs))
PY
grep -o '"capacity":[0-9]*' $W/consume.log | head -1
grep -o '"endpoint":"[^"]*","event":"server_load_source"' $W/consume.log | head -1
echo "consume wall s: $((end-start))"
python3 -m genq status 2>/dev/null | head -12 || true
redis-cli -p $RPORT shutdown nosave >/dev/null 2>&1 || true
scripts/real-sglang.sh stop
