"""Continuous batching: FIFO admission to a fixed number of decode slots, faults and counters."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import structlog

from genq.simulator.httpserver import ResetConnection
from genq.simulator.kv import Slots
from genq.simulator.model import Completion
from genq.simulator.prefix import PrefixCache
from genq.simulator.settings import Settings

log = structlog.get_logger()

# A streamed answer sends what was decoded about this often (real seconds), like SGLang's
# per-step chunks but cheap enough for hundreds of streams on two cores.
BEHIND_WARN_S = 1.0  # a stream this far behind its schedule is worth a warning
STALL_POLL_S = 0.05  # how soon decoding goes on once a `stall` fault ends

Emit = Callable[[int], None]


class ApiError(Exception):
    """A request answered with an HTTP error status and SGLang's error object."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError",
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.retry_after = retry_after  # sent as Retry-After when set


@dataclass
class Stats:
    """Counters since start; `GET /_sim/stats` shows them with the live gauges."""

    received: int = 0
    completed: int = 0
    aborted: int = 0
    bad_requests: int = 0
    fault_errors: int = 0
    hung: int = 0
    resets: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    load_reads: int = 0  # GETs of /v1/loads (or /get_load), answered or not yet
    # The most a stream fell behind its schedule (real seconds): the simulator could not keep
    # the pace --time-scale and --stream-interval ask for.
    behind_s: float = 0.0
    # Answers to a json_schema response_format by kind: valid, invalid, cut (simulator/schema.py).
    json_answers: dict[str, int] = field(default_factory=dict)


@dataclass
class Faults:
    """Injected failures: per-request rates, and timed modes set through `POST /_sim/faults`."""

    error_rate: float = 0.0
    hang_rate: float = 0.0
    reset_rate: float = 0.0
    invalid_json_rate: float = 0.0  # answers to a json_schema that do not match it
    status: int | None = None
    status_until: float = 0.0
    hang_until: float = 0.0
    info_hang_until: float = 0.0  # the info endpoints (load, server info) do not answer
    stall_from: float = 0.0  # decoding stands still from stall_from to stall_until
    stall_until: float = 0.0
    info_html_until: float = 0.0  # they answer a maintenance page (HTML) with 200
    reset_until: float = 0.0
    finish: str = ""
    finish_until: float = 0.0
    retry_after: int | None = None  # seconds the fault statuses ask the client to wait
    error_marker: str = ""  # a prompt holding it is answered 503 every time (a poison prompt)
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def pick(self) -> str | int | None:
        """The fault for one request: an HTTP status, "hang", "reset" or None."""
        now = time.monotonic()
        if self.status is not None and now < self.status_until:
            return self.status
        if now < self.hang_until:
            return "hang"
        if now < self.reset_until:
            return "reset"
        u = self.rng.random()
        if u < self.error_rate:
            return 503
        if u < self.error_rate + self.hang_rate:
            return "hang"
        if u < self.error_rate + self.hang_rate + self.reset_rate:
            return "reset"
        return None

    def stalled_between(self, start: float, end: float) -> float:
        """Seconds of [start, end] the `stall` fault covers."""
        return max(0.0, min(end, self.stall_until) - max(start, self.stall_from))

    def forced_finish(self) -> str:
        """The finish reason answers are given while the `finish` fault lasts, else ""."""
        return self.finish if time.monotonic() < self.finish_until else ""

    def view(self) -> dict:
        now = time.monotonic()
        left = {k: max(0.0, getattr(self, k + "_until") - now)
                for k in ("status", "hang", "reset", "info_hang", "stall", "info_html")}
        return {
            "error_rate": self.error_rate,
            "hang_rate": self.hang_rate,
            "reset_rate": self.reset_rate,
            "invalid_json_rate": self.invalid_json_rate,
            "status": self.status if left["status"] > 0 else None,
            "status_left_s": left["status"],
            "hang_left_s": left["hang"],
            "reset_left_s": left["reset"],
            "info_hang_left_s": left["info_hang"],
            "stall_left_s": left["stall"],
            "info_html_left_s": left["info_html"],
            "finish": self.forced_finish() or None,
            "retry_after": self.retry_after,
            "error_marker": self.error_marker or None,
        }


@dataclass(slots=True)
class _Running:
    prompt_tokens: int
    tokens: int
    started: float
    first_token_s: float  # simulated seconds from admission to the first token


class Engine:
    """Runs generation requests through the slots, applying faults and keeping counters."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.slots = Slots(settings.running_limit, settings.max_total_tokens)
        self.stats = Stats()
        self.prefix = PrefixCache(settings.max_total_tokens)
        self.faults = self.initial_faults()
        self._active: dict[int, _Running] = {}
        self._ids = itertools.count()
        self.started = time.time()
        self._said_behind = False
        # The decoding clock: monotonic time less what `stall` faults took, as of _clock_at.
        self._clock_at = time.monotonic()
        self._clock = self._clock_at

    def initial_faults(self) -> Faults:
        s = self.settings
        return Faults(
            error_rate=s.error_rate,
            hang_rate=s.hang_rate,
            reset_rate=s.reset_rate,
            invalid_json_rate=s.invalid_json_rate,
            rng=random.Random(s.seed),
        )

    def clock(self) -> float:
        """Decoding time: the monotonic clock, standing still while a `stall` fault lasts
        (running requests make no progress and the queue stays, as on a server that froze)."""
        now = time.monotonic()
        self._clock += now - self._clock_at - self.faults.stalled_between(self._clock_at, now)
        self._clock_at = now
        return self._clock

    async def sleep(self, seconds: float) -> None:
        """Sleep `seconds` of decoding time; 0 still yields to the other requests."""
        end = self.clock() + seconds
        await asyncio.sleep(max(0.0, seconds))
        while (left := end - self.clock()) > 1e-3:
            await asyncio.sleep(STALL_POLL_S if self.faults.stall_until > time.monotonic()
                                else left)

    async def run(
        self, prompt_tokens: int, completion: Completion, emit: Emit | None = None
    ) -> None:
        """Queue, decode and finish one request; cancellation (client gone) aborts it.
        `emit(tokens_so_far)` is called as tokens are decoded (streamed answers)."""
        fault = self.faults.pick()
        if isinstance(fault, int):
            self.stats.fault_errors += 1
            raise ApiError(fault, f"simulated fault: HTTP {fault}", _error_kind(fault),
                           self.faults.retry_after)
        try:
            if fault == "hang":
                self.stats.hung += 1
                await asyncio.Event().wait()
            await self._decode(prompt_tokens, completion, emit)
        except asyncio.CancelledError:
            self.stats.aborted += 1
            raise
        self.stats.prompt_tokens += prompt_tokens
        self.stats.output_tokens += completion.tokens
        if fault == "reset":
            self.stats.resets += 1
            raise ResetConnection
        self.stats.completed += 1

    async def _decode(self, prompt_tokens: int, completion: Completion, emit: Emit | None) -> None:
        s = self.settings
        cost = prompt_tokens + completion.tokens  # what it will hold in the KV pool at its end
        await self.slots.acquire(cost)
        key = next(self._ids)
        first = self.first_token_s(prompt_tokens, completion.cached_tokens)
        try:
            self._active[key] = _Running(prompt_tokens, completion.tokens, self.clock(), first)
            if emit is None:
                await self.sleep((first + completion.tokens / s.decode_tps) / s.time_scale)
            else:
                await self._decode_steps(first, completion.tokens, emit)
        finally:
            self._active.pop(key, None)
            self.slots.release(cost)

    def first_token_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Simulated seconds from admission to the first token: --ttft, plus the prompt tokens
        the prefix cache did not hold at --prefill-tps (the cached ones are not computed again,
        which is what a prefix cache is for; the report flag does not change it)."""
        s = self.settings
        if s.prefill_tps is None:
            return s.ttft
        return s.ttft + max(0, prompt_tokens - cached_tokens) / s.prefill_tps

    async def _decode_steps(self, first_token_s: float, tokens: int, emit: Emit) -> None:
        """Emit every --stream-interval tokens on the schedule --decode-tps and --time-scale
        set; never fewer, larger chunks: a simulator too slow for the pace falls behind and
        says so (`simulator_behind` once, `behind_s` in /_sim/stats)."""
        s = self.settings
        await self.sleep(first_token_s / s.time_scale)
        per_s = s.decode_tps * s.time_scale
        done = min(1, tokens)  # the first token comes with the prefill, as in SGLang
        emit(done)
        start = self.clock()
        while done < tokens:
            done += min(s.stream_interval, tokens - done)
            late = self.clock() - (start + (done - 1) / per_s)
            await self.sleep(max(0.0, -late))  # 0: still yields to the other streams
            if late > self.stats.behind_s:
                self.stats.behind_s = late
                if late > BEHIND_WARN_S and not self._said_behind:
                    self._said_behind = True
                    log.warning("simulator_behind", behind_s=round(late, 2),
                                hint="lower --time-scale or raise --stream-interval")
            emit(done)

    def tokens_in_use(self) -> int:
        """Prompt plus generated-so-far tokens of the running requests (SGLang's `num_tokens`)."""
        s = self.settings
        now = self.clock()
        total = 0
        for r in self._active.values():
            decoded = ((now - r.started) * s.time_scale - r.first_token_s) * s.decode_tps
            total += r.prompt_tokens + min(r.tokens, max(0, int(decoded)))
        return total

    def gen_throughput(self) -> float:
        """Output tokens per (real) second the batch decodes now: each running request past
        its first token decodes at --decode-tps, scaled by --time-scale."""
        s = self.settings
        now = self.clock()
        decoding = sum(1 for r in self._active.values()
                       if (now - r.started) * s.time_scale >= r.first_token_s)
        return decoding * s.decode_tps * s.time_scale

    def stats_view(self) -> dict:
        return {
            **asdict(self.stats),
            "running": self.slots.running,
            "waiting": self.slots.waiting,
            "max_running_seen": self.slots.max_running_seen,
            "max_running_requests": self.slots.limit,
        }


def _error_kind(status: int) -> str:
    kinds = {400: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
    return kinds.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
