"""What a task is, and the request it sends.

A task is one entry of a run's queue, numbered `row * samples + sample`: row `index` of the data
set and, in a run of `--samples K`, which of its K samples it is, each sent with its own seed. In
a `--turns all` run a task is a whole conversation, made turn by turn (turns/). Records and users
name a task by its row (`index`), its `sample` in a run of several, and the `turn` an answer is.

The request a task sends is built here (Task.request): the row's messages up to the turn being
made (turns/splice.py: all but a regenerated last assistant turn), the row's tools, and its
parameters version with the sample's seed. What the run's other settings change in it lives with
each: `--token-ids` is the parameter `return_token_ids` (params.py; the ids are read from the
answer in sglang/stream.py), `--schema` is `response_format` (schema.py; an answer that misses it
is asked again with the next seed, consumer/structured.py), and a continuation sends its partial's
ids or text (sglang/continuation.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from genq.common.params import DEFAULTS, NOT_SENT, RETRY_BITS

DEFAULT_SEED = 0  # the run's seed when its parameters set none
MAX_SAMPLES = 1 << (31 - RETRY_BITS)
_SEED_MASK = 0x7FFFFFFF


def request_seed(base: int, index: int, sample: int, retry: int = 0, turn: int = 1) -> int:
    """The seed of a request for row `index`, its `sample`, asked again for the `retry`-th time
    (a schema retry), of its `turn` in a `--turns all` run: stable across processes and
    versions, a function of these alone, below 2**31 so any server's int seed holds it, and
    never the same twice within a row's turn: the turn's start (a hash of row and turn; turn 1's
    is the row's of a one-turn run) plus sample * 2**RETRY_BITS + retry, distinct for every
    sample below MAX_SAMPLES and retry below MAX_RETRIES by construction."""
    key = f"{base}:{index}" if turn == 1 else f"{base}:{index}:{turn}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    start = int.from_bytes(digest, "big") & _SEED_MASK
    return (start + (sample << RETRY_BITS) + retry) & _SEED_MASK


def task_seed(task: int, samples: int, params: dict[str, Any], retry: int = 0,
              turn: int = 1) -> int:
    """request_seed of a task under `params`' seed, else DEFAULT_SEED."""
    index, sample = divmod(task, samples)
    return request_seed(int(params.get("seed", DEFAULT_SEED)), index, sample, retry, turn)


def sample_of(task: int, samples: int, params: dict[str, Any]) -> dict[str, int] | None:
    """The record's {"sample", "seed"} of a task in a run of several samples a prompt; None in a
    run of one, which sends its parameters as they are."""
    if samples == 1:
        return None
    return {"sample": task % samples, "seed": task_seed(task, samples, params)}


def row_fields(task: int, samples: int) -> dict[str, int]:
    """A task as users and records name it: its row (``index``) and, in a run of several
    samples a prompt, its ``sample`` (task_of's inverse)."""
    if samples == 1:
        return {"index": task}
    row, sample = divmod(task, samples)
    return {"index": row, "sample": sample}


def task_of(record: dict[str, Any], samples: int) -> int:
    """The task a record answers: row ``index`` times the run's samples, plus its ``sample``
    (absent: 0, as in a run of one sample a prompt)."""
    return record["index"] * samples + record.get("sample", 0)


def request_body(messages: list[dict], params: dict[str, Any], model: str, *,
                 tools: list[dict] | None = None) -> dict[str, Any]:
    """The /v1/chat/completions body: the limit is always explicit, thinking on by default,
    the row's tools beside its messages (and a tool_choice only beside tools)."""
    body = {"model": model, **{k: v for k, v in params.items() if k not in NOT_SENT}}
    thinking = {"enable_thinking": bool(params.get("enable_thinking", True))}
    if tools:
        body["tools"] = tools
    else:  # a run's --raw tool_choice chooses among a row's tools: SGLang refuses a required
        # or named one beside none (HTTP 400), as it would this row and the token-ids probe
        body.pop("tool_choice", None)
    return {**body, "messages": messages, "stream": False,
            "max_tokens": int(params.get("max_tokens", DEFAULTS["max_tokens"])),
            "chat_template_kwargs": {**thinking, **(body.get("chat_template_kwargs") or {})}}


@dataclass(frozen=True, slots=True)
class Task:
    """A claimed task under its parameters version (`params`)."""
    number: int
    samples: int
    params: dict[str, Any]

    @property
    def row(self) -> int:
        return self.number // self.samples

    @property
    def sample(self) -> dict[str, int] | None:
        """{"sample", "seed"} in a run of several samples a prompt (sample_of)."""
        return sample_of(self.number, self.samples, self.params)

    def seed(self, retry: int = 0) -> int:
        return task_seed(self.number, self.samples, self.params, retry)

    def turn_sample(self, turn: int) -> dict[str, int]:
        """{"sample" (in a run of several), "seed"} of a `--turns all` conversation's `turn`:
        each turn its own seed, also in a run of one sample (one seed would make a chain's
        turns sample alike)."""
        seed = task_seed(self.number, self.samples, self.params, turn=turn)
        return {**(self.sample or {}), "seed": seed}

    def request(self, messages: list[dict], model: str, tools: list[dict] | None = None,
                turn: int | None = None) -> dict[str, Any]:
        """The body asking for the answer after `messages`, with the sample's seed (with a
        `turn`: that turn's, turn_sample)."""
        sample = self.sample if turn is None else self.turn_sample(turn)
        params = {**self.params, "seed": sample["seed"]} if sample else self.params
        return request_body(messages, params, model, tools=tools)
