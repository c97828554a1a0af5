"""Structured output, as SGLang's grammar backend gives it: the answer to a chat request whose
`response_format` is a `json_schema` is an instance of that schema, made deterministically from
the prompt and the request's seed (objects with typed properties, required, enums, arrays).
The `invalid_json_rate` fault breaks a share of them (a draw from the prompt and seed too, so
another seed draws again); a cut answer (finish "length") is cut JSON. Whole answers only."""

from __future__ import annotations

import functools
import random
from typing import Any

import jsonschema
import orjson

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")


def _schema(data: dict[str, Any]) -> dict[str, Any] | None:
    fmt = data.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    schema = (fmt.get("json_schema") or {}).get("schema")
    return schema if isinstance(schema, dict) else None


def _string(s: dict[str, Any], rng: random.Random) -> str:
    low, high = int(s.get("minLength", 1)), s.get("maxLength")
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    while len(text) < low:
        text += " " + rng.choice(WORDS)
    return text[:high] if isinstance(high, int) else text


def _array(s: dict[str, Any], rng: random.Random) -> list[Any]:
    low = int(s.get("minItems", 0))
    high = int(s.get("maxItems", max(low, 3)))
    items = s.get("items") if isinstance(s.get("items"), dict) else {}
    return [instance(items, rng) for _ in range(rng.randint(max(low, min(1, high)), high))]


def _object(s: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    required = set(s.get("required") or ())
    return {name: instance(sub, rng) for name, sub in (s.get("properties") or {}).items()
            if name in required or rng.random() < 0.5}


def instance(s: dict[str, Any], rng: random.Random) -> Any:
    """A value `s` accepts (the simple schemas above; anything else reads as a string)."""
    if "const" in s:
        return s["const"]
    if isinstance(s.get("enum"), list) and s["enum"]:
        return rng.choice(s["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list) and s[key]:
            return instance(s[key][0], rng)
    kind = s.get("type", "string")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), "null")
    if kind == "object":
        return _object(s, rng)
    if kind == "array":
        return _array(s, rng)
    if kind in ("integer", "number"):
        low, high = s.get("minimum", 0), s.get("maximum", 100)
        value = rng.randint(int(low), int(high))
        return value if kind == "integer" else value + 0.5 * (value < high)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(s, rng)


def _broken(value: Any, text: str, valid: Any, rng: random.Random) -> str:
    """Not an instance: a required property missing, a value of another type, or cut JSON."""
    candidates: list[Any] = [["not", "an", "instance"], {"unexpected": True}, "unexpected"]
    if isinstance(value, dict) and value:
        candidates.insert(0, dict(list(value.items())[1:]))  # the first property missing
    rng.shuffle(candidates)
    wrong = next((c for c in candidates if not valid(c)), None)
    if wrong is not None and rng.random() < 0.7:
        return orjson.dumps(wrong).decode()
    return text[: len(text) // 2] + "{"  # an object never closed: not JSON, however cut


@functools.lru_cache(maxsize=16)
def _validator(schema_json: bytes) -> Any:
    schema = orjson.loads(schema_json)
    return jsonschema.validators.validator_for(schema)(schema).is_valid


def shaped(engine: Any, data: dict[str, Any], prompt: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` (a whole chat answer) with its content made an instance of the request's schema,
    or broken under the invalid_json_rate fault; unchanged without a json_schema. Stats count
    what was sent in json_answers, judged by jsonschema as genq judges it: valid, invalid, cut."""
    schema, choice = _schema(data), body["choices"][0]
    if schema is None or choice["finish_reason"] not in ("stop", "length"):
        return body  # tool calls carry no content; an aborted answer is no answer
    valid = _validator(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS))
    key = f"{data.get('seed')}|{engine.settings.seed}|{prompt}"
    value = instance(schema, random.Random(key))
    text = orjson.dumps(value).decode()
    if choice["finish_reason"] == "length":  # cut in the thinking: no content at all
        text = text[: len(text) // 2] if choice["message"]["content"] else ""
    elif random.Random("invalid|" + key).random() < engine.faults.invalid_json_rate:
        text = _broken(value, text, valid, random.Random(key))
    choice["message"]["content"] = text
    kind = "cut" if choice["finish_reason"] == "length" else "valid" if _parses_valid(text, valid) \
        else "invalid"
    engine.stats.json_answers[kind] = engine.stats.json_answers.get(kind, 0) + 1
    return body


def _parses_valid(text: str, valid: Any) -> bool:
    try:
        return bool(valid(orjson.loads(text)))
    except orjson.JSONDecodeError:
        return False
