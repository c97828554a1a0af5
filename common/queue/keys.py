"""Every Redis key genq touches, derived from the run name in one place.

RQ's own keys (``rq:queue:<q>``, ``rq:job:<id>``, the registries) are written in RQ 2.12's
layout so that ``rq info`` and rq-dashboard show the real work; genq's own state lives under
``genq:<run>:``. No other module builds key strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Seconds per rate bucket; the monitor's 1/5/15-minute rates are sums of these buckets.
RATE_BUCKET_S = 10
# How long a rate bucket lives: long enough for the 15-minute rate and a throughput chart.
RATE_BUCKET_TTL_S = 6 * 3600

# Finish reasons are stored per index as a small code so a redo can undo its counters.
FINISH_CODES = {"stop": 1, "length": 2, "abort": 3}
FINISH_OTHER = 4
FINISH_NAMES = {1: "stop", 2: "length", 3: "abort", 4: "other"}


# Each per-index bitmap and bitfield, by RunKeys property, with its width in bits. A new run
# creates them at their final size: Redis grows a string by doubling it, so a run that let
# them grow would keep up to twice the bytes it needs.
PER_INDEX_BITS = {"done": 1, "failed": 1, "pending": 1, "truncated": 1, "claims": 16,
                  "spent": 8, "acc_attempt": 16, "acc_version": 16, "acc_tokens": 32,
                  "acc_ptoks": 32, "acc_finish": 8}


def finish_code(reason: str | None) -> int:
    return FINISH_CODES.get(reason or "", FINISH_OTHER)


@dataclass(frozen=True)
class RunKeys:
    run: str

    def __post_init__(self) -> None:
        if not RUN_NAME.match(self.run):
            raise ValueError(
                f"run name {self.run!r} must be 1-64 letters, digits, '_' or '-'"
            )

    # --- RQ's layout (rq 2.12) -------------------------------------------------------
    @property
    def queue_name(self) -> str:
        return f"genq-{self.run}"

    @property
    def rq_queue(self) -> str:
        return f"rq:queue:{self.queue_name}"

    rq_queues = "rq:queues"

    @property
    def rq_wip(self) -> str:
        return f"rq:wip:{self.queue_name}"

    @property
    def rq_finished(self) -> str:
        return f"rq:finished:{self.queue_name}"

    @property
    def rq_failed(self) -> str:
        return f"rq:failed:{self.queue_name}"

    @property
    def rq_canceled(self) -> str:
        return f"rq:canceled:{self.queue_name}"

    rq_workers = "rq:workers"

    @property
    def rq_workers_of_queue(self) -> str:
        return f"rq:workers:{self.queue_name}"

    def rq_worker(self, name: str) -> str:
        return f"rq:worker:{name}"

    @property
    def rq_job_prefix(self) -> str:
        return "rq:job:"

    @property
    def rq_execution_prefix(self) -> str:
        return "rq:execution:"

    @property
    def rq_executions_prefix(self) -> str:
        return "rq:executions:"

    @property
    def rq_results_prefix(self) -> str:
        return "rq:results:"

    def job_id(self, index: int) -> str:
        return f"{self.run}-{index}"

    def rq_job(self, index: int) -> str:
        return f"rq:job:{self.job_id(index)}"

    # --- genq's own state --------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"genq:{self.run}:"

    @property
    def meta(self) -> str:
        """Hash: data set path, fingerprint, total, queue, created_at, epoch (the run's identity:
        a run registered again under the same name gets a new one)."""
        return self.prefix + "meta"

    @property
    def done(self) -> str:
        """Bitmap: the index's latest result is written and acknowledged (the truth)."""
        return self.prefix + "done"

    @property
    def failed(self) -> str:
        """Bitmap: the index ran out of attempts or is a bad task."""
        return self.prefix + "failed"

    @property
    def pending(self) -> str:
        """Bitmap: the index has a live RQ job (queued or leased)."""
        return self.prefix + "pending"

    @property
    def truncated(self) -> str:
        """Bitmap: the index's latest accepted result ended with finish_reason length."""
        return self.prefix + "truncated"

    @property
    def leases(self) -> str:
        """Sorted set: job id -> lease deadline (Redis TIME seconds)."""
        return self.prefix + "leases"

    @property
    def lease_owner(self) -> str:
        """Hash: job id -> "<execution id>|<server>|<params version>", the fencing token."""
        return self.prefix + "lease_owner"

    @property
    def claims(self) -> str:
        """BITFIELD u16 per index: claims so far, monotonic; the record's ``attempt``."""
        return self.prefix + "claims"

    @property
    def spent(self) -> str:
        """BITFIELD u8 per index: attempts spent towards --max-attempts."""
        return self.prefix + "spent"

    @property
    def acc_attempt(self) -> str:
        """BITFIELD u16 per index: the attempt whose result was accepted."""
        return self.prefix + "acc_attempt"

    @property
    def acc_version(self) -> str:
        """BITFIELD u16 per index: the parameter version of the accepted result."""
        return self.prefix + "acc_version"

    @property
    def acc_tokens(self) -> str:
        """BITFIELD u32 per index: completion_tokens of the accepted result."""
        return self.prefix + "acc_tokens"

    @property
    def acc_ptoks(self) -> str:
        """BITFIELD u32 per index: prompt_tokens of the accepted result."""
        return self.prefix + "acc_ptoks"

    @property
    def acc_finish(self) -> str:
        """BITFIELD u8 per index: finish code (FINISH_CODES) of the accepted result."""
        return self.prefix + "acc_finish"

    @property
    def counters(self) -> str:
        """Hash of exact totals over done results: finish:<name>, ctok_sum, ptok_sum."""
        return self.prefix + "counters"

    @property
    def length_hist(self) -> str:
        """Hash: completion_tokens value -> number of done results with it (exact)."""
        return self.prefix + "length_hist"

    @property
    def rate_prefix(self) -> str:
        """Hash per RATE_BUCKET_S bucket: req, tok, req|<server>, tok|<server>, fin|<name>,
        vreq|<params version>, vlen|<params version> (results, and those truncated)."""
        return self.prefix + "rate:"

    def rate_bucket(self, bucket: int) -> str:
        return f"{self.rate_prefix}{bucket}"

    @property
    def errors(self) -> str:
        """Hash: index -> last error text of a failed index."""
        return self.prefix + "errors"

    @property
    def params(self) -> str:
        """Hash: version -> JSON parameters."""
        return self.prefix + "params"

    @property
    def params_version(self) -> str:
        return self.prefix + "params_version"

    @property
    def params_floor(self) -> str:
        """Lowest parameter version whose results are still accepted (raised by an abort)."""
        return self.prefix + "params_floor"

    @property
    def params_history(self) -> str:
        """List of JSON entries {version, changes, redo, inflight, at}."""
        return self.prefix + "params_history"

    @property
    def events(self) -> str:
        """Pub/sub channel: parameter changes, so consumers react within a second."""
        return self.prefix + "events"

    @property
    def consumers(self) -> str:
        """Sorted set: consumer name -> last heartbeat (Redis TIME)."""
        return self.prefix + "consumers"

    def consumer(self, name: str) -> str:
        """JSON heartbeat of one consumer: server, capacity, inflight, load; expires."""
        return f"{self.prefix}consumer:{name}"

    @property
    def servers(self) -> str:
        """Hash: server URL -> JSON {context_length, capacity, at} as its consumer last read it."""
        return self.prefix + "servers"

    @property
    def sweep(self) -> str:
        """Hash: where the reaper's sweep for RQ-side changes resumes (pending, failed)."""
        return self.prefix + "sweep"

    @property
    def kept(self) -> str:
        """Bitmap: the index's acc_* fields hold a result a redo set aside; it stands again if
        the new attempt fails for good (then the index is done and stays in this bitmap)."""
        return self.prefix + "kept"

    @property
    def redo_marks(self) -> str:
        """Hash, at most 2 fields: redo scope ("truncated", "done") -> the version it was issued
        with; a result of an older version accepted later still falls under it."""
        return self.prefix + "redo_marks"

    @property
    def probe(self) -> str:
        """Hash: index -> JSON {digest, completion} of a `requeue --probe` answer, used once
        by a consumer whose request body is identical (same prompt, parameters, model);
        expires an hour after the probe (probe_store.KEEP_S)."""
        return self.prefix + "probe"

    @property
    def outdirs(self) -> str:
        """Set of output directories consumers wrote shards to (export reads them)."""
        return self.prefix + "outdirs"

    @property
    def shipped(self) -> str:
        """Hash: S3 key -> JSON {sha256, bytes, records, shard} of every shard shipped (one
        entry per closed shard of N records, so bounded by the run's size)."""
        return self.prefix + "shipped"

    @property
    def ship(self) -> str:
        """Hash of shipping totals: shards, bytes, records; pending|<consumer>,
        pending_bytes|<consumer> while a consumer has a backlog; last_error, last_error_at."""
        return self.prefix + "ship"


RUNS = "genq:runs"


def server_lease(url: str) -> str:
    """String: "<consumer>|<run>|<nonce>" of the one consumer driving this SGLang server, any
    run; expires unless renewed (consumer/servers.py)."""
    return f"genq:server:{url}"
