"""Command line of the simulator: parse flags into Settings, then serve until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable

import orjson
import structlog

from genq.simulator import httpserver
from genq.simulator.api import App
from genq.simulator.settings import LengthDist, Settings, parse_length_dist

log = structlog.get_logger()


def _number(kind: type, test: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
        return value

    return convert


def _length_dist(text: str) -> LengthDist:
    try:
        return parse_length_dist(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One clear line instead of the whole usage block, so the mistake is easy to see.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="simulator", description="A simulated SGLang server.")
    positive_int = _number(int, lambda v: v >= 1, "at least 1")
    positive = _number(float, lambda v: v > 0, "greater than 0")
    rate = _number(float, lambda v: 0 <= v <= 1, "between 0 and 1")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=_number(int, lambda v: 0 <= v <= 65535, "a TCP port"), default=30000
    )
    p.add_argument(
        "--max-running-requests",
        type=positive_int,
        default=None,
        help="requests run at once; without it /get_server_info reports null, as SGLang 0.5 "
        "does, and --effective-max-running applies",
    )
    p.add_argument(
        "--effective-max-running",
        type=positive_int,
        default=40,
        help="requests run at once when --max-running-requests is not given (SGLang sizes "
        "this from memory; /v1/loads reports it)",
    )
    p.add_argument(
        "--max-total-tokens",
        type=positive_int,
        default=1_000_000,
        help="KV-cache pool in tokens; running requests' prompt + output tokens must fit in it "
        "together (reported in /v1/loads as max_total_num_tokens)",
    )
    p.add_argument(
        "--context-length",
        type=positive_int,
        default=32768,
        help="prompt + max_tokens one request may use; more is refused with SGLang's 400",
    )
    p.add_argument(
        "--warmup",
        type=_number(float, lambda v: v >= 0, "0 or more"),
        default=0.0,
        help="seconds /health answers 503 after start",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["qwen3", "deepseek-r1"],
        default=None,
        help="put thinking in reasoning_content; without it thinking stays in content",
    )
    p.add_argument(
        "--tool-call-parser",
        type=lambda v: None if v == "none" else v,
        choices=["qwen25", "qwen", None],
        default="qwen25",
        help="parse the <tool_call> text of answers to requests with tools into tool_calls "
        "(none: calls stay text, as SGLang without the flag)",
    )
    p.add_argument(
        "--legacy-get-load",
        action="store_true",
        help="serve /get_load instead of /v1/loads, like SGLang before 0.5",
    )
    p.add_argument(
        "--no-token-ids",
        action="store_true",
        help="ignore return_token_ids, like a gateway or a server that cannot return ids",
    )
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="report the prefix cache's hits as usage.prompt_tokens_details.cached_tokens, "
        "as SGLang's flag of that name",
    )
    p.add_argument(
        "--decode-tps",
        type=positive,
        default=87.5,
        help="output tokens per second of each running request",
    )
    p.add_argument(
        "--ttft",
        type=_number(float, lambda v: v >= 0, "0 or more"),
        default=0.5,
        help="seconds to the first token",
    )
    p.add_argument(
        "--prefill-tps",
        type=positive,
        default=None,
        help="prompt tokens per second the prefill reads, added to --ttft; tokens the prefix "
        "cache holds cost nothing (without it: the flat --ttft whatever the prompt)",
    )
    p.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="tokens per streamed chunk, as SGLang's --stream-interval (default 1: a chunk "
        "per token); a simulator that cannot keep the pace says so (simulator_behind)",
    )
    p.add_argument(
        "--time-scale",
        type=positive,
        default=1.0,
        help="run this many times faster than --decode-tps and --ttft say",
    )
    p.add_argument(
        "--length-dist",
        type=_length_dist,
        default="lognormal:2326:0.62",
        help="natural completion length: lognormal:MEDIAN:SIGMA or fixed:N",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="sim-model")
    p.add_argument("--error-rate", type=rate, default=0.0, help="share answered 503")
    p.add_argument("--hang-rate", type=rate, default=0.0, help="share never answered")
    p.add_argument(
        "--reset-rate", type=rate, default=0.0, help="share whose connection is reset mid-response"
    )
    p.add_argument(
        "--invalid-json-rate", type=rate, default=0.0,
        help="share of answers to a json_schema response_format that do not match it",
    )
    p.add_argument(
        "--tool-call-rate", type=rate, default=1.0,
        help="share of answers to a request with tools that call its first tool (the rest "
        "answer in text); decided by the prompt's ids and the seeds",
    )
    p.add_argument(
        "--tool-chains",
        action="store_true",
        help="instead of --tool-call-rate: call the first tool while the tool results after the "
        "last user message are fewer than its chain length (1-20, drawn from its text and "
        "--seed), then answer in text, as an agent ends a chain",
    )
    p.add_argument(
        "--parallel-calls",
        action="store_true",
        help="an answer that calls, calls every tool of the request at once, the last first "
        "(a model making a row's parallel calls in its own order)",
    )
    p.add_argument(
        "--bad-marker",
        default="__GENQ_BAD__",
        help="a prompt containing this text is rejected with HTTP 400",
    )
    return p


def parse_settings(argv: list[str] | None) -> Settings:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.error_rate + args.hang_rate + args.reset_rate > 1:
        parser.error("--error-rate, --hang-rate and --reset-rate add up to more than 1")
    return Settings(**{k: v for k, v in vars(args).items()})


def configure_logging() -> None:
    """JSON lines when not on a terminal, the console renderer on one (house style)."""
    tty = sys.stderr.isatty()
    renderer = (
        structlog.dev.ConsoleRenderer()
        if tty
        else structlog.processors.JSONRenderer(serializer=lambda o, **_: orjson.dumps(o))
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info if not tty else (lambda _l, _m, e: e),
            renderer,
        ],
        logger_factory=(
            structlog.PrintLoggerFactory(sys.stderr)
            if tty
            else structlog.BytesLoggerFactory(sys.stderr.buffer)
        ),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )


async def serve(settings: Settings) -> None:
    app = App(settings)
    server = await httpserver.start(app, settings.host, settings.port)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "sim_listening",
        url=f"http://{settings.host}:{port}",
        model=settings.model,
        max_running_requests=settings.running_limit,
        time_scale=settings.time_scale,
        length_dist=str(settings.length_dist),
    )
    await stop.wait()
    # Close the listener only: waiting for keep-alive clients to leave could take forever;
    # asyncio.run cancels the open connections, which aborts their requests.
    server.close()


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    configure_logging()
    try:
        asyncio.run(serve(settings))
    except OSError as exc:
        log.error("sim_listen_failed", host=settings.host, port=settings.port, error=str(exc))
        return 1
    return 0
