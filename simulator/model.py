"""Pure completion model: a prompt's natural length, and its answer's ids, one per position.

The straight answer to a prompt is fixed by the prompt's ids (and a request's seed): its
natural length, where its thinking closes, and so the id at each position. A context that
already holds the answer's first ids goes on from where they leave off, so a continued answer
joined to its start is the straight one, ids and text."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

from genq.simulator import tokens as tk
from genq.simulator.settings import LengthDist

# Share of a natural completion spent thinking, like the reasoning model the run served.
THINK_SHARE = 0.7
# Qwen's <|im_end|>: the id SGLang reports as `matched_stop` when a completion ends naturally.
STOP_TOKEN_ID = tk.IM_END
# One token is one short word, so texts are cheap to build and easy to count.
THINK, ANSWER = ("hmm", " hmm"), ("ok", " ok")
OPEN, WORD_T, CLOSE, SEP, WORD_A, STOP, CALL, NL_T = range(8)
NL = tk.VOCAB["\n"]


def unit_draw(text: str, seed: int) -> float:
    """A uniform number in the open interval (0, 1), fixed by the prompt text and the seed."""
    digest = hashlib.sha256(f"{seed}\x00{text}".encode()).digest()
    n = int.from_bytes(digest[:8], "big") >> 11
    # (n + 1) / (2**53 + 2) never reaches 0 or 1, which the normal quantile cannot take.
    return (n + 1) / (2**53 + 2)


def natural_length(text: str, seed: int, dist: LengthDist) -> int:
    return dist.draw(unit_draw(text, seed))


def prompt_key(prompt_ids: list[int], request_seed: object = None) -> str:
    """What seeds a prompt's answer: its ids, and the request's `seed` when it gives one."""
    key = ",".join(map(str, prompt_ids))
    return key if request_seed is None else f"{key}|seed={request_seed}"


class Shape(NamedTuple):
    """A straight answer's layout: its length, where `</think>` and the answer's words start,
    the call's ids as written (`tail`, from `tail_at`), and whether its thinking has
    Qwen3's `<think>\\n` ... `\\n</think>` (room for a word between: a toy's limit, a shorter
    one thinks without the newlines)."""

    length: int
    close: int
    answer_at: int
    tail: tuple[int, ...]
    tail_at: int
    lines: bool


@dataclass(frozen=True, slots=True)
class Completion:
    """What the model produces for one request: the straight answer's positions
    `start .. start + tokens`, before they are shaped into a response."""

    natural: int
    tokens: int
    thinking: bool
    start: int = 0
    # A tool call's text (its ids), the answer's last before its stop token; an answer too
    # short for it grows to hold it.
    call: tuple[int, ...] = ()
    # A fault may force another finish: "abort", or "missing" (no finish_reason at all).
    forced_finish: str = ""
    # Prompt tokens the server's prefix cache held: they cost no prefill time, and a chat
    # answer reports them as cached_tokens only when `cache_report` (--enable-cache-report).
    cached_tokens: int = 0
    cache_report: bool = True

    @property
    def close(self) -> int:
        """Where `</think>` stands in the straight answer (-1 without thinking)."""
        return max(1, int(self.natural * THINK_SHARE) - 1) if self.thinking else -1

    @property
    def length(self) -> int:
        """The straight answer's ids, its stop token included: the natural length, or more
        where its call (and the newline before it after words) would not fit after the
        thinking."""
        return self.shape().length

    def shape(self) -> Shape:
        """Where the straight answer's parts stand, worked out once for a run of positions."""
        close = self.close
        answer_at = close + 2 if self.thinking else 0
        # The answer's words before a call: none, or at least one and the newline after them.
        room = self.natural - 1 - len(self.call) - answer_at
        words = 0 if room <= 0 or not self.call else max(1, room - 1)
        # A call after words follows a newline, as Qwen3's template writes it after content.
        tail = (NL, *self.call) if words else self.call
        length = answer_at + words + len(tail) + 1 if self.call else self.natural
        return Shape(length, close, answer_at, tail, length - 1 - len(tail), close >= 4)

    @property
    def finish_reason(self) -> str | None:
        if self.forced_finish:
            return None if self.forced_finish == "missing" else self.forced_finish
        return "length" if self.length > self.start + self.tokens else "stop"

    @property
    def reasoning_tokens(self) -> int:
        """New ids up to and including `</think>`."""
        return max(0, min(self.start + self.tokens, self.close + 1) - self.start)

    def kind(self, i: int, shape: Shape | None = None) -> int:
        at = shape or self.shape()
        if i == at.length - 1:
            return STOP
        if i >= at.tail_at:
            return CALL
        if not self.thinking:
            return WORD_A
        close = at.close
        if at.lines and (i == 1 or i == close - 1):
            return NL_T
        return (OPEN if i == 0 else WORD_T if i < close else CLOSE if i == close
                else SEP if i == close + 1 else WORD_A)

    def token(self, i: int, shape: Shape | None = None) -> int:
        at = shape or self.shape()
        kind = self.kind(i, at)
        if kind == WORD_T:
            return tk.VOCAB[THINK[i > (2 if at.lines else 1)]]
        if kind == WORD_A:
            return tk.VOCAB[ANSWER[i > at.answer_at]]
        if kind == CALL:
            return at.tail[i - at.tail_at]
        return (tk.THINK_OPEN, 0, tk.THINK_CLOSE, tk.VOCAB["\n\n"], 0, tk.IM_END, 0, NL)[kind]

    def ids(self) -> list[int]:
        shape = self.shape()
        return [self.token(i, shape) for i in range(self.start, self.start + self.tokens)]


def resume_at(generated: list[int], natural: int, thinking: bool,
              call: tuple[int, ...] = ()) -> int:
    """The straight answer's position a context's answer-so-far has reached, read from what it
    holds, as a model reads its context: the words it wrote, and whether its thinking closed.
    Ids that are a true prefix give their own length (a cut inside the call too); a text
    prefix missing the blank line after `</think>` (a client that rebuilt it from the parsed
    split) still lands right."""
    if not generated:
        return 0
    probe = Completion(natural, natural, thinking, call=call)
    shape = probe.shape()
    if len(generated) <= shape.length and all(
            token == probe.token(i, shape) for i, token in enumerate(generated)):
        return len(generated)
    words = sum(1 for i in generated if i in (tk.VOCAB["hmm"], tk.VOCAB[" hmm"],
                                               tk.VOCAB["ok"], tk.VOCAB[" ok"]))
    if not thinking:
        return words
    if tk.THINK_CLOSE in generated:
        after = generated[generated.index(tk.THINK_CLOSE) + 1:]
        answer = sum(1 for i in after if i in (tk.VOCAB["ok"], tk.VOCAB[" ok"]))
        return probe.close + 1 + (1 + answer if answer or tk.VOCAB["\n\n"] in after else 0)
    lines = generated.count(NL) if shape.lines else 0  # `<think>\n`, and `\n` before its close
    return min(1 + lines + words, probe.close) if tk.THINK_OPEN in generated else words


def complete(natural: int, max_tokens: int, thinking: bool, start: int = 0,
             call: tuple[int, ...] = ()) -> Completion:
    """The part of a straight answer a request decodes: from `start`, at most `max_tokens`."""
    whole = Completion(natural=natural, tokens=0, thinking=thinking, call=call).length
    start = min(start, whole)
    return Completion(natural=natural, tokens=max(0, min(whole - start, max_tokens)),
                      thinking=thinking, start=start, call=call)


def texts(done: Completion, parser: bool, a: int = 0, b: int | None = None,
          calls: bool = True) -> tuple[str | None, str]:
    """(reasoning_content, content) that new ids a..b add (default: all of them).

    With a reasoning parser (the streamed chunks; whole answers are `parsed`) the thinking
    words go to reasoning_content, the tags and the blank line after `</think>` to neither, as
    SGLang 0.5.23's streamed chunks carry them (tests/test_chunk_shapes.py); a completion that
    never closed its thinking has content "". Without one, reasoning_content is null and
    content is the raw text, tags and all. The stop token is never text; a call's is left out
    unless `calls` (a stream gives the call parsed, at its end)."""
    b = done.tokens if b is None else b
    if b <= a:
        return None, ""
    shape = done.shape()
    kinds = {i: done.kind(i, shape) for i in range(done.start + a, done.start + b)}
    span = [i for i, kind in kinds.items() if calls or kind != CALL]
    if not done.thinking or not parser:
        return None, tk.decode([done.token(i, shape) for i in span], skip_special=True)
    reasoning = tk.decode([done.token(i, shape) for i in span if kinds[i] in (WORD_T, NL_T)])
    return reasoning, tk.decode([done.token(i, shape) for i in span if kinds[i] == WORD_A])


def parsed(raw: str, forced: bool, previous: str = "") -> tuple[str | None, str]:
    """A whole (non-streamed) answer's raw text split as SGLang 0.5.23's qwen3 parser splits
    it (Qwen3Detector.detect_and_parse): with thinking on (`forced`) text before any
    `</think>` is thinking, tags or not; a continued answer's start (`previous`, sent with
    continue_final_message) says whether its thinking is open. It reads no positions, so the
    new text of an `input_ids` continuation is split from that fresh start, as SGLang's is.
    Nothing is stripped; empty thinking is null."""
    thinking = ("<think>" in previous or forced) and "</think>" not in previous
    if not thinking and "<think>" not in raw:
        return None, raw
    while raw.startswith("<think>"):
        raw = raw[len("<think>"):]
    if "</think>" in raw:
        reasoning, _, content = raw.partition("</think>")
    else:
        reasoning, content = ("", raw) if "</think>" in previous else (raw, "")
    return reasoning or None, content


def usage(done: Completion, prompt_tokens: int) -> dict:
    """The `usage` object of a chat answer, keys as SGLang 0.5.23 sends them:
    `completion_tokens_details` is null without reasoning tokens, `prompt_tokens_details`
    without --enable-cache-report; with it `{"cached_tokens": N}` always, 0 on a miss."""
    reasoning = done.reasoning_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + done.tokens,
        "completion_tokens": done.tokens,
        "prompt_tokens_details": ({"cached_tokens": done.cached_tokens}
                                  if done.cache_report else None),
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
    }
