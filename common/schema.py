"""Structured output: a run's JSON Schema (`--schema FILE`), sent to SGLang as its
`response_format`, and the check of an answer's content against it."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import referencing.exceptions
import regex
from jsonschema_specifications import REGISTRY as METASCHEMAS
from referencing.jsonschema import specification_with

from genq.common.errors import SchemaUnusable, UsageError

# Answers asked per attempt beyond the first when one does not match the schema (`--set
# schema_retries=N`): each retry has another seed, so a sampled mistake is not repeated.
SCHEMA_RETRIES = 3
# The longest one `pattern` check may take: a pattern that backtracks exponentially would hold a
# slot for minutes; one that runs past this counts as not matched.
PATTERN_TIMEOUT_S = 1.0


def response_format(path: str) -> dict[str, Any]:
    """The `response_format` parameter for the JSON Schema in `path` (SGLang 0.5's shape:
    {"type": "json_schema", "json_schema": {"name", "schema"}}); UsageError if it is none."""
    try:
        schema = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise UsageError(f"--schema {path}: cannot read a JSON document: {e}") from None
    if not isinstance(schema, dict):
        raise UsageError(f"--schema {path}: a JSON Schema is an object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise UsageError(f"--schema {path}: not a valid JSON Schema: {e.message}") from None
    if (ref := unresolvable(schema)) is not None:
        raise UsageError(f"--schema {path}: $ref {ref!r} resolves nowhere (a consumer resolves "
                         "refs within the schema only, never from a file or the network)")
    # OpenAI's name rule (letters, digits, _ and -), which SGLang passes on to its backend.
    name = re.sub(r"[^A-Za-z0-9_-]", "_", Path(path).stem)[:64] or "schema"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


# Keywords whose values are data, not subschemas: a {"$ref": ...} inside them is no reference.
_DATA = ("const", "enum", "default", "examples")


def unresolvable(schema: dict[str, Any]) -> str | None:
    """The first `$ref` of `schema` that jsonschema cannot resolve (it would raise at the first
    answer that reaches it), else None. Each subschema's `$id` moves the base, as in jsonschema."""
    dialect = schema.get("$schema") or jsonschema.validators.validator_for(schema).META_SCHEMA[
        "$schema"]
    spec = specification_with(dialect)

    def walk(node: Any, resolver: Any) -> str | None:
        if isinstance(node, list):
            return next((ref for item in node if (ref := walk(item, resolver))), None)
        if not isinstance(node, dict):
            return None
        resolver = resolver.in_subresource(spec.create_resource(node))
        if isinstance(ref := node.get("$ref"), str):
            try:
                resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                return ref
        return next((ref for key, value in node.items() if key not in _DATA
                     if (ref := walk(value, resolver))), None)

    return walk(schema, METASCHEMAS.resolver_with_root(spec.create_resource(schema)))


def schema_of(params: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema a version's answers must match: its `response_format`'s, else None."""
    fmt = params.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    schema = (fmt.get("json_schema") or {}).get("schema")
    return schema if isinstance(schema, dict) else None


def _matches(pattern: str, text: str) -> bool:
    """re holds the GIL for a whole search; regex lets go of it and stops at the timeout."""
    try:
        return regex.search(pattern, text, timeout=PATTERN_TIMEOUT_S) is not None
    except TimeoutError:
        return False


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if validator.is_type(instance, "string") and not _matches(pattern, instance):
        yield jsonschema.ValidationError(f"does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any,
                        schema: Any) -> Iterator[Any]:
    if validator.is_type(instance, "object"):
        for pattern, subschema in patterns.items():
            for key, value in instance.items():
                if _matches(pattern, key):
                    yield from validator.descend(value, subschema, path=key,
                                                 schema_path=pattern)


@functools.lru_cache(maxsize=8)
def _checker_class(cls: Any) -> Any:
    return jsonschema.validators.extend(
        cls, {"pattern": _pattern, "patternProperties": _pattern_properties})


def checker(schema: dict[str, Any]) -> Any:
    """The validator of `schema`, built once for every answer it checks; SchemaUnusable if a
    `$ref` resolves nowhere (a schema given with --raw, which produce and requeue do not check)."""
    if (ref := unresolvable(schema)) is not None:
        raise SchemaUnusable(f"the schema's $ref {ref!r} resolves nowhere")
    return _checker_class(jsonschema.validators.validator_for(schema))(schema)


def violation(content: str | None, validator: Any) -> str | None:
    """None if `content` is JSON that matches the `checker`'s schema; else the first violation,
    its JSON path first. Values from the answer stay out of it: one cause reads as one failure
    reason. SchemaUnusable if the schema cannot check it (its errors never escape otherwise)."""
    try:
        instance = orjson.loads(content or "")
    except orjson.JSONDecodeError as e:
        return f"answer is not JSON: {e}"
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    except (referencing.exceptions.Unresolvable, jsonschema.SchemaError) as e:
        raise SchemaUnusable(f"the schema cannot check an answer: {e}") from None
    if error is None:
        return None
    # "required" names the property missing; every other keyword's message quotes the answer.
    expected = error.message if error.validator == "required" else \
        f"fails {error.validator} {orjson.dumps(error.validator_value).decode()}"
    if len(expected) > 120:
        expected = expected[:117] + "..."
    return f"answer does not match the schema at {error.json_path}: {expected}"


def is_violation(reason: str) -> bool:
    """Whether a failure reason is one of violation()'s: the prompt failed on its schema."""
    return reason.startswith(("answer is not JSON", "answer does not match the schema"))
