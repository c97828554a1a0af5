"""What a task is, and the request it sends.

A task is one entry of a run's queue, numbered `row * samples + sample`: row `index` of the data
set and, in a run of `--samples K`, which of its K samples it is, each sent with its own seed. In
a `--turns all` run a task is a whole conversation, made turn by turn (turns/). Records and users
name a task by its row (`index`), its `sample` in a run of several, and the `turn` an answer is.

Every request body is built here, by Request.body, and by nothing else: the row's messages up to
the turn being made (turns/splice.py: all but a regenerated last assistant turn), the row's
tools, its parameters version (--raw keys among them) under the seed Task.seed gives each
sample, turn and schema retry, and a continuation's partial, by ids or text. Who asks for a
variant asks for another Request: `--token-ids` is the parameter `return_token_ids` (params.py),
`--schema` is `response_format` (schema.py; an answer that misses it is asked again under the
next retry's seed, consumer/structured.py), and sglang/continuation.py decides when a partial
is continued.
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


def _whole(value: Any, absent: int) -> int | None:
    """A record's number field: `absent` when missing or null; an int, or a float that is a
    whole number (a JSON tool's rewrite of genq's int); anything else (a string, a bool) None."""
    if value is None:
        return absent
    if type(value) is int:
        return value
    return int(value) if type(value) is float and value.is_integer() else None


@dataclass(frozen=True, slots=True)
class TaskId:
    """Whom an answer is for: row `row` of the data set, its `sample` of the row's K (0 in a
    run of one), and its `turn`, which of the row's assistant turns it is (1 but in
    `--turns all`). The queue numbers the (row, sample) task `row * samples + sample`."""
    row: int
    sample: int = 0
    turn: int = 1

    @classmethod
    def of(cls, task: int, samples: int, turn: int = 1) -> TaskId:
        row, sample = divmod(task, samples)
        return cls(row, sample, turn)

    @classmethod
    def read(cls, record: dict[str, Any]) -> TaskId | None:
        """The one reading of a record's `index`, `sample` and `turn`, for export, recover and
        status alike. A missing or null sample is 0 and turn 1 (a record of a run without
        samples or turns: its one answer); None when the record names no task genq writes
        (a negative or fractional number, a string, turn 0: turns count from 1)."""
        row, sample = _whole(record.get("index"), -1), _whole(record.get("sample"), 0)
        turn = _whole(record.get("turn"), 1)
        if row is None or sample is None or turn is None or row < 0 or sample < 0 or turn < 1:
            return None
        return cls(row, sample, turn)

    def task(self, samples: int) -> int:
        return self.row * samples + self.sample

    def fields(self, samples: int) -> dict[str, int]:
        """The task as users and records name it: its row (``index``) and, in a run of several
        samples a prompt, its ``sample``."""
        return {"index": self.row} if samples == 1 else {"index": self.row,
                                                         "sample": self.sample}


def row_fields(task: int, samples: int) -> dict[str, int]:
    """Task number `task` as users and records name it (TaskId.fields)."""
    return TaskId.of(task, samples).fields(samples)


def task_of(record: dict[str, Any], samples: int) -> int | None:
    """The queue's number of the task a record answers in a run of `samples` (TaskId.read);
    None when it names none of this run's."""
    tid = TaskId.read(record)
    return None if tid is None or tid.sample >= samples else tid.task(samples)


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """What a request is made of. `body()` is the one place a /v1/chat/completions body is
    made; each variant (a turn, a sample's or a turn's or a schema retry's seed, a
    continuation) is another Request (dataclasses.replace), never an edited body."""
    messages: list[dict]
    params: dict[str, Any]  # the version's parameters, --raw keys among them
    model: str
    tools: list[dict] | None = None
    seed: int | None = None  # in place of the parameters' own (Task.request says whose)
    # `requeue --continue`: go on from this partial answer (a record's fields), by its ids in a
    # --token-ids run, else by its text (common/sglang/continuation.py decides when).
    partial: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        """The limit always explicit, thinking on by default, the row's tools beside its
        messages (and a tool_choice only beside tools: SGLang refuses a required or named one
        beside none, HTTP 400); a continuation's limit less what its partial holds."""
        params = self.params if self.seed is None else {**self.params, "seed": self.seed}
        sent = {k: v for k, v in params.items() if k not in NOT_SENT
                and (self.tools or k != "tool_choice")}
        kwargs = {"enable_thinking": bool(params.get("enable_thinking", True)),
                  **(sent.get("chat_template_kwargs") or {})}
        limit = int(params.get("max_tokens", DEFAULTS["max_tokens"])) - int(
            (self.partial or {}).get("completion_tokens") or 0)
        messages, going_on = self.messages, dict[str, Any]()
        if self.partial is not None and params.get("return_token_ids"):
            # SGLang 0.5.23 skips the template for input_ids; the messages give the stop tokens
            going_on = {"input_ids": [*self.partial["prompt_token_ids"],
                                      *self.partial["completion_token_ids"]]}
        elif self.partial is not None:
            messages = [*messages, {"role": "assistant", "content": self._prefix(kwargs)}]
            going_on = {"continue_final_message": True}
        return {"model": self.model, **sent, **({"tools": self.tools} if self.tools else {}),
                "messages": messages, "stream": False, "max_tokens": limit,
                "chat_template_kwargs": kwargs, **going_on}

    def _prefix(self, kwargs: dict[str, Any]) -> str:
        """A partial's text as the model wrote it: SGLang 0.5.x appends a final assistant
        message sent with continue_final_message after the generation prompt, and its reasoning
        parser reads it (after `<think>` new text is thinking), so the tags go back in."""
        assert self.partial is not None
        reasoning, content = self.partial.get("reasoning_content"), \
            self.partial.get("content") or ""
        if reasoning is None or not kwargs.get("enable_thinking", True):
            return content
        # A partial without content stopped inside its thinking: the tag stays open.
        return f"<think>{reasoning}" + (f"</think>{content}" if content else "")


def request_body(messages: list[dict], params: dict[str, Any], model: str, *,
                 tools: list[dict] | None = None) -> dict[str, Any]:
    """The body of a plain request (Request.body)."""
    return Request(messages=messages, params=params, model=model, tools=tools).body()


@dataclass(frozen=True, slots=True)
class Task:
    """A claimed task under its parameters version (`params`)."""
    number: int
    samples: int
    params: dict[str, Any]

    @property
    def row(self) -> int:
        return self.number // self.samples

    def id(self, turn: int = 1) -> TaskId:
        return TaskId.of(self.number, self.samples, turn)

    def seed(self, turn: int | None = None, retry: int = 0) -> int | None:
        """The seed of the task's request: each sample, each `turn` of a `--turns all`
        conversation (also in a run of one sample: one seed would make a chain's turns sample
        alike) and each schema `retry` its own (request_seed); None for the one request of a
        run of one sample, which sends its parameters as they are."""
        if turn is None and not retry and self.samples == 1:
            return None
        return task_seed(self.number, self.samples, self.params, retry, turn or 1)

    def request(self, messages: list[dict], model: str, tools: list[dict] | None = None, *,
                turn: int | None = None, retry: int = 0) -> Request:
        """The request for the answer after `messages`, under its seed (Task.seed)."""
        return Request(messages=messages, params=self.params, model=model, tools=tools,
                       seed=self.seed(turn, retry))
