"""The Lua scripts (common/queue/lua/) that move a task through RQ's states atomically. Each
``*_call`` is pure (script name, KEYS, ARGV), so sync and asyncio callers share one definition;
a script takes its KEYS and arguments by name (KEYS, _call)."""

from __future__ import annotations

import base64
import datetime as dt
import functools
import zlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

import orjson
from redis.exceptions import NoScriptError

from genq.common.errors import reason_kind
from genq.common.queue.keys import (
    FINISH_NAMES,
    RATE_BUCKET_S,
    RATE_BUCKET_TTL_S,
    RunKeys,
    finish_code,
)

# Each script's KEYS by name: RunKeys fields (a server script's one key is that server's lease,
# keys.server_lease). The script reads them as K.<name> (the `local K = {...}` put before it at
# load time) and its call passes them in this order; RQ's per-job hashes it reaches by the
# prefixes among its arguments.
KEYS: dict[str, tuple[str, ...]] = {
    "claim": ("rq_queue", "rq_wip", "leases", "lease_owner", "claims", "spent", "done", "failed",
              "params_version", "pending", "errors", "rq_failed", "rq_finished", "fail_kind",
              "fail_kinds", "meta", "tries", "conv"),
    "renew": ("leases", "lease_owner", "rq_wip"),
    "ack": ("leases", "lease_owner", "rq_wip", "done", "pending", "truncated", "counters",
            "length_hist", "acc_tokens", "acc_finish", "acc_version", "acc_attempt", "spent",
            "rq_finished", "acc_ptoks", "params_floor", "rq_queue", "redo_marks", "kept",
            "errors", "meta", "params_history", "partials", "tries", "acc_cont", "acc_cached",
            "invalid", "conv_msgs"),
    "release": ("leases", "lease_owner", "rq_wip", "rq_queue", "spent", "errors", "tries"),
    "fail": ("leases", "lease_owner", "rq_wip", "failed", "pending", "errors", "rq_failed",
             "kept", "done", "truncated", "counters", "length_hist", "acc_tokens", "acc_ptoks",
             "acc_finish", "fail_kind", "fail_kinds", "acc_version", "acc_cont", "acc_cached",
             "invalid"),
    "reap": ("leases", "lease_owner", "rq_wip", "rq_queue", "errors", "pending", "failed",
             "sweep", "spent", "rq_failed", "fail_kind", "fail_kinds", "tries"),
    "enqueue": ("rq_queue", "done", "failed", "pending", "rq_queues", "meta", "rq_canceled"),
    "redo": ("done", "truncated", "failed", "counters", "length_hist", "acc_tokens", "acc_ptoks",
             "acc_finish", "acc_version", "spent", "errors", "rq_failed", "pending", "kept",
             "tries", "acc_cont", "acc_cached", "redo_missing"),
    "expire": ("leases", "lease_owner"),
    "server_renew": ("lease",), "server_release": ("lease",), "server_take": ("lease",),
    "bump": ("params", "params_version", "params_history", "params_floor", "redo_marks"),
    "invalid": ("invalid", "counters", "failed"),
    "turn": ("leases", "lease_owner", "rq_wip", "conv", "conv_msgs", "counters", "conv_made",
             "conv_end", "partials", "params_floor", "params_history"),
    "rewind": ("leases", "lease_owner", "rq_wip", "conv", "conv_msgs", "conv_made", "conv_end",
               "counters", "rq_queue", "spent"),
}
NAMES = tuple(KEYS)
# lua/prelude.lua (the fencing check and the lease drop) goes after the `#!lua` line of each
# script that checks leases; lua/rq_sync.lua (following what RQ's own tools did to a job, a
# failure's reason, the run's life) likewise.
LEASE_SCRIPTS = ("renew", "ack", "release", "fail", "reap", "turn", "rewind")
SHARED = {"prelude": LEASE_SCRIPTS, "rq_sync": ("claim", "reap", "fail", "ack")}
_LEASE_KEYS = ("leases", "lease_owner", "rq_wip")  # what the prelude reads


def _read(name: str) -> str:
    return resources.files("genq.common.queue.lua").joinpath(f"{name}.lua").read_text()


def _header(name: str) -> str:
    """The script's KEYS by name (K) and its named arguments (A: ARGV[1], one JSON object; bytes
    JSON cannot carry follow it in ARGV, the fields naming them holding their ARGV index)."""
    keys = ", ".join(f"{key} = KEYS[{i}]" for i, key in enumerate(KEYS[name], 1))
    return f"local K = {{{keys}}}\nlocal A = cjson.decode(ARGV[1])\n"


def _source(name: str) -> str:
    text = _read(name)
    if name in LEASE_SCRIPTS and not set(_LEASE_KEYS) <= set(KEYS[name]):
        raise RuntimeError(f"{name}.lua takes the lease prelude: its KEYS must hold {_LEASE_KEYS}")
    shared = "".join(_read(part) for part, users in SHARED.items() if name in users)
    first, _, rest = text.partition("\n")
    if first.startswith("#!"):  # Redis reads flags only from the first line
        return f"{first}\n{_header(name)}{shared}{rest}"
    return _header(name) + shared + text


SOURCES = {name: _source(name) for name in NAMES}

# rq's registry sweeps (`rq info`) use their own host clock; a live lease sits this far past
# its genq deadline in rq:wip so they never mistake it for abandoned work.
WIP_MARGIN_S = 24 * 3600
# rq's tools see the last FINISHED_KEEP finished jobs (ack.lua deletes older ones), so a long run
# leaves no hash per task; 100 keeps the registry a small listpack. Their TTL is a backstop.
FINISHED_KEEP = 100
RESULT_TTL_S = 30 * 24 * 3600
FAILURE_TTL_S = 7 * 24 * 3600  # RQ's tools show a failed job this long; genq's failed bit stays
# The reaper's sweep for what RQ's tools did: indices checked per bitmap per sweep, and
# seconds between sweeps for the whole run; 250 a second covers 900,000 prompts in an hour.
SWEEP_BUDGET = 250
SWEEP_EVERY_S = 1.0
# Finish names by code, as fail.lua and redo.lua take them to undo a result's counters.
_FINISH_ORDER = [FINISH_NAMES[code] for code in sorted(FINISH_NAMES)]


@dataclass(frozen=True)
class Call:
    script: str
    keys: list[str]
    args: list[Any]


def iso_now() -> str:
    """rq's timestamp format; display only, never used for lease decisions."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _call(script: str, k: RunKeys, args: dict[str, Any], *blobs: bytes | str) -> Call:
    """A Call with KEYS in the script's table order and its named arguments as one JSON
    argument; `blobs` (bytes JSON cannot carry) follow it, from ARGV[2] on, where `args`
    name them by ARGV index."""
    return Call(script, list(_keys(script, k)), [orjson.dumps(args), *blobs])


@functools.lru_cache(maxsize=256)
def _keys(script: str, k: RunKeys) -> tuple[str, ...]:
    """The script's KEYS of run `k`, derived once: a made turn's call named its 11 anew."""
    return tuple(getattr(k, name) for name in KEYS[script])


def _prefixes(k: RunKeys) -> dict[str, str]:
    return {"job_prefix": k.rq_job_prefix, "exec_prefix": k.rq_execution_prefix,
            "execs_prefix": k.rq_executions_prefix}


def _rate(k: RunKeys) -> dict[str, Any]:
    return {"rate_prefix": k.rate_prefix, "bucket_s": RATE_BUCKET_S,
            "bucket_ttl": RATE_BUCKET_TTL_S}


def claim_call(k: RunKeys, n: int, vt: float, server: str, worker: str, exec_base: str,
               life: str = "", conversations: bool = False) -> Call:
    """life: "epoch|generation" as the caller knows the run; claims nothing if Redis's differs.
    conversations: a --turns all consumer's claim, told which conversations have no made turns
    kept (each claimed row's last field, 0), so those begin without a read."""
    return _call("claim", k, {"n": n, "vt": vt, "margin": WIP_MARGIN_S, "server": server,
                              "worker": worker, "exec_base": exec_base, "now_iso": iso_now(),
                              **_prefixes(k), "run": k.run, "finished_ttl": RESULT_TTL_S,
                              "life": life, "conv": conversations})


def renew_call(k: RunKeys, vt: float, held: list[tuple[str, str]]) -> Call:
    return _call("renew", k, {"vt": vt, "margin": WIP_MARGIN_S,
                              "execs_prefix": k.rq_executions_prefix,
                              "held": [{"jid": jid, "exec": exec_id} for jid, exec_id in held]})


@dataclass(kw_only=True, slots=True)
class Result:
    """One written result to acknowledge (ack.lua takes several at once)."""
    job_id: str
    index: int
    exec_id: str
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str
    version: int
    attempt: int
    created_at: float | None = None  # by Redis's clock (None: now), as abort switches are
    continued: int = 0  # tokens of the partial answer it continued (not decoded again)
    cached: int = 0  # prompt tokens the server reported cached (0: none or not reported)


def ack_many_call(k: RunKeys, server: str, results: list[Result], life: str = "",
                  conversations: bool = True) -> Call:
    """Several results in one call: a code each (all refused if the run is not `life`);
    `conversations`: a `--turns all` run's, whose ended conversations' made turns go."""
    items = []
    for r in results:  # ack.lua's names for a result (see its header)
        code = finish_code(r.finish_reason)
        items.append({"jid": r.job_id, "idx": r.index, "exec": r.exec_id,
                      "ctoks": r.completion_tokens, "ptoks": r.prompt_tokens,
                      "fname": FINISH_NAMES[code], "fcode": code, "ver": r.version,
                      "attempt": r.attempt, "at": r.created_at, "cont": r.continued,
                      "cached": r.cached})
    return _call("ack", k, {"server": server, "result_ttl": RESULT_TTL_S, "now_iso": iso_now(),
                            **_prefixes(k), **_rate(k), "finished_keep": FINISHED_KEEP,
                            "results": items, "life": life, "conv": conversations})


def release_call(k: RunKeys, job_id: str, index: int, exec_id: str, *, refund: bool,
                 reason: str = "", unclaim: bool = False) -> Call:
    """unclaim: genq let go before the server had its say; the claim does not count either."""
    return _call("release", k, {"jid": job_id, "idx": index, "exec": exec_id, "refund": refund,
                                "reason": reason, **_prefixes(k), "unclaim": unclaim})


def turn_call(k: RunKeys, job_id: str, index: int, exec_id: str, standing: bytes,
              messages: bytes, made: int, ended: int, unstable: int = 0, checked: int = 0,
              tokens: int = 0, server: str = "", continued: int = 0, version: int = 0,
              created_at: float | None = None) -> Call:
    """A conversation's made turn, written to its shard: where it stands (turns/state.py),
    its made turns' count and how it ended (0: not yet) for status; a turn before its last
    counts its `tokens` in the rate, and if it was `continued` from a partial of that many
    tokens, in the params `version`'s continued figures (ack.lua counts the last's). A turn of
    `version` whose record was `created_at` (Redis's clock; None: now) after a switch that
    aborts older work is refused, as ack.lua refuses a result."""
    return _call("turn", k, {"jid": job_id, "exec": exec_id, "task": index, "standing": 2,
                             "messages": 3, "unstable": unstable, "checked": checked,
                             "made": made, "ended": ended, "tokens": tokens, "server": server,
                             **_rate(k), "continued": continued, "version": version,
                             "created_at": created_at}, standing, messages)


def rewind_call(k: RunKeys, rewinds: list[tuple[int, bytes, bytes]]) -> Call:
    """Conversations (task, where it stands now, its kept turns' messages) back to their kept
    turns (lua/rewind.lua)."""
    items: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for task, standing, messages in rewinds:
        items.append({"task": task, "jid": k.job_id(task), "standing": len(blobs) + 2,
                      "msgs": len(blobs) + 3})
        blobs += [standing, messages]
    return _call("rewind", k, {**_prefixes(k), "items": items}, *blobs)


def fail_call(k: RunKeys, job_id: str, index: int, exec_id: str, *, reason: str,
              worker: str) -> Call:
    # rq-dashboard shows a failed job's exc_string; rq stores it as b64(zlib(text)).
    exc_string = base64.b64encode(zlib.compress(reason.encode())).decode()
    return _call("fail", k, {"jid": job_id, "idx": index, "exec": exec_id,
                             "reason": reason_kind(reason), "exc_string": exc_string,
                             "worker": worker, "failure_ttl": FAILURE_TTL_S,
                             "now_iso": iso_now(), **_prefixes(k),
                             "results_prefix": k.rq_results_prefix,
                             "finish_names": _FINISH_ORDER})


def invalid_call(k: RunKeys, index: int, answer: bytes, version: int, keep: int) -> Call:
    """Keep `answer` (JSON) as the last of a prompt failed on its schema, while the run keeps
    fewer than `keep` such copies."""
    return _call("invalid", k, {"idx": index, "answer": 2, "version": version, "keep": keep},
                 answer)


def reap_call(k: RunKeys, limit: int = 500, sweep_every_s: float = SWEEP_EVERY_S,
              sweep_budget: int = SWEEP_BUDGET) -> Call:
    """sweep_every_s=0 sweeps on every call (tests)."""
    return _call("reap", k, {"limit": limit, **_prefixes(k), "run": k.run,
                             "sweep_budget": sweep_budget, "sweep_every_s": sweep_every_s})


def expire_call(k: RunKeys, server: str) -> Call:
    """End every lease of the run on `server` now (its consumer is provably gone)."""
    return _call("expire", k, {"server": server})


def server_call(script: str, lease: str, **args: Any) -> Call:
    """server_renew, server_release or server_take on a server's lease (keys.server_lease)."""
    return Call(script, [lease], [orjson.dumps(args)])


def bump_call(k: RunKeys, version: int, old: bytes | str, new: bytes, entry: bytes, *,
              abort: bool, scopes: tuple[str, ...]) -> Call:
    """Make version+1 current unless `version` (with `old` parameters) is no longer; `entry`
    is the history entry, its time added by the script."""
    return _call("bump", k, {"version": version, "old": 2, "new": 3, "entry": 4,
                             "abort": abort, "scopes": scopes}, old, new, entry)


def enqueue_call(k: RunKeys, jobs: list[tuple[int, bytes, str]], epoch: str = "") -> Call:
    """With an epoch the jobs are only queued while the run in Redis is still that one."""
    items = [{"idx": idx, "data": at, "description": description}
             for at, (idx, _, description) in enumerate(jobs, 2)]
    return _call("enqueue", k, {"job_prefix": k.rq_job_prefix, "run": k.run,
                                "queue": k.rq_queue, "origin": k.queue_name,
                                "now_iso": iso_now(), "result_ttl": RESULT_TTL_S,
                                "failure_ttl": FAILURE_TTL_S, "epoch": epoch, "jobs": items},
                 *(data for _, data, _ in jobs))


def redo_call(k: RunKeys, what: str, start: int, stop: int, below_version: int,
              limit: int = 10_000) -> Call:
    """what: "truncated"/"done"/"missing" (results to undo) or "failed" (prompts to revive); a
    bounded slice per call, so the atomic script never holds up the consumers' acks for long."""
    return _call("redo", k, {"what": what, "start": start, "stop": stop,
                             "below": below_version, "run": k.run, "limit": limit,
                             "finish_names": _FINISH_ORDER})


class ScriptRunner:
    """Runs Calls on one client (sync or asyncio), loading each script once."""

    def __init__(self, client: Any) -> None:
        self._scripts = {name: client.register_script(src) for name, src in SOURCES.items()}

    def __call__(self, call: Call) -> Any:
        # For redis.asyncio clients this returns an awaitable; callers await it.
        return self._scripts[call.script](keys=call.keys, args=call.args)

    async def pipelined(self, client: Any, calls: list[Call]) -> list[Any]:
        """Several Calls in one round trip on an asyncio client (a pipeline, not a
        transaction: each script is atomic on its own). By their sha alone: a pipeline of
        registered scripts asks SCRIPT EXISTS first, a round trip more each time; a call
        Redis answers NOSCRIPT (it restarted, its scripts gone) did not run, and runs again
        on its own, loading its script."""
        pipe = client.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(self._scripts[call.script].sha, len(call.keys), *call.keys, *call.args)
        out = list(await pipe.execute(raise_on_error=False))
        for n, got in enumerate(out):
            if isinstance(got, NoScriptError):
                out[n] = await self(calls[n])
        for got in out:
            if isinstance(got, Exception):
                raise got
        return out
