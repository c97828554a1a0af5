"""The run manifest ``{out_dir}/{run}.manifest.json``: what `genq recover` needs besides the
shards, rewritten atomically on every change."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import orjson
import redis

from genq.common.errors import UsageError
from genq.common.files import write_atomic
from genq.common.queue.keys import RunKeys

FORMAT = 1
REQUIRED = ("run", "dataset", "fingerprint", "total", "epoch", "params", "params_version",
            "history")


def path(out_dir: str | os.PathLike[str], run: str) -> Path:
    # Not `{run}.*.jsonl`: shard globs (export, repair, shipping) must never pick it up.
    return Path(out_dir) / f"{run}.manifest.json"


def snapshot(r: redis.Redis, k: RunKeys) -> dict[str, Any] | None:
    """The run's manifest as Redis has it now, read in one MULTI; None if the run is absent."""
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(k.meta)
    pipe.hgetall(k.params)
    pipe.get(k.params_version)
    pipe.get(k.params_floor)
    pipe.lrange(k.params_history, 0, -1)
    pipe.smembers(k.outdirs)
    meta_raw, params_raw, version, floor, history, out_dirs = pipe.execute()
    meta = {key.decode(): value.decode() for key, value in meta_raw.items()}
    if "total" not in meta or not meta.get("epoch"):
        return None
    return {
        "format": FORMAT, "run": k.run, "dataset": meta["dataset"],
        "fingerprint": meta["fingerprint"], "total": int(meta["total"]),
        "created_at": float(meta.get("created_at") or 0), "epoch": meta["epoch"],
        "params": {v.decode(): orjson.loads(p) for v, p in params_raw.items()},
        "params_version": int(version or 1), "params_floor": int(floor or 0),
        "history": [orjson.loads(h) for h in history], "gen": int(meta.get("gen") or 0),
        "out_dirs": sorted(d.decode() for d in out_dirs),
        "continues": int(meta.get("continues") or 0),  # the version `requeue --continue` made
        **({"rows": int(meta["rows"]), "samples": int(meta["samples"])}
           if "samples" in meta else {}),
        **({"dataset_version": meta["dataset_version"]} if "dataset_version" in meta else {}),
        **({"turns": meta["turns"]} if "turns" in meta else {}),  # recover rebuilds by it
    }


def write(out_dir: str | os.PathLike[str], manifest: dict[str, Any]) -> bool:
    """Store the manifest atomically and durably; False if the file already says the same."""
    target = path(out_dir, manifest["run"])
    with contextlib.suppress(FileNotFoundError, UsageError):  # absent or unreadable: write anew
        if {**read(target), "written_at": 0} == {**manifest, "written_at": 0}:
            return False  # equal but for when each was written
    data = orjson.dumps({**manifest, "written_at": round(time.time(), 3)},
                        option=orjson.OPT_INDENT_2)
    write_atomic(target, data, durable=True)
    return True


def parse(data: bytes, where: str) -> dict[str, Any]:
    """Check a manifest's bytes; one clear error naming the file and the defect."""
    try:
        manifest = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise UsageError(f"manifest {where} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise UsageError(f"manifest {where} is not a JSON object")
    missing = [key for key in REQUIRED if key not in manifest]
    if missing:
        raise UsageError(f"manifest {where} lacks {', '.join(missing)}")
    if manifest.get("format", FORMAT) > FORMAT:
        raise UsageError(f"manifest {where} has format {manifest['format']}; this genq reads "
                         f"format {FORMAT}: upgrade genq")
    return manifest


def read(target: str | os.PathLike[str]) -> dict[str, Any]:
    return parse(Path(target).read_bytes(), str(target))


def find(out_dir: str | os.PathLike[str], run: str) -> dict[str, Any] | None:
    try:
        return read(path(out_dir, run))
    except FileNotFoundError:
        return None


def newest(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest that saw the most of the run; all must be of one run (else two would mix)."""
    epochs = {m["epoch"] for m in manifests}
    if len(epochs) > 1:
        raise UsageError(f"the output directories hold manifests of {len(epochs)} different "
                         f"runs (epochs {', '.join(sorted(epochs))}); give the directories of "
                         "one run")
    return max(manifests, key=lambda m: (m["params_version"], len(m["history"])))


def upkeep(r: redis.Redis, k: RunKeys, out_dirs: list[str], epoch: str) -> int:
    """Rewrite the manifest in the run's output directories here; returns how many changed. Only
    while Redis holds this epoch's run: a re-created run's must not replace an earlier one's."""
    manifest = snapshot(r, k)
    if manifest is None or manifest["epoch"] != epoch:
        return 0
    return sum(write(directory, manifest) for directory in out_dirs if os.path.isdir(directory))
