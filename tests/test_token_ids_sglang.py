"""A `--token-ids` run against the simulator and, in the real-server tier, a real SGLang 0.5.23:
every record's ids are the ones the server returns for the same request, and a row's tools
reach the prompt as the server's chat template renders them (the same row without its tools
has other prompt ids)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
from conftest import genq
from pipeline import one_at_a_time
from sglang_servers import server_fixture

from genq.common import params
from genq.common.task import request_body

TOOLS = [{"type": "function", "function": {
    "name": "run_shell", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]


server = server_fixture("tuned")


def rendered_by_the_models_tokenizer(messages: list[dict], tools: list[dict] | None, *,
                                     thinking: bool = True) -> list[int]:
    return rendered_all([(messages, tools, thinking)])[0]


def rendered_all(prompts: list[tuple[list[dict], list[dict] | None, bool]]) -> list[list[int]]:
    """The prompt ids the real tier's model gives each (messages, tools, thinking): its
    tokenizer and the chat template the server runs (scripts/real-sglang/chat_template.jinja),
    the tools as SGLang hands them to the template (its own Tool model, dumped: `defer_loading:
    null` added). One process for all: its imports take seconds of CPU."""
    base = Path(os.environ.get("BASE") or Path.home() / ".cache" / "genq-real-sglang")
    template = Path(__file__).parent.parent / "scripts" / "real-sglang" / "chat_template.jinja"
    code = ("import json, sys; from transformers import AutoTokenizer; "
            "from sglang.srt.entrypoints.openai.protocol import Tool; "
            "a = json.load(sys.stdin); t = AutoTokenizer.from_pretrained(a['model']); "
            "jinja = open(a['template']).read(); out = []\n"
            "for messages, tools, thinking in a['prompts']:\n"
            " tools = [Tool.model_validate(x).model_dump() for x in tools or []] or None\n"
            " ids = t.apply_chat_template(messages, tools=tools, chat_template=jinja, "
            "add_generation_prompt=True, enable_thinking=thinking, tokenize=True)\n"
            " out.append(list(ids if isinstance(ids, list) else ids['input_ids']))\n"
            "print(json.dumps(out))")
    out = subprocess.run([str(base / "venv" / "bin" / "python"), "-c", code], check=True,
                         capture_output=True, text=True, timeout=120, input=json.dumps(
                             {"model": str(base / "tiny-model"), "prompts": prompts,
                              "template": str(template)}))
    return json.loads(out.stdout)


def test_records_hold_the_servers_ids_and_tools_reach_the_prompt(
        server, tmp_path, redis_url, run_name):
    rows = []
    for i in range(4):
        messages = [{"role": "user", "content": f"List the files of project {i}."}]
        rows += [{"id": f"t{i}", "messages": messages, "tools": TOOLS},
                 {"id": f"p{i}", "messages": messages}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    genq("produce", str(data), "--once", "--token-ids", "--max-tokens", "24",
         "--temperature", "0", redis_url=redis_url, run=run_name)
    # One request at a time, as the direct requests below are sent.
    records = {rec["id"]: rec for rec in one_at_a_time(server, tmp_path, redis_url, run_name)}
    assert len(records) == 8
    for i in range(4):
        with_tools, plain = records[f"t{i}"], records[f"p{i}"]
        assert with_tools["prompt_token_ids"] != plain["prompt_token_ids"]
        assert len(with_tools["prompt_token_ids"]) > len(plain["prompt_token_ids"])
    for row in rows[:4]:
        rec = records[row["id"]]
        body = request_body(
            row["messages"], {**params.DEFAULTS, "max_tokens": 24, "temperature": 0,
                              "return_token_ids": True}, rec["model"], tools=row.get("tools"))
        choice = httpx.post(server.url + "/v1/chat/completions", json=body,
                            timeout=120).json()["choices"][0]
        assert rec["prompt_token_ids"] == choice["prompt_token_ids"]
        assert rec["completion_token_ids"] == choice["response_token_ids"]
        assert len(rec["completion_token_ids"]) == rec["completion_tokens"]
        if server.kind == "real":
            assert rec["prompt_token_ids"] == rendered_by_the_models_tokenizer(
                row["messages"], row.get("tools"))
