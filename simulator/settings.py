"""The simulator's frozen settings and its completion-length distribution."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

_NORMAL = NormalDist()


@dataclass(frozen=True, kw_only=True)
class LengthDist:
    """Natural completion lengths: `lognormal` around a median, or `fixed`."""

    kind: str
    median: float = 0.0
    sigma: float = 0.0
    n: int = 0

    def draw(self, u: float) -> int:
        """Map a uniform draw in (0, 1) to a length of at least one token."""
        if self.kind == "fixed":
            return self.n
        return max(1, round(self.median * math.exp(self.sigma * _NORMAL.inv_cdf(u))))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.n}"
        return f"lognormal:{self.median:g}:{self.sigma:g}"


def parse_length_dist(spec: str) -> LengthDist:
    """Parse `lognormal:MEDIAN:SIGMA` or `fixed:N`; raise ValueError with the reason."""
    kind, _, rest = spec.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind == "fixed" and len(parts) == 1:
            n = int(parts[0])
            if n < 1:
                raise ValueError("fixed length must be at least 1")
            return LengthDist(kind="fixed", n=n)
        if kind == "lognormal" and len(parts) == 2:
            median, sigma = float(parts[0]), float(parts[1])
            if not (median >= 1 and 0 <= sigma < 10):
                raise ValueError("need MEDIAN >= 1 and 0 <= SIGMA < 10")
            return LengthDist(kind="lognormal", median=median, sigma=sigma)
    except ValueError as exc:
        raise ValueError(f"bad length distribution {spec!r}: {exc}") from None
    raise ValueError(f"bad length distribution {spec!r}: use lognormal:MEDIAN:SIGMA or fixed:N")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything the simulator is told at start; rates may later be changed at runtime."""

    host: str = "127.0.0.1"
    port: int = 30000
    # None: launched without --max-running-requests, as most SGLang servers are; it then
    # reports null in /get_server_info and runs `effective_max_running` at once.
    max_running_requests: int | None = None
    effective_max_running: int = 40
    # The KV-cache pool in tokens (SGLang's --max-total-tokens): running requests' prompt and
    # output tokens must fit in it together, so a small pool caps concurrency below the slots.
    max_total_tokens: int = 1_000_000
    # Prompt + completion tokens one request may use (max_model_len in /v1/models).
    context_length: int = 32768
    # Seconds /health answers 503 after start, as SGLang does while it warms up.
    warmup: float = 0.0
    # None: thinking stays in `content` (SGLang without --reasoning-parser); "qwen3": split.
    reasoning_parser: str | None = None
    # SGLang's --tool-call-parser: answers to requests with tools parsed for calls (None: off).
    tool_call_parser: str | None = "qwen25"
    # Serve /get_load instead of /v1/loads, as SGLang before 0.5 did (0.5.x: 404).
    legacy_get_load: bool = False
    # Ignore return_token_ids (an OpenAI-only gateway in front of the server, an older build).
    no_token_ids: bool = False
    # Tokens per streamed chunk (SGLang's --stream-interval): 1, one chunk per decode step.
    stream_interval: int = 1
    # Report the prefix cache's hits in chat usage (SGLang's --enable-cache-report).
    enable_cache_report: bool = False
    decode_tps: float = 87.5
    ttft: float = 0.5
    # Prompt tokens per second the prefill reads, on top of --ttft; only the tokens the prefix
    # cache did not hold are read. None: prefill costs the flat --ttft, whatever the prompt.
    prefill_tps: float | None = None
    time_scale: float = 1.0
    # Calibrated on the real run: at max_tokens 4096, ~18 % truncate and the median is ~2326.
    length_dist: LengthDist = LengthDist(kind="lognormal", median=2326, sigma=0.62)
    seed: int = 0
    model: str = "sim-model"
    error_rate: float = 0.0
    hang_rate: float = 0.0
    reset_rate: float = 0.0
    invalid_json_rate: float = 0.0
    # Share of requests with tools whose answer calls the first one (the rest answer in text).
    tool_call_rate: float = 1.0
    # Instead of the rate: call while the chain after the last user message is shorter than
    # toolcalls.chain_length of that message, then answer in text (an agent's final answer).
    tool_chains: bool = False
    # An answer that calls, calls every tool of the request at once, in reverse order.
    parallel_calls: bool = False
    bad_marker: str = "__GENQ_BAD__"

    @property
    def running_limit(self) -> int:
        """Requests run at once: as launched, else what the server sizes for itself."""
        return self.max_running_requests or self.effective_max_running
