"""`--turns all` against `--turns last` on the same rows (bench/_conversations.py), Redis and
fast simulators (`--tool-chains`: they call where the rows call); each arm the windowed producer
and a `genq consume --burst` a simulator, to the end or --deadline (then SIGTERM). Arm `bare`:
bench/_bare_turns.py, one a simulator.

    python bench/conversations.py                          # 100,000 conversations
    python bench/conversations.py --conversations 50 --deadline 60   # a smoke run
    python bench/conversations.py --arms all                         # --turns all alone
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _common as kit
import _conversations as data
import orjson
from faultkit import Background
from pipeline import wait_for

from genq.common.queue.keys import RunKeys

SIM = [*kit.FAST_SIM, "--enable-cache-report"]
ARMS = ("last", "all")
BARE = Path(__file__).resolve().parent / "_bare_turns.py"
# Arm `speculators`: its regenerate-responses, offline, given vLLM's names for SGLang's ids.
SPECULATORS = """import os, sys; os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
from speculators.__main__ import app
regen = sys.modules["speculators.cli.regenerate_responses"]; post = regen._post_chat
async def vllm_names(*args, **kwargs):
    data = await post(*args, **kwargs)
    data["prompt_token_ids"] = (c := data["choices"][0])["prompt_token_ids"]
    c["token_ids"] = c["response_token_ids"]
    return data
regen._post_chat = vllm_names; app()"""


class Arm:

    def __init__(self, turns: str, a, srv, sims, work: Path, dataset: Path) -> None:
        self.turns, self.a, self.srv, self.sims = turns, a, srv, sims
        self.run, self.work, self.dataset = f"conv-{turns}", work / turns, dataset
        self.r, self.k = srv.client(), RunKeys(self.run)
        self.env = kit.genq_env(srv.url, self.run)
        self.figures: dict = {"turns": turns}

    def status(self) -> dict:
        return orjson.loads(kit.genq("status", "--json", redis_url=self.srv.url,
                                     run=self.run).stdout)

    def mid_run(self) -> None:
        walls = [kit.latency(self.status) for _ in range(3)]
        self.figures["status_mid_s"] = statistics.median(walls)
        self.figures["redis_b_mid"] = kit.used_memory(self.r) - self.base
        self.figures["mid_status"] = self.status()
        print(f"[{self.turns}] mid-run at {time.monotonic() - self.started:.0f} s (load average "
              f"{kit.load_average()}): genq status {self.figures['status_mid_s']} s, Redis "
              f"{self.figures['redis_b_mid'] / 2**20:.1f} MB", file=sys.stderr, flush=True)

    def consume(self) -> None:
        outs = [self.work / f"out{n}" for n in range(len(self.sims))]
        procs = [kit.consumer(self.srv.url, self.run, "--server", sim.url, "--burst", "--out",
                              str(out)) for sim, out in zip(self.sims, outs, strict=True)]
        self.started, peak, mid, stopped = time.monotonic(), 0, False, False
        redis = kit.redis_use(self.r)

        def tick() -> None:
            nonlocal peak, mid, stopped
            if any(p.returncode not in (None, 0, -signal.SIGTERM) for p in procs):
                raise SystemExit(f"a consumer exited {[p.returncode for p in procs]}")
            elapsed = time.monotonic() - self.started
            if not mid and (self.r.bitcount(self.k.done) >= self.a.conversations // 2
                            or elapsed >= self.a.deadline / 2):
                mid = True
                self.mid_run()
            if not stopped and elapsed > self.a.deadline:
                stopped = True
                print(f"[{self.turns}] deadline: stopping the consumers", file=sys.stderr)
                for proc in procs:
                    if proc.returncode is None:
                        proc.send_signal(signal.SIGTERM)
            peak = max(peak, kit.used_memory(self.r) - self.base)

        got = kit.reap(procs, tick, period=0.25)
        self.figures["redis"] = [b - a for a, b in zip(redis, kit.redis_use(self.r),
                                                       strict=True)]
        self.figures.update(wall_s=round(time.monotonic() - self.started, 1),
                            complete=not stopped, redis_b_peak=peak,
                            consumer_cpu_s=round(sum(g[1] for g in got.values()), 2))
        self.outs = outs

    def bare(self) -> dict:
        procs = [subprocess.Popen([sys.executable, str(BARE), sim.url, str(self.dataset), str(i),
                                   str(len(self.sims)), str(self.a.max_tokens)],
                                  stdout=subprocess.PIPE) for i, sim in enumerate(self.sims)]
        start, got = time.monotonic(), kit.reap(procs, period=0.25)
        outs = [orjson.loads(p.stdout.read()) for p in procs]  # one that failed has no line
        return self.client(start, got, sum(o["generations"] for o in outs),
                           sum(o["stopped"] for o in outs))

    def client(self, start: float, got: dict, gens: int, stopped) -> dict:
        gens, wall = max(1, gens), time.monotonic() - start
        return {**self.figures, "generations": gens, "wall_s": round(wall, 1), "complete": True,
                "stopped": stopped, "generations_per_s": round(gens / wall),
                "cpu_ms_per_generation": round(1000 * sum(g[1] for g in got.values()) / gens, 3)}

    def speculators(self) -> dict:
        """SPECULATORS (start-up included), 64 conversations at once on the first simulator."""
        tok, out = self.work.with_name("qwen-tok"), self.work.with_name("speculators.jsonl")
        __import__("test_drafter_pipelines").qwen_tokenizer().save_pretrained(tok)
        proc = subprocess.Popen([sys.executable, "-c", SPECULATORS, "regenerate-responses",
                                 "--endpoint", f"{self.sims[0].url}/v1/chat/completions",
                                 "--model", str(tok), "--dataset", str(self.dataset),
                                 "--max-tokens", str(self.a.max_tokens), "--outfile", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start, got = time.monotonic(), kit.reap([proc], period=0.25)
        return self.client(start, got, sum(1 for _ in open(out, "rb")), "-")

    def timed(self, *args: str) -> dict:  # under `ulimit -n 256`; failing there, unlimited
        try:
            return kit.timed(list(args), self.env, nofile=256)
        except SystemExit as failed:
            print(f"[{self.turns}] under ulimit -n 256: {str(failed)[-300:]}", file=sys.stderr)
            return {**kit.timed(list(args), self.env), "failed_at_256_files": str(failed)[-200:]}

    def finish(self) -> None:
        f = self.figures
        f["redis_b_end"] = kit.used_memory(self.r) - self.base
        f["status_end"] = before = self.status()
        f["stopped"] = (before.get("conversations") or {}).get("stopped", "-")
        f["export"] = self.timed("export", "--out", str(self.work / "all.jsonl"), "--overwrite")
        f["generations"] = sum(1 for _ in open(self.work / "all.jsonl", "rb"))
        self.r.flushall()  # what a restart without persistence leaves
        f["recover"] = self.timed("recover", "--shards", *map(str, self.outs))
        after = self.status()
        for key in ("total", "done", "failed"):
            if before.get(key) != after.get(key):
                raise SystemExit(f"[{self.turns}] {key}: {before.get(key)} before FLUSHALL, "
                                 f"{after.get(key)} recovered")
        self.r.flushall()

    def registered(self, producer: Background) -> bool:
        if producer.proc.poll() is not None and not self.r.exists(self.k.done):
            raise SystemExit(f"[{self.turns}] genq produce exited: {producer.log()[-2000:]}")
        return bool(self.r.exists(self.k.done))

    def measure(self) -> dict:
        if self.turns in ("bare", "speculators"):  # clients of their own: no genq run
            return getattr(self, self.turns)()
        self.work.mkdir()
        self.base = kit.used_memory(self.r)
        producer = Background(self.srv.url, self.run, "produce", str(self.dataset), "--turns",
                              self.turns, "--max-tokens", str(self.a.max_tokens),
                              *["--token-ids"][:self.a.token_ids])
        try:
            wait_for(lambda: self.registered(producer), timeout=600, what="the run registered")
            self.consume()
        finally:
            producer.stop()
            producer.cleanup()
        self.finish()
        f, n, gens = self.figures, self.a.conversations, max(1, self.figures["generations"])
        f.update(cpu_ms_per_generation=round(1000 * f["consumer_cpu_s"] / gens, 3),
                 generations_per_conversation=round(gens / n, 2),
                 generations_per_s=round(gens / f["wall_s"], 1),
                 **{f"redis_b_per_conversation_{w}": round(f[f"redis_b_{w}"] / n, 1)
                    for w in ("mid", "end", "peak")},
                 redis_cpu_ms=round(1000 * f["redis"][0] / gens, 3),
                 redis_commands=round(f["redis"][1] / gens, 2),
                 evalsha=round(f["redis"][2] / gens, 2))
        return f


ROWS = (("generations", "generations"), ("per conversation", "generations_per_conversation"),
        ("complete", "complete"), ("conversations stopped", "stopped"), ("wall s", "wall_s"),
        ("generations/s", "generations_per_s"),
        ("consumer CPU ms / generation", "cpu_ms_per_generation"),
        ("Redis CPU ms / generation", "redis_cpu_ms"), ("EVALSHA / generation", "evalsha"),
        ("Redis commands / generation (Lua's too)", "redis_commands"),
        ("Redis B / conversation, mid-run", "redis_b_per_conversation_mid"),
        ("Redis B / conversation, peak", "redis_b_per_conversation_peak"),
        ("Redis B / conversation, end", "redis_b_per_conversation_end"),
        ("genq status s, mid-run (median of 3)", "status_mid_s"),
        ("genq export s (peak RSS MB)", "export"), ("genq recover s (peak RSS MB)", "recover"))


def report(arms: dict[str, dict]) -> str:
    both, rows = set(ARMS) <= set(arms), []
    for name, key in ROWS:
        timed = key.endswith(("export", "recover"))
        cells = ["-" if key not in f else f"{f[key]['wall_s']} ({f[key]['rss_mb']})" if timed
                 else f[key] for f in arms.values()]
        if both:
            x, y = (arms[t][key]["wall_s"] if timed else arms[t][key] for t in ("all", "last"))
            num = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (x, y))
            cells.append(f"{x / y:.2f}" if num and y else "-")
        rows.append((name, *cells))
    return kit.table(rows, ("figure", *(f"--turns {t}" for t in arms),
                            *(("all/last",) if both else ())))


def main() -> int:
    p = kit.parser(__doc__)
    p.add_argument("--conversations", type=int, default=100_000)
    p.add_argument("--consumers", type=int, default=2, help="each on its own simulator")
    p.add_argument("--seed", type=int, default=0, help="the data set's")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--deadline", type=float, default=2400, help="seconds an arm's consumers run")
    p.add_argument("--token-ids", action="store_true", help="genq arms: produce --token-ids")
    p.add_argument("--arms", default=",".join(ARMS), help="last, all, bare, speculators: in order")
    a = p.parse_args()
    sim = [*SIM, "--tool-chains", "--seed", str(a.seed)]
    figures: dict = {"load_average_before": kit.load_average(), "args": vars(a)}
    with kit.workdir() as work, kit.private_redis() as srv, \
            kit.simulators(a.consumers, *sim) as sims:
        start = time.monotonic()
        dataset = data.write(work / "conversations.jsonl", a.conversations, a.seed)
        figures["dataset"] = {**data.shape(list(data.rows(min(a.conversations, 5000), a.seed))),
                              "bytes": dataset.stat().st_size,
                              "write_s": round(time.monotonic() - start, 1)}
        print(f"data set: {figures['dataset']}", file=sys.stderr, flush=True)
        arms = {turns: Arm(turns, a, srv, sims, work, dataset).measure()
                for turns in a.arms.split(",")}
    figures.update(arms, load_average_after=kit.load_average())
    print(report(arms))
    kit.dump_json(a.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
