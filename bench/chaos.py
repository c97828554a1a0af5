"""A seeded chaos soak (docs/RELIABILITY.md): a real run (Redis with AOF, simulators, consumers,
the windowed producer, the monitor) under random faults, then the checks; exit 1 if any fails.
The seed fixes the draws (a busy target is drawn again, so timing varies the mix).

    python bench/chaos.py --prompts 20000 --faults 60 --seed 1 --json chaos.json
    python bench/chaos.py --turns all --prompts 300 --faults 25   # bench/_chaos_turns.py
"""

from __future__ import annotations

import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import redis
from _chaos_kit import Proc, Redis, Simulator, final_checks, genq_proc
from _common import dump_json, genq, parser, sim_flags, write_dataset
from faultkit import sim_kwargs

from genq.common.net import free_port
from genq.common.queue.keys import RunKeys

RUN = "chaos"
STOP_BOUND_S = 30.0  # a consumer: --grace 2, then at most 5 s for slots stuck on Redis
POISON, VT = 5, 4.0  # rows every server refuses (HTTP 400); consumers' visibility timeout
FAULTS = {"consumer_kill": 3, "consumer_term": 2, "consumer_pause": 1, "redis_kill": 2,
          "sim_503": 1, "sim_reset": 1, "sim_hang": 1, "sim_restart": 1, "requeue": 1}
SIM_FAULTS = {"sim_503": ({"status": 503}, 4), "sim_reset": ({"reset": True}, 3),
              "sim_hang": ({"hang": True}, 3)}  # kind: (the simulator's fault, longest s)


def parse(argv: list[str] | None):
    p = parser(__doc__)
    p.add_argument("--prompts", type=int, default=20000)
    p.add_argument("--faults", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--servers", type=int, default=3, help="simulators, one consumer each")
    p.add_argument("--slots", type=int, default=16, help="max_running_requests per server")
    p.add_argument("--request-s", type=float, default=0.1, help="mean request time, seconds")
    p.add_argument("--fault-every", type=float, default=3.0, help="seconds between faults")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--turns", choices=("last", "all"), default="last",
                   help="all: agentic conversations shipped to S3 (bench/_chaos_turns.py)")
    return p.parse_args(argv)


class Soak:
    FAULTS = FAULTS

    def __init__(self, a, workdir: Path) -> None:
        self.a, self.dir, self.rng = a, workdir, random.Random(a.seed)
        self.redis = Redis(workdir)
        self.redis.start()
        self.r = redis.Redis.from_url(self.redis.url, socket_timeout=5)
        self.k = RunKeys(RUN)
        data, self.tasks = workdir / "data.jsonl", a.prompts
        produce = self.write_data(data)
        flags = sim_flags(**sim_kwargs(a.request_s, max_running_requests=a.slots,
                                       **self.sim_extra()))
        self.sims = [Simulator(i, workdir, flags) for i in range(a.servers)]
        genq("produce", str(data), "--once", *produce, redis_url=self.redis.url, run=RUN)
        self.out_dirs = [workdir / f"out{i}" for i in range(a.servers)]
        self.consumers = [self.service(f"consumer{i}", [
            "consume", "--server", sim.url, "--out", str(self.out_dirs[i]), "--name", f"c{i}",
            "--visibility-timeout", str(VT), "--grace", "2", "--request-timeout", "10",
            "--max-attempts", "10", *self.consumer_extra()]) for i, sim in enumerate(self.sims)]
        self.others = [self.service("producer", ["produce", str(data), *produce]),
                       self.service("monitor", [
                           "monitor", "--host", "127.0.0.1", "--port", str(free_port()),
                           "--progress-file", str(workdir / "progress.json")])]
        for proc in [*self.sims, *self.consumers, *self.others]:
            proc.start()
        self.later: list[tuple[float, str, object]] = []  # (when, what, target)
        self.fired: Counter = Counter()
        self.requeues: list[dict] = []
        self.term_exits: list[tuple] = []  # (exit status, seconds, name)

    def write_data(self, data: Path) -> list[str]:
        self.poison = set(self.rng.sample(range(self.a.prompts), min(POISON, self.a.prompts)))
        write_dataset(data, self.a.prompts, poison=tuple(self.poison))
        return ["--max-tokens", "300"]

    def sim_extra(self) -> dict:
        return {}

    def consumer_extra(self) -> list[str]:
        return []

    def service(self, name: str, args: list[str]) -> Proc:
        marker = b'"consumer_started"' if name.startswith("consumer") else b""
        return genq_proc(name, args, self.dir, self.redis.url, RUN, marker)

    def fire(self) -> None:
        kinds, weights = zip(*self.FAULTS.items(), strict=True)
        for _ in range(20):  # a kind whose target is busy (down, paused) is drawn again
            kind = self.rng.choices(kinds, weights)[0]
            if self.sim_fault(kind) if kind in SIM_FAULTS else getattr(self, kind)():
                self.fired[kind] += 1
                return

    def free(self, procs: list[Proc]) -> Proc | None:
        busy = {id(target) for _, _, target in self.later}
        ready = [p for p in procs if p.started and id(p) not in busy]
        return self.rng.choice(ready) if ready else None

    def restart_later(self, proc: Proc, lo: float, hi: float) -> None:
        self.later.append((time.monotonic() + self.rng.uniform(lo, hi), "start", proc))

    def consumer_kill(self) -> bool:
        if c := self.free(self.consumers):
            c.kill()
            self.restart_later(c, 0.5, 3)
        return c is not None

    def consumer_term(self) -> bool:
        if c := self.free(self.consumers):
            self.term_exits.append((*c.stop(STOP_BOUND_S), c.name))
            self.restart_later(c, 0.5, 2)
        return c is not None

    def consumer_pause(self) -> bool:
        if c := self.free(self.consumers):
            c.signal(signal.SIGSTOP)
            when = time.monotonic() + VT + self.rng.uniform(1, 3)
            self.later.append((when, "cont", c))
        return c is not None

    def redis_busy(self) -> bool:
        return not self.redis.up or any(t is self.redis for _, _, t in self.later)

    def redis_kill(self) -> bool:
        # Redis (appendfsync everysec) may forget its last second of writes when killed; a
        # requeue forgotten that way would be Redis's loss, not genq's, so none is that recent.
        recent = self.requeues and time.time() - self.requeues[-1]["at"] < 2.5
        if not recent and not self.redis_busy():
            self.redis.kill()
            self.restart_later(self.redis, 0.5, 3)
            return True
        return False

    def sim_fault(self, kind: str) -> bool:
        fault, longest = SIM_FAULTS[kind]
        fault = {**fault, "for_s": self.rng.uniform(1, longest)}  # before the target, as seeded
        if s := self.free(self.sims):
            s.fault(fault)
        return s is not None

    def sim_restart(self) -> bool:
        if s := self.free(self.sims):
            s.kill()
            self.restart_later(s, 0.5, 2)
        return s is not None

    def requeue_change(self) -> tuple[str, str, list[str]]:
        """The next requeue's (--set, --redo, flags): every third redoes truncated results."""
        if len(self.requeues) % 3 == 2:
            return f"max_tokens={self.rng.randint(250, 350)}", "truncated", ["--redo", "truncated"]
        return f"temperature={round(self.rng.uniform(0.1, 1.0), 2)}", "none", ["--redo", "none"]

    def requeue(self) -> bool:
        if self.redis_busy():
            return False
        change, redo, flags = self.requeue_change()
        at = time.time()
        out = genq("requeue", "--set", change, *flags, redis_url=self.redis.url, run=RUN,
                   check=False)
        if out.returncode != 0:
            return False
        version = int(out.stdout.split("parameters version ", 1)[1].split(":", 1)[0])
        self.requeues.append({"version": version, "at": at, "redo": redo, "set": change})
        return True

    def due(self) -> None:
        now = time.monotonic()
        for item in [x for x in self.later if x[0] <= now]:
            self.later.remove(item)
            _, what, proc = item
            proc.signal(signal.SIGCONT) if what == "cont" else proc.start()

    def settled(self) -> bool:
        try:
            pipe = self.r.pipeline(transaction=False)
            for key in (self.k.done, self.k.failed):
                pipe.bitcount(key)
            pipe.llen(self.k.rq_queue)
            pipe.zcard(self.k.leases)
            done, failed, queued, leased = pipe.execute()
        except redis.RedisError:
            return False
        self.done, self.left = done, self.tasks - done - failed
        return self.left <= 0 and not queued and not leased

    def run(self) -> dict:
        start = time.monotonic()
        next_fault, last_change, last_done, longest = start + self.a.fault_every, start, -1, 0.0
        self.done, self.left, shown, was_left = 0, self.tasks, start, True
        while True:
            now = time.monotonic()
            self.due()
            if sum(self.fired.values()) < self.a.faults and now >= next_fault:
                self.fire()
                next_fault = now + self.a.fault_every * self.rng.uniform(0.5, 1.5)
            if self.settled() and not self.later and sum(self.fired.values()) >= self.a.faults:
                break
            if self.done != last_done:  # a stall is time without progress while work remained
                longest = max(longest, now - last_change) if was_left else longest
                last_change, last_done, was_left = now, self.done, self.left > 0
            if now - shown >= 10:
                shown = now
                print(f"[{now - start:6.0f} s] done {self.done}/{self.tasks}, faults "
                      f"{sum(self.fired.values())}/{self.a.faults}", file=sys.stderr, flush=True)
            if now - start > self.a.timeout:
                raise TimeoutError(f"not settled after {self.a.timeout} s")
            time.sleep(0.2)
        return {"duration_s": round(time.monotonic() - start, 1),
                "longest_stall_s": round(longest, 1)}

    def stop_all(self) -> dict[str, tuple[int | None, float]]:
        """SIGTERM every process, as an operator would; each must exit 0 within the bound."""
        for c in self.consumers:
            c.wait_started(60)
        return {p.name: p.stop(STOP_BOUND_S) for p in [*self.consumers, *self.others,
                                                        *self.sims]}

    def finish(self) -> None:  # what an operator does once settled (_chaos_turns.py)
        pass

    def checks(self) -> tuple[dict, dict]:
        checks, figures = final_checks(self.r, self.redis.url, RUN, self.a.prompts, self.dir,
                                       self.requeues, self.out_dirs)
        checks["poison_prompts_failed"] = all(self.r.getbit(self.k.failed, i) for i in self.poison)
        return checks, figures

    def report(self, timing: dict, stops: dict) -> dict:
        checks, figures = self.checks()
        terms = [*self.term_exits, *stops.values()]
        checks["every_process_stopped_on_sigterm"] = all(t[0] == 0 for t in terms)
        return {
            "settings": {k: v for k, v in vars(self.a).items() if k != "json"},
            "checks": checks, **figures, **timing,
            "prompts_per_s": round(self.a.prompts / timing["duration_s"], 1),
            "faults": dict(self.fired), "faults_total": sum(self.fired.values()),
            "requeues": self.requeues,
            "restarts": {p.name: p.starts - 1 for p in [*self.consumers, *self.sims, self.redis]},
            "sigterm_exit_s_max": max((t[1] for t in terms), default=0.0),
            "sigterm_during_run": len(self.term_exits), "stops": stops}

    def close(self) -> None:
        for p in [*self.consumers, *self.others, *self.sims, self.redis]:
            p.signal(signal.SIGCONT)
            p.kill()


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    workdir = Path(tempfile.mkdtemp(prefix="genq-chaos-"))
    soak = None
    try:
        kind = Soak
        if a.turns == "all":
            from _chaos_turns import TurnsSoak as kind
        soak = kind(a, workdir)
        timing = soak.run()
        soak.finish()
        stops = soak.stop_all()
        result = soak.report(timing, stops)
        for proc in [*soak.consumers, *soak.others, *soak.sims]:  # why, before the logs go
            if stops[proc.name][0] != 0:
                tail = proc.log.read_bytes()[-2500:].decode(errors="replace")
                print(f"--- {proc.name} exited {stops[proc.name][0]}; its log ends:\n{tail}",
                      file=sys.stderr)
    finally:
        if soak is not None:
            soak.close()
        shutil.rmtree(workdir, ignore_errors=True)
    dump_json(a.json, result)
    for name, ok in result["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print({k: result.get(k) for k in ("duration_s", "prompts_per_s", "faults_total", "done",
                                      "failed", "duplicate_shard_lines", "longest_stall_s",
                                      "sigterm_exit_s_max", "generations", "asked_again")})
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
