"""Where one `genq consume --burst` spends its CPU: py-spy samples whichever thread of the
consumer holds the GIL, against the fast simulator, and this script sums the samples by package
and by function. Writes a text profile and, with --svg, a flame graph (a second, same run).

    python bench/profile_consumer.py                          # 5000 prompts, text to stdout
    python bench/profile_consumer.py --svg bench/profile_consumer.svg --out bench/profile.txt
    python bench/profile_consumer.py --n 20000 --compare-bare   # where genq spends more
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, RedisServer, Simulator, env, genq, table, write_dataset

SIM_FLAGS = ["--time-scale", "10000", "--ttft", "0", "--length-dist", "fixed:16",
             "--max-running-requests", "64"]
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):\d+\)$")
# Where a file's samples are charged: the first of these path parts found, else "other".
PACKAGES = ("httpx_aiohttp", "httpx", "httpcore", "aiohttp", "yarl", "multidict", "redis",
            "structlog", "orjson", "uvloop", "asyncio", "concurrent", "threading", "selectors",
            "consumer", "common", "logging", "json")


def package(path: str) -> str:
    parts = re.split(r"[/\\]", path)
    for name in PACKAGES:
        if name in parts or f"{name}.py" in parts:
            return name
    return "other: " + (parts[-1] if parts else "?")


def profile(rs: RedisServer, sim: Simulator, dataset: Path, run: str, fmt: str, out: Path,
            rate: int) -> None:
    genq("produce", str(dataset), "--once", redis_url=rs.url, run=run)
    shards = Path(tempfile.mkdtemp(prefix="genq-bench-out-"))
    try:
        # --gil: only the thread holding the GIL is sampled, so time blocked in fdatasync or in
        # the event loop's poll (which py-spy cannot tell from work under uvloop) is left out.
        cmd = ["py-spy", "record", "--gil", "--rate", str(rate), "--format", fmt, "-o", str(out),
               "--", sys.executable, "-m", "genq", "consume", "--server", sim.url, "--burst",
               "--out", str(shards)]
        proc = subprocess.run(cmd, cwd=REPO, env=env(rs.url, run), capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"py-spy run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    finally:
        shutil.rmtree(shards, ignore_errors=True)


def profile_bare(sim: Simulator, dataset: Path, n: int, out: Path, rate: int) -> None:
    """The bare client of consumer_throughput.py under the same sampler."""
    cmd = ["py-spy", "record", "--gil", "--rate", str(rate), "--format", "raw", "-o", str(out),
           "--", sys.executable, str(REPO / "bench" / "_bare_client.py"), "--server", sim.url,
           "--dataset", str(dataset), "--n", str(n)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy run exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def read_stacks(raw: Path) -> tuple[list[tuple[list[dict[str, str]], int]], int]:
    """py-spy's raw output as (frames, samples) per stack of the steady loop, and the samples
    left out as start-up (import-time stacks)."""
    stacks, startup = [], 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        if "_find_and_load" in stack:
            startup += int(count)
            continue
        stacks.append(([m.groupdict() for f in stack.split(";") if (m := FRAME.match(f))],
                       int(count)))
    return stacks, startup


def label(frame: dict[str, str]) -> str:
    return f"{frame['func']} ({Path(frame['file']).name})"


def inclusive_us(raw: Path, n: int, rate: int) -> tuple[dict[str, float], float]:
    """Microseconds per task under each function (samples / rate / n), steady loop only."""
    incl: collections.Counter[str] = collections.Counter()
    stacks, _ = read_stacks(raw)
    for frames, count in stacks:
        for name in {label(f) for f in frames}:
            incl[name] += count
    scale = 1e6 / rate / n
    return {k: v * scale for k, v in incl.items()}, sum(c for _, c in stacks) * scale


def compare(genq_raw: Path, bare_raw: Path, n: int, rate: int, top: int) -> str:
    """The functions under which genq spends the most more than the bare client, per task.
    Shared code (the HTTP request) appears too when it runs slower inside genq."""
    g, g_total = inclusive_us(genq_raw, n, rate)
    b, b_total = inclusive_us(bare_raw, n, rate)
    # Frames under which (nearly) everything runs (the event loop, genq's CLI) say nothing.
    names = [k for k in set(g) | set(b)
             if g.get(k, 0.0) < 0.9 * g_total and b.get(k, 0.0) < 0.9 * b_total]
    rows = sorted(names, key=lambda k: b.get(k, 0.0) - g.get(k, 0.0))[:top]
    return (f"Sampled CPU per task (GIL held): genq {g_total:.1f} us, bare client "
            f"{b_total:.1f} us\n\n" + table(
                [(name, f"{g.get(name, 0):.1f}", f"{b.get(name, 0):.1f}",
                  f"{g.get(name, 0) - b.get(name, 0):+.1f}") for name in rows],
                ("function (inclusive)", "genq us/task", "bare us/task", "difference")))


def summarise(raw: Path, top: int) -> str:
    """Self samples by package and function, inclusive samples by function; import-time
    stacks (start-up) are left out so the figures describe the steady loop."""
    own_pkg: collections.Counter[str] = collections.Counter()
    own_fn: collections.Counter[str] = collections.Counter()
    incl_fn: collections.Counter[str] = collections.Counter()
    stacks, startup = read_stacks(raw)
    total = sum(n for _, n in stacks)
    for frames, n in stacks:
        if not frames:
            continue
        leaf = frames[-1]
        own_pkg[package(leaf["file"])] += n
        own_fn[label(leaf)] += n
        for name in {label(f) for f in frames}:
            incl_fn[name] += n
    if not total:
        raise RuntimeError(f"no samples in {raw}")

    def pct(c: collections.Counter[str], k: int) -> list[tuple[str, str, int]]:
        return [(name, f"{100 * v / total:.1f}", v) for name, v in c.most_common(k)]

    return "\n\n".join([
        f"{total} samples of the steady loop ({startup} more at import time, left out)",
        "Self time by package (the leaf frame's file):\n"
        + table(pct(own_pkg, 40), ("package", "%", "samples")),
        f"Self time, top {top} functions:\n"
        + table(pct(own_fn, top), ("function", "%", "samples")),
        f"Inclusive time, top {top} functions:\n"
        + table(pct(incl_fn, top), ("function", "%", "samples")),
    ])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=5000, help="prompts (default 5000)")
    p.add_argument("--rate", type=int, default=250, help="samples per second (default 250)")
    p.add_argument("--top", type=int, default=30, help="functions listed (default 30)")
    p.add_argument("--out", help="write the text profile here as well as to stdout")
    p.add_argument("--svg", help="also record a flame graph SVG here (a second run)")
    p.add_argument("--compare-bare", action="store_true",
                   help="also profile the bare client and list where genq spends more")
    a = p.parse_args()
    if not shutil.which("py-spy"):
        p.error("py-spy is not installed (pip install py-spy)")
    work = Path(tempfile.mkdtemp(prefix="genq-bench-"))
    try:
        dataset = write_dataset(work / "prompts.jsonl", a.n)
        with RedisServer() as rs, Simulator(*SIM_FLAGS) as sim:
            profile(rs, sim, dataset, "prof1", "raw", work / "raw.txt", a.rate)
            text = (f"genq consume --burst, {a.n} prompts, simulator {' '.join(SIM_FLAGS)}, "
                    f"py-spy --rate {a.rate}\n\n" + summarise(work / "raw.txt", a.top))
            if a.svg:
                profile(rs, sim, dataset, "prof2", "flamegraph", Path(a.svg), a.rate)
            if a.compare_bare:
                profile_bare(sim, dataset, a.n, work / "bare.txt", a.rate)
                text += "\n\n" + compare(work / "raw.txt", work / "bare.txt", a.n, a.rate,
                                           a.top)
        print(text)
        if a.out:
            Path(a.out).write_text(text + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
