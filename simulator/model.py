"""Pure completion model: a prompt's natural length, its thinking/answer split, and its text."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from genq.simulator.settings import LengthDist

# Share of a natural completion spent thinking, like the reasoning model the run served.
THINK_SHARE = 0.7
# Qwen's <|im_end|>: the id SGLang reports as `matched_stop` when a completion ends naturally.
STOP_TOKEN_ID = 151645
# One token is one short word, so texts are cheap to build and easy to count.
THINK_WORD = "hmm "
ANSWER_WORD = "ok "


def unit_draw(text: str, seed: int) -> float:
    """A uniform number in the open interval (0, 1), fixed by the prompt text and the seed."""
    digest = hashlib.sha256(f"{seed}\x00{text}".encode()).digest()
    n = int.from_bytes(digest[:8], "big") >> 11
    # (n + 1) / (2**53 + 2) never reaches 0 or 1, which the normal quantile cannot take.
    return (n + 1) / (2**53 + 2)


def natural_length(text: str, seed: int, dist: LengthDist) -> int:
    return dist.draw(unit_draw(text, seed))


def count_words(text: str) -> int:
    return len(text.split())


@dataclass(frozen=True, slots=True)
class Completion:
    """What the model produced for one request, before it is shaped into a response."""

    natural: int
    tokens: int
    reasoning_tokens: int
    thinking: bool
    # A fault may force another finish: "abort", or "missing" (no finish_reason at all).
    forced_finish: str = ""
    # A continuation (continue_final_message): where its prefix stopped, "thinking" or
    # "answer"; the counts above are of this part, whose text goes on from the prefix's word.
    after: str = ""

    @property
    def finish_reason(self) -> str | None:
        if self.forced_finish:
            return None if self.forced_finish == "missing" else self.forced_finish
        return "length" if self.natural > self.tokens else "stop"

    @property
    def content_tokens(self) -> int:
        return self.tokens - self.reasoning_tokens

    def reasoning_text(self) -> str | None:
        # Thinking switched off means no reasoning at all (null), as SGLang's parser gives.
        if not self.thinking:
            return None
        return (THINK_WORD * self.reasoning_tokens).rstrip()

    def content_text(self) -> str:
        # A completion cut inside its thinking has an empty answer: truncation, not an error.
        return (ANSWER_WORD * self.content_tokens).rstrip()

    def raw_text(self) -> str:
        """The unparsed text `/generate` returns, thinking wrapped in Qwen-style tags."""
        if not self.thinking:
            return self.content_text()
        if self.content_tokens == 0 and self.finish_reason == "length":
            return "<think>" + self.reasoning_text()
        return f"<think>{self.reasoning_text()}</think>\n\n{self.content_text()}"


def texts(done: Completion, parser: bool, tokens: int | None = None) -> tuple[str | None, str]:
    """(reasoning_content, content) after `tokens` decoded tokens (default: all of them).

    With a reasoning parser the thinking goes to reasoning_content, and a completion that never
    closed its thinking has content "" (as SGLang's qwen3 parser does). Without one,
    reasoning_content is null and content is the raw text, thinking tags and all. Each prefix
    is a prefix of the next, so a stream of deltas adds up to the whole answer."""
    k = done.tokens if tokens is None else tokens
    if k == 0:
        return None, ""
    think = min(k, done.reasoning_tokens)
    reasoning = (THINK_WORD * think).rstrip()
    answer = (ANSWER_WORD * (k - think)).rstrip()
    if reasoning and done.after == "thinking":  # the words go on from the prefix's last one
        reasoning = " " + reasoning
    if answer and done.after == "answer":
        answer = " " + answer
    if not done.thinking:
        return None, answer
    if parser:
        return reasoning, answer
    if k == done.tokens:
        return None, done.raw_text()
    if k > done.reasoning_tokens:
        return None, f"<think>{reasoning}</think>\n\n{answer}"
    return None, "<think>" + reasoning


def complete(natural: int, max_tokens: int, thinking: bool) -> Completion:
    """Cut a natural completion at `max_tokens`; thinking comes first, then the answer."""
    tokens = min(natural, max_tokens)
    think = int(natural * THINK_SHARE) if thinking else 0
    return Completion(
        natural=natural, tokens=tokens, reasoning_tokens=min(think, tokens), thinking=thinking
    )


def usage(done: Completion, prompt_tokens: int) -> dict:
    """The `usage` object of a chat answer, keys as SGLang 0.5.23 sends them:
    `completion_tokens_details` is null without reasoning tokens."""
    reasoning = done.reasoning_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + done.tokens,
        "completion_tokens": done.tokens,
        "prompt_tokens_details": None,
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
    }
