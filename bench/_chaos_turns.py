"""`python bench/chaos.py --turns all` (docs/RELIABILITY.md): bench/_conversations.py rows and a
few malformed ones that must fail alone with their reason, two samples each, token ids, every
shard shipped to S3 (moto); lost nodes repaired by `genq requeue --redo missing --from-s3`."""

from __future__ import annotations

import re
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import _conversations as data
import orjson
from _chaos_kit import run_checks
from _common import genq, moto_s3
from chaos import RUN, STOP_BOUND_S, Soak
from pipeline import read_jsonl
from test_conversations import requests_served

from genq.common.queue.keys import RunKeys
from genq.common.queue.run import failure_reasons

BUCKET = "genq-chaos"
URI = f"s3://{BUCKET}/runs/chaos"
SAMPLES = 2
HEAD = [{"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Read f1.py and fix it."}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "f1.py"}'}}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "def parse(text): ..."}
DONE = {"role": "assistant", "content": "Fixed."}
# Rows as people's logs hold them, that genq cannot make a prompt of: (messages, the words
# their failure must hold). Each fails alone, at its first claim, in both its samples.
BROKEN = {
    "calls-object": ([*HEAD, {"role": "assistant", "content": None, "tool_calls": CALL},
                      RESULT, DONE], "message 2: 'tool_calls' is an object, not a list"),
    "args-not-json": ([*HEAD, {"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "read_file", "arguments": "{path: f1.py"}}]}, RESULT, DONE],
        "message 2: tool_calls[0].function.arguments is not a JSON object"),
    "unknown-role": ([*HEAD, {"role": "observation", "content": "ls: a.py"}, DONE],
                     "message 2: unknown role 'observation'"),
}
FAULTS = {"consumer_kill": 3, "consumer_term": 2, "requeue": 1, "redis_loss": 1, "lost_node": 1}


class TurnsSoak(Soak):
    FAULTS = FAULTS

    def __init__(self, a, workdir: Path) -> None:
        self.s3 = ExitStack()
        self.s3.enter_context(moto_s3(BUCKET))
        self.lost: list[str] = []  # output directories of lost nodes, deleted
        self.recovers: list[dict] = []
        self.repair = ""
        super().__init__(a, workdir)

    def write_data(self, path: Path) -> list[str]:
        lines = [orjson.dumps(row) for row in data.rows(self.a.prompts, self.a.seed)]
        self.broken: dict[int, tuple[str, str]] = {}
        at = sorted(self.rng.sample(range(len(lines)), min(len(BROKEN), len(lines))))
        for where, (name, (messages, _)) in zip(reversed(at), BROKEN.items(), strict=False):
            lines.insert(where, orjson.dumps({"id": name, "messages": messages,
                                              "tools": [data.tool("read_file")]}))
        for index, line in enumerate(lines):
            name = orjson.loads(line)["id"]
            if name in BROKEN:
                self.broken[index] = (name, BROKEN[name][1])
        path.write_bytes(b"\n".join(lines) + b"\n")
        self.rows = [orjson.loads(line)["messages"] for line in lines]
        self.tasks = len(lines) * SAMPLES
        return ["--turns", "all", "--samples", str(SAMPLES), "--token-ids", "--max-tokens",
                "600"]

    def sim_extra(self) -> dict:
        # Each turn calls the row's first tool while the row's chain goes on, then answers in
        # text, so every conversation runs all its turns (bench/conversations.py).
        return {"tool_chains": True, "seed": self.a.seed, "enable_cache_report": True}

    def consumer_extra(self) -> list[str]:
        return ["--s3-uri", URI, "--shard-records", "50"]

    def fire(self) -> None:
        """One of each kind first, in FAULTS' order (a lost node after a Redis loss, whose
        `recover --partial` would run its lost turns again: the repair has them to do), then
        drawn by weight."""
        for kind in [kind for kind in self.FAULTS if not self.fired[kind]]:
            if getattr(self, kind)():
                self.fired[kind] += 1
                return
        super().fire()

    def redis_loss(self) -> bool:
        """Redis killed and started empty (its AOF gone too); `genq recover` from the outputs
        that survive and what S3 holds (`--partial` once a node, and its directory, is lost)."""
        if self.redis_busy():
            return False
        self.redis.kill()
        shutil.rmtree(self.dir / "redis")
        (self.dir / "redis").mkdir()
        self.redis.start()
        dirs = [str(d) for d in self.out_dirs if d.exists()]
        out = genq("recover", *(("--shards", *dirs) if dirs else ()), "--from-s3", URI,
                   *(("--partial",) if self.lost else ()), redis_url=self.redis.url, run=RUN,
                   check=False)
        self.recovers.append({"rc": out.returncode, "said": (out.stdout + out.stderr)[-600:]})
        return True

    def requeue_change(self) -> tuple[str, str, list[str]]:
        return f"temperature={round(self.rng.uniform(0.1, 1.0), 2)}", "none", ["--inflight",
                                                                             "abort"]

    def lost_node(self) -> bool:
        """A consumer SIGKILLed and its --out deleted; a new node (directory, name) replaces it."""
        if not (c := self.free(self.consumers)):
            return False
        c.kill()
        i = self.consumers.index(c)
        old = self.out_dirs[i]
        shutil.rmtree(old, ignore_errors=True)
        self.lost.append(str(old))
        self.out_dirs[i] = self.dir / f"out{i}-{c.starts}"
        c.args[c.args.index(str(old))] = str(self.out_dirs[i])
        c.args[c.args.index("--name") + 1] = f"c{i}-{c.starts}"
        self.restart_later(c, 0.5, 3)
        return True

    def finish(self) -> None:
        """Once settled: the consumers stopped (SIGTERM: they ship what they hold), then the
        lost nodes' turns made again by the documented repair, and the run settled again."""
        for c in self.consumers:  # one just started back must be up before it hears SIGTERM
            c.wait_started(60)
        self.term_exits += [(*c.stop(STOP_BOUND_S), c.name) for c in self.consumers]
        if self.lost:
            self.repair_lost()
        self.served = requests_served(*self.sims)  # before the simulators stop

    def repair_lost(self) -> None:
        out = genq("requeue", "--redo", "missing", "--from-s3", URI, redis_url=self.redis.url,
                   run=RUN, check=False)
        self.repair = (out.stdout + out.stderr).strip()
        print(f"repair: {self.repair[-400:]}", file=sys.stderr, flush=True)
        for c in self.consumers:
            c.start()
        deadline = time.monotonic() + self.a.timeout
        while not self.settled():
            if time.monotonic() > deadline:
                raise TimeoutError("not settled after the repair")
            time.sleep(0.2)

    def checks(self) -> tuple[dict, dict]:
        k, r = RunKeys(RUN), self.r
        out = self.dir / "export.jsonl"
        exported = genq("export", "--from-s3", URI, "--out", str(out), redis_url=self.redis.url,
                        run=RUN, check=False)
        records = read_jsonl(out) if out.exists() else []
        chains: dict[int, list[dict]] = {}
        for rec in records:
            chains.setdefault(rec["index"] * SAMPLES + rec.get("sample", 0), []).append(rec)
        whole = [task for task, chain in chains.items() if self.whole(task, chain)]
        done, failed, status, stale, checks = run_checks(r, k, self.tasks, records, self.requeues)
        reasons = dict(zip(sorted(failed), failure_reasons(r, k, sorted(failed)), strict=True))
        bad = {i * SAMPLES + s: re.sub(r"\d+", "N", words) for i, (_, words) in self.broken.items()
               for s in range(SAMPLES)}
        checks |= {
            "export_whole_from_s3": exported.returncode == 0,
            "every_conversation_turns_1_to_m_once": sorted(chains) == sorted(done)
            and len(whole) == len(chains),
            "broken_rows_failed_alone_with_their_reason": failed == set(bad) and all(
                bad[t] in str(reasons.get(t, "")) for t in bad),
            "status_generations_equal_export": status["conversations"]["generations"]
            == len(records),
            "every_recover_succeeded": all(rec["rc"] == 0 for rec in self.recovers),
        }
        served = self.served
        probes = sum(c.starts for c in self.consumers)  # one a --token-ids consumer's start
        figures = {
            "conversations": self.tasks, "done": len(done), "failed": len(failed),
            "generations": len(records), "requests_served": served,
            "asked_again": served - probes - len(records),
            "status": {key: status.get(key) for key in ("done", "failed", "finish_reasons",
                                                        "output_tokens_total",
                                                        "prompt_tokens_total")}
            | {"generations": status["conversations"]["generations"]},
            "export_said": (exported.stdout + exported.stderr)[-600:],
            "not_whole": sorted(set(chains) - set(whole))[:20], "superseded": stale[:20],
            "failure_reasons": {t: str(v)[:120] for t, v in list(reasons.items())[:10]},
            "recovers": self.recovers, "lost_nodes": len(self.lost), "repair": self.repair,
        }
        return checks, figures

    def whole(self, task: int, chain: list[dict]) -> bool:
        """Turns 1..m once, m the row's assistant turns, or fewer with the last saying why."""
        chain.sort(key=lambda rec: rec["turn"])
        turns = sum(m["role"] == "assistant" for m in self.rows[task // SAMPLES])
        if [rec["turn"] for rec in chain] != list(range(1, len(chain) + 1)):
            return False
        return len(chain) == turns or chain[-1].get("stopped") in ("diverged", "truncated",
                                                                   "unanswered")

    def close(self) -> None:
        super().close()
        self.s3.close()
