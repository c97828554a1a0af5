#!/usr/bin/env bash
# scripts/real-sglang.sh: build once, then start and stop REAL SGLang 0.5.23 servers on a
# CPU-only machine, for genq's real-server test tier (tests/real/) and for trying genq by hand.
#
#   scripts/real-sglang.sh build                  venv + CPU kernel stand-in + tiny model (once)
#   PORT=31000 scripts/real-sglang.sh start       start a server, return when it answers /health
#   PORT=31000 scripts/real-sglang.sh stop        stop it (its whole process group)
#   PORT=31000 scripts/real-sglang.sh status
#
# The server is the unmodified sglang wheel from PyPI serving a tiny random Llama-architecture
# chat model made on the spot (2 layers, ~1.5 MB, ChatML template with enable_thinking,
# context 8192), so it needs no GPU and no model download. PyPI has no CPU build of SGLang's
# native kernel library, so scripts/real-sglang/sgl_kernel_shim.py stands in for the one
# function this model's path calls. The build takes ~3 min and ~6.6 GB; later runs reuse it.
#
# Environment (all optional):
#   BASE=~/.cache/genq-real-sglang   venv, model, shim, logs and pid files
#   PORT=30123                       127.0.0.1 only; each port has its own pid and log file
#   MAX_RUNNING=16                   --max-running-requests; MAX_RUNNING= (empty) launches
#                                    without it, as most users do
#   MAX_TOTAL_TOKENS=65536           KV-cache pool in tokens (else SGLang sizes it from RAM)
#   EXTRA_ARGS="--reasoning-parser qwen3 --enable-metrics"
#   EOS_SCALE=12                     higher: the model ends answers sooner (more "stop")
#   START_TIMEOUT=300                seconds to wait for /health
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)/real-sglang
BASE=${BASE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq-real-sglang}
PORT=${PORT:-30123}
MAX_RUNNING=${MAX_RUNNING-16}
MAX_TOTAL_TOKENS=${MAX_TOTAL_TOKENS:-65536}
EXTRA_ARGS=${EXTRA_ARGS-"--reasoning-parser qwen3 --enable-metrics"}
EOS_SCALE=${EOS_SCALE:-12}
START_TIMEOUT=${START_TIMEOUT:-300}
SGLANG_VERSION=0.5.23
VENV=$BASE/venv
MODEL=$BASE/tiny-model
SHIM=$BASE/cpu_shim
PIDFILE=$BASE/run/server-$PORT.pid
LOG=$BASE/run/server-$PORT.log
mkdir -p "$BASE/run"

say() { echo "[real-sglang] $*"; }

install_packages() {
  [ -f "$VENV/.installed-$SGLANG_VERSION" ] && return 0
  say "installing SGLang $SGLANG_VERSION and its CPU dependencies into $VENV"
  python3 -m venv "$VENV"
  # torch first: its PyPI wheel (a CUDA build) also runs on CPU, and torchvision needs it.
  "$VENV/bin/pip" install -q "torch==2.14.1" "torchvision==0.29.1"
  "$VENV/bin/pip" install -q -r "$HERE/requirements.txt"
  # --no-deps: sglang's own dependency list pulls CUDA-only kernels that do not install here.
  "$VENV/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION"
  touch "$VENV/.installed-$SGLANG_VERSION"
}

install_shim() {
  [ -f "$SHIM/sgl_kernel/__init__.py" ] && return 0
  mkdir -p "$SHIM/sgl_kernel"
  cp "$HERE/sgl_kernel_shim.py" "$SHIM/sgl_kernel/__init__.py"
}

make_model() {
  [ -f "$MODEL/model.safetensors" ] && [ -f "$MODEL/tokenizer.json" ] && return 0
  say "making the tiny model in $MODEL"
  "$VENV/bin/python" "$HERE/make_tiny_model.py" "$MODEL" --eos-scale "$EOS_SCALE" 2>/dev/null
}

build() {
  install_packages
  install_shim
  make_model
  # Fail here, loudly, rather than at the first test: the server must import.
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$SHIM" "$VENV/bin/python" -c \
    "import sglang, sgl_kernel; assert sglang.__version__ == '$SGLANG_VERSION', sglang.__version__"
  say "SGLang $SGLANG_VERSION ready to start from $BASE"
}

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

start() {
  if running; then say "already running on port $PORT (pid $(cat "$PIDFILE"))"; return 0; fi
  install_packages; install_shim; make_model
  local flags=(--model-path "$MODEL" --device cpu --host 127.0.0.1 --port "$PORT"
               --attention-backend torch_native --sampling-backend pytorch
               --disable-overlap-schedule --max-total-tokens "$MAX_TOTAL_TOKENS"
               --chat-template "$HERE/chat_template.jinja")
  [ -n "$MAX_RUNNING" ] && flags+=(--max-running-requests "$MAX_RUNNING")
  # SGLANG_USE_CPU_ENGINE=1 makes sglang treat the host as a CPU device. setsid gives the
  # server (and the scheduler processes it forks) its own process group, so stop ends them all.
  # shellcheck disable=SC2086
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}" setsid \
    "$VENV/bin/python" -m sglang.launch_server "${flags[@]}" $EXTRA_ARGS \
    >"$LOG" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  local t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "$START_TIMEOUT" ]; do
    sleep 1
    if ! running; then say "server on port $PORT died; last lines of $LOG:"; tail -30 "$LOG"; return 1; fi
    if curl -sf -m 2 "http://127.0.0.1:$PORT/health" >/dev/null; then
      say "SGLang $SGLANG_VERSION on http://127.0.0.1:$PORT (pid $(cat "$PIDFILE")) after $((SECONDS - t0)) s; log $LOG"
      return 0
    fi
  done
  say "server on port $PORT not healthy after $START_TIMEOUT s; see $LOG"
  stop >/dev/null
  return 1
}

stop() {
  if running; then
    local pid; pid=$(cat "$PIDFILE")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 1 40); do running || break; sleep 0.25; done
    running && kill -KILL -- "-$pid" 2>/dev/null || true
    say "stopped port $PORT (pid $pid)"
  else
    say "nothing running on port $PORT"
  fi
  rm -f "$PIDFILE"
}

case "${1:-start}" in
  build) build ;;
  start) start ;;
  stop) stop ;;
  status) if running; then say "running on port $PORT (pid $(cat "$PIDFILE"))"; else say "not running on port $PORT"; exit 1; fi ;;
  *) echo "usage: $0 [build|start|stop|status]" >&2; exit 2 ;;
esac
