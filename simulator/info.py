"""What the simulator says about itself, in SGLang 0.5.23's shapes: model and server info,
the load per data-parallel rank, the model list, and Prometheus metrics."""

from __future__ import annotations

import time
from typing import Any

from genq.simulator.engine import Engine
from genq.simulator.settings import Settings

VERSION = "0.5.23-sim"


def model_info(s: Settings, e: Engine) -> dict[str, Any]:
    return {
        "model_path": s.model,
        "served_model_name": s.model,
        "tokenizer_path": s.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "reasoning_parser": s.reasoning_parser,
    }


def server_info(s: Settings, e: Engine) -> dict[str, Any]:
    # max_running_requests is null unless given at launch; the value in force is in
    # internal_states (and in /v1/loads), as SGLang 0.5.23 reports it.
    return {
        "model_path": s.model,
        "tokenizer_path": s.model,
        "served_model_name": s.model,
        "host": s.host,
        "port": s.port,
        "context_length": None,
        "max_running_requests": s.max_running_requests,
        "max_queued_requests": None,
        "dp_size": 1,
        "reasoning_parser": s.reasoning_parser,
        # 0.5.23 launched with `qwen25` says `qwen`, the name it has for that parser now.
        "tool_call_parser": "qwen" if s.tool_call_parser == "qwen25" else s.tool_call_parser,
        "enable_metrics": True,
        "max_req_input_len": s.context_length - 6,
        "internal_states": [{"effective_max_running_requests_per_dp": s.running_limit}],
        "version": VERSION,
        "simulator": {
            "decode_tps": s.decode_tps,
            "ttft": s.ttft,
            "prefill_tps": s.prefill_tps,
            "time_scale": s.time_scale,
            "length_dist": str(s.length_dist),
            "seed": s.seed,
        },
    }


def loads(s: Settings, e: Engine) -> dict[str, Any]:
    """`GET /v1/loads`: one entry per data-parallel rank (the simulator has one)."""
    used = e.tokens_in_use()
    rank = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": e.slots.running,
        "num_waiting_reqs": e.slots.waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": s.max_total_tokens,
        "max_running_requests": s.running_limit,
        # SGLang rounds token_usage to two decimals; kept exact here, the client rounds.
        "token_usage": used / s.max_total_tokens,
        "gen_throughput": round(e.gen_throughput(), 2),
    }
    return {"version": VERSION, "loads": [rank]}


def get_load(s: Settings, e: Engine) -> list[dict[str, Any]]:
    """`GET /get_load` of SGLang before 0.5 (only with --legacy-get-load)."""
    slots = e.slots
    return [
        {
            "dp_rank": 0,
            "num_reqs": slots.running,
            "num_waiting_reqs": slots.waiting,
            "num_tokens": e.tokens_in_use(),
        }
    ]


def models(s: Settings, e: Engine) -> dict[str, Any]:
    model = {
        "id": s.model,
        "object": "model",
        "created": int(e.started),
        "owned_by": "sglang",
        "root": s.model,
        "parent": None,
        "max_model_len": s.context_length,
    }
    return {"object": "list", "data": [model]}


def metrics_text(s: Settings, e: Engine) -> str:
    model = s.model.replace('"', "")
    label = f'{{model_name="{model}"}}'
    rows = [
        ("num_running_reqs", "gauge", "The number of running requests.", e.slots.running),
        (
            "num_queue_reqs",
            "gauge",
            "Requests in the waiting queue.",
            e.slots.waiting,
        ),
        ("num_used_tokens", "gauge", "The number of used tokens.", e.tokens_in_use()),
        (
            "prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            e.stats.prompt_tokens,
        ),
        (
            "generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            e.stats.output_tokens,
        ),
        ("num_requests_total", "counter", "Number of requests processed.", e.stats.completed),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [
            f"# HELP sglang:{name} {help_text}",
            f"# TYPE sglang:{name} {kind}",
            f"sglang:{name}{label} {float(value)}",
        ]
    return "\n".join(lines) + "\n"
