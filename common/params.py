"""Versioned generation parameters: `--set KEY=VALUE`, stored versions, the request body. Jobs
name no parameters: a request reads the current version."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson
import redis

from genq.common.errors import UsageError
from genq.common.queue import scripts
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import text

DEFAULTS: dict[str, Any] = {"max_tokens": 4096, "temperature": 0.6, "enable_thinking": True}


def _checked(cast: Callable[[str], Any], ok: Callable[[Any], bool],
             must: str) -> Callable[[str], Any]:
    """A parser that refuses a value `ok` rejects (nan fails every test), saying what it must be."""
    def parse(value: str) -> Any:
        parsed = cast(value)
        if not ok(parsed):
            raise ValueError(must)
        return parsed

    return parse


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


# A request's seed keeps RETRY_BITS for a prompt's schema retries (common/task.py request_seed).
RETRY_BITS = 15
MAX_RETRIES = 1 << RETRY_BITS
_NON_NEGATIVE = _checked(float, lambda f: f >= 0, "must be a number >= 0")
KNOWN: dict[str, Callable[[str], Any]] = {
    "max_tokens": _checked(int, lambda n: n > 0, "must be a positive integer"),
    "temperature": _NON_NEGATIVE,
    "top_p": _checked(float, lambda f: 0 < f <= 1, "must be a number in (0, 1]"),
    "top_k": int,
    "min_p": _NON_NEGATIVE,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": _NON_NEGATIVE,
    # Sent as it is in a run of one sample (common/task.py): a server's int seed must hold it.
    "seed": _checked(int, lambda n: 0 <= n < 1 << 31, f"must be an integer 0-{(1 << 31) - 1}"),
    "model": str,
    "enable_thinking": _bool,
    # Below MAX_RETRIES: each retry's seed stays distinct (common/task.py request_seed).
    "schema_retries": _checked(int, lambda n: 0 <= n < MAX_RETRIES,
                               f"must be an integer 0-{MAX_RETRIES - 1}"),
    # `genq produce --token-ids`: the server answers with its prompt and completion token ids.
    "return_token_ids": _bool,
}
# Known parameters genq acts on itself rather than send (`enable_thinking` goes in the template's
# kwargs; `schema_retries` bounds the answers asked again for a schema, common/schema.py).
NOT_SENT = ("enable_thinking", "schema_retries")
# Parameters consumers check once, at start (consumer/cli.py check_token_ids), not per request:
# a requeue changing one would reach consumers that never checked it.
AT_START = ("return_token_ids",)


def check_changeable(changes: Iterable[str], unset: Iterable[str]) -> None:
    """Refuse, in one line, a requeue of a parameter consumers read only at start."""
    for key in (*changes, *unset):
        if key in AT_START:
            raise UsageError(f"{key} is read by consumers at start, not per request: it cannot "
                             "change in a running run (produce a new run; nothing was changed)")


MASK = "***"


def mask_raw(values: dict[str, Any], *, pairs: bool = False) -> dict[str, Any]:
    """The parameters as shown: each --raw value (a key genq does not know; server extras may
    hold credentials) as MASK; with pairs, both sides of {key: [old, new]}, an absent side None."""
    def hide(value: Any) -> Any:
        if pairs and isinstance(value, list):
            return [None if side is None else MASK for side in value]
        return MASK

    return {key: value if key in KNOWN else hide(value) for key, value in values.items()}


# --raw keys that change what a request is or how many answers it makes: genq builds the prompt
# (its messages or ids), keeps one answer a request and reads its text and thinking apart, so
# each would make records that are not what they say. Refused, with why.
NOT_RAW = {
    "n": "makes the server decode {value} answers a request, of which genq keeps one "
         "(use --samples K for K answers a prompt)",
    "best_of": "makes the server decode several answers a request, of which genq keeps one "
               "(use --samples K)",
    "input_ids": "replaces every prompt genq builds from its row",
    "messages": "replaces every prompt genq builds from its row",
    "continue_final_message": "makes the prompt's last message the answer's beginning, not "
                              "a turn to answer",
    "separate_reasoning": "changes where the answer's thinking goes (genq keeps it apart in "
                          "reasoning_content)",
    "stream": "genq reads whole answers",
}


def _raw_key(key: str, value: Any, pair: str) -> None:
    """Refuse, in one line, a --raw key of NOT_RAW (n=1 asks for one answer: as if unset)."""
    if key in NOT_RAW and not (key in ("n", "best_of") and value == 1):
        why = NOT_RAW[key].format(value=value)
        raise UsageError(f"--raw {pair}: {key} {why}; it is refused (nothing was changed)")


def _split(pair: str, flag: str) -> tuple[str, str]:
    key, sep, raw = pair.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"bad {flag} {pair!r}: expected KEY=VALUE")
    return key, raw


def parse_sets(pairs: Iterable[str], raws: Iterable[str] = ()) -> dict[str, Any]:
    """Typed values from --set KEY=VALUE (known keys only: a typo must not make a version) and
    --raw KEY=VALUE (as-is; JSON where it parses)."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        key, raw = _split(pair, "--set")
        if key not in KNOWN:
            raise UsageError(f"unknown parameter {key!r} in --set {pair!r}; known: "
                             f"{', '.join(sorted(KNOWN))} (pass a server-specific one with "
                             f"--raw {key}=VALUE)")
        try:
            changes[key] = KNOWN[key](raw)
        except ValueError as e:
            reason = str(e) if "must" in str(e) else f"not a valid {key} value"
            raise UsageError(f"bad --set {pair!r}: {key} {reason}") from None
    for pair in raws:
        key, raw = _split(pair, "--raw")
        if key in KNOWN:
            raise UsageError(f"--raw {pair!r}: {key} is a known parameter; use --set so its "
                             "value is checked")
        try:  # JSON where it parses (numbers, booleans, objects), else the string
            changes[key] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            changes[key] = raw
        _raw_key(key, changes[key], pair)
    return changes


def apply(old: dict[str, Any], changes: dict[str, Any],
          unset: Iterable[str] = ()) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The new parameters and what changed ({key: [old, new]}, None for absent)."""
    new = {**old, **changes}
    for key in unset:
        if key not in old:
            raise UsageError(f"--unset {key}: the current parameters have no {key} "
                             f"(they have {', '.join(sorted(old)) or 'none'})")
        new.pop(key)
    diff = {key: [old.get(key), new.get(key)] for key in {*changes, *unset}
            if old.get(key) != new.get(key) or (key in old) != (key in new)}
    return new, dict(sorted(diff.items()))


def current(r: redis.Redis, k: RunKeys) -> tuple[int, dict[str, Any]]:
    version = int(r.get(k.params_version) or 1)
    raw = r.hget(k.params, str(version))
    return version, (orjson.loads(raw) if raw else dict(DEFAULTS))


def init_version_one(r: redis.Redis, k: RunKeys, params: dict[str, Any]) -> bool:
    """Store version 1 unless the run has parameters already; True if it stored them."""
    entry = {"version": 1, "changes": params, "redo": "none", "inflight": "finish",
             "at": time.time()}
    if not r.hsetnx(k.params, "1", orjson.dumps(params)):
        return False
    r.set(k.params_version, 1, nx=True)
    r.rpush(k.params_history, orjson.dumps(entry))
    return True


def check_fits(r: redis.Redis, k: RunKeys, max_tokens: int) -> None:
    """Refuse a max_tokens that cannot fit the smallest context any consumer has read, even
    with an empty prompt: every request would be refused."""
    known = [(text(server), int(context)) for server, raw in r.hgetall(k.servers).items()
             if (context := orjson.loads(raw).get("context_length"))]
    server, context = min(known, key=lambda item: item[1], default=("", 0))
    if known and max_tokens >= context:
        raise UsageError(
            f"max_tokens {max_tokens} cannot fit: the model's context on {server} is {context} "
            f"tokens for prompt and completion together; use a max_tokens below {context} "
            "(nothing was changed)")


# What each --redo mode does: the scopes whose older results, acked later, it still redoes
# (redo_marks), and the passes it walks: result bitmaps to undo, then failed prompts to revive.
REDO_SCOPES = {"truncated": ("truncated",), "all": ("done",)}
REDO_PASSES = {"truncated": ("truncated",), "failed": ("failed",), "all": ("done", "failed")}


def bump(r: redis.Redis, k: RunKeys, changes: dict[str, Any], *, redo: str, inflight: str,
         unset: Iterable[str] = ()) -> tuple[int, dict[str, list[Any]]]:
    """Make a new current version from the current one plus `changes`; returns (version, what
    changed). inflight="abort" refuses older versions' results written from now on (Redis's
    clock at the switch); the redo scope is recorded in the same step, covering older results
    acked later."""
    runner = scripts.ScriptRunner(r)
    while True:
        version = int(r.get(k.params_version) or 1)
        raw = r.hget(k.params, str(version))
        new, diff = apply(orjson.loads(raw) if raw else dict(DEFAULTS), changes, unset)
        entry = {"version": version + 1, "changes": diff, "redo": redo, "inflight": inflight}
        if runner(scripts.bump_call(k, version, raw or b"", orjson.dumps(new),
                                    orjson.dumps(entry), abort=inflight == "abort",
                                    scopes=REDO_SCOPES.get(redo, ()))):
            return version + 1, diff
