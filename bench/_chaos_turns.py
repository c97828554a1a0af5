"""The `--turns all` mode of the chaos soak (`python bench/chaos.py --turns all`): agentic coding
conversations (bench/_conversations.py rows, and a few malformed rows that must fail alone with
their reason), two samples each, with token ids, every shard shipped to S3 (moto's server). Its
faults are the ones such a run meets: a consumer SIGKILLed or stopped with SIGTERM, Redis lost
outright (killed, its AOF deleted) and rebuilt by `genq recover`, `genq requeue --inflight abort`,
and a lost node (a consumer SIGKILLed and its --out deleted), repaired once the run settles by
the command docs/SLURM.md gives (`genq requeue --redo missing --from-s3 URI`). The first faults
are one of each kind, in that order. It ends with the checks: nothing lost, every
conversation's turns 1..m once in the S3 export, `genq status` == the export's sums."""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import _conversations as data
import orjson
from _chaos_checks import superseded
from _common import genq
from chaos import RUN, STOP_BOUND_S, Soak
from faultkit import bits
from moto.server import ThreadedMotoServer
from pipeline import read_jsonl
from test_conversations import requests_served

from genq.common.net import free_port
from genq.common.queue.keys import RunKeys
from genq.common.queue.run import failure_reasons
from genq.common.report.status import read_status

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


class S3:
    """moto's S3 server on a real socket, a bucket in it, and AWS_* set for every genq process
    started after it."""

    def __init__(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(),
                                         verbose=False)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line a request otherwise
        self.server.start()
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://127.0.0.1:{self.server._port}")
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        self.server.stop()


class TurnsSoak(Soak):
    FAULTS = FAULTS

    def __init__(self, a, workdir: Path) -> None:
        self.s3 = S3()
        self.lost: list[str] = []  # output directories of lost nodes, deleted
        self.recovers: list[dict] = []
        self.repair = ""
        super().__init__(a, workdir)

    # --- the data set and the processes --------------------------------------------------
    def write_data(self, path: Path) -> list[str]:
        """bench/_conversations.py rows with the broken rows spread among them."""
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

    # --- faults --------------------------------------------------------------------------
    def fire(self) -> None:
        """One of each kind first, in FAULTS' order (a lost node after a Redis loss, whose
        `recover --partial` would run its lost turns again: the repair has them to do), then
        drawn by weight."""
        for kind in [kind for kind in self.FAULTS if not self.fired[kind]]:
            if getattr(self, kind)():
                self.fired[kind] += 1
                return
        super().fire()

    def redis_busy(self) -> bool:
        return not self.redis.up or any(t is self.redis for _, _, t in self.later)

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

    def requeue(self) -> bool:
        """New parameters, aborting the requests running under the old ones."""
        if self.redis_busy():
            return False
        change, at = f"temperature={round(self.rng.uniform(0.1, 1.0), 2)}", time.time()
        out = genq("requeue", "--set", change, "--inflight", "abort", redis_url=self.redis.url,
                   run=RUN, check=False)
        if out.returncode != 0:
            return False
        version = int(out.stdout.split("parameters version ", 1)[1].split(":", 1)[0])
        self.requeues.append({"version": version, "at": at, "redo": "none", "set": change})
        return True

    def lost_node(self) -> bool:
        """A consumer SIGKILLed and its --out deleted; a new node (a new, empty directory and
        name) takes its place."""
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

    # --- the end -------------------------------------------------------------------------
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

    def report(self, timing: dict, stops: dict) -> dict:
        checks, figures = self.checks()
        terms = [*self.term_exits, *stops.values()]
        checks["every_process_stopped_on_sigterm"] = all(t[0] == 0 for t in terms)
        checks["every_recover_succeeded"] = all(rec["rc"] == 0 for rec in self.recovers)
        return {"settings": {k: v for k, v in vars(self.a).items() if k not in ("json", "keep")},
                "checks": checks, **figures, **timing, "faults": dict(self.fired),
                "faults_total": sum(self.fired.values()), "requeues": self.requeues,
                "recovers": self.recovers, "lost_nodes": len(self.lost), "repair": self.repair,
                "restarts": {p.name: p.starts - 1 for p in [*self.consumers, self.redis]},
                "sigterm_exit_s_max": max((t[1] for t in terms), default=0.0),
                "sigterm_exits": [t for t in terms if t[0] != 0]}

    def checks(self) -> tuple[dict, dict]:
        """(checks: name -> passed, figures), on the S3 export and `genq status`."""
        k, r = RunKeys(RUN), self.r
        done, failed = bits(r.get(k.done), self.tasks), bits(r.get(k.failed), self.tasks)
        out = self.dir / "export.jsonl"
        exported = genq("export", "--from-s3", URI, "--out", str(out), redis_url=self.redis.url,
                        run=RUN, check=False)
        records = read_jsonl(out) if out.exists() else []
        chains: dict[int, list[dict]] = {}
        for rec in records:
            chains.setdefault(rec["index"] * SAMPLES + rec.get("sample", 0), []).append(rec)
        whole = [task for task, chain in chains.items() if self.whole(task, chain)]
        status = read_status(r, RUN)
        reasons = dict(zip(sorted(failed), failure_reasons(r, k, sorted(failed)), strict=True))
        bad = {i * SAMPLES + s: re.sub(r"\d+", "N", words) for i, (_, words) in self.broken.items()
               for s in range(SAMPLES)}
        switched = {h["version"]: h["at"]
                    for h in map(orjson.loads, r.lrange(k.params_history, 0, -1))}
        for q in self.requeues:  # the moment Redis switched, not when the command was started
            q["at"] = switched.get(q["version"], q["at"])
        stale = superseded(records, self.requeues)
        checks = {
            "nothing_lost": len(done | failed) == self.tasks and not done & failed,
            "export_whole_from_s3": exported.returncode == 0,
            "every_conversation_turns_1_to_m_once": sorted(chains) == sorted(done)
            and len(whole) == len(chains),
            "broken_rows_failed_alone_with_their_reason": failed == set(bad) and all(
                bad[t] in str(reasons.get(t, "")) for t in bad),
            "no_turn_under_superseded_parameters": not stale,
            "status_equals_export": (
                status["done"] == len(done) and status["failed"] == len(failed)
                and status["conversations"]["generations"] == len(records)
                and status["finish_reasons"] == dict(Counter(x["finish_reason"]
                                                             for x in records))
                and status["output_tokens_total"] == sum(x["completion_tokens"]
                                                         for x in records)
                and status["prompt_tokens_total"] == sum(x["prompt_tokens"] for x in records)),
            "queue_and_leases_empty": r.llen(k.rq_queue) == 0 and r.zcard(k.leases) == 0,
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
        self.s3.stop()
