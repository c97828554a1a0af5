"""Every Redis key genq touches, derived from the run name: RQ's in RQ 2.12's layout (for `rq
info` and rq-dashboard), genq's under ``genq:<run>:``."""

from __future__ import annotations

import re
from dataclasses import dataclass

RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

RATE_BUCKET_S = 10  # seconds per rate bucket; the 1/5/15-minute rates are sums of buckets
RATE_BUCKET_TTL_S = 6 * 3600  # long enough for the 15-minute rate and the throughput chart

# Finish reasons are stored per index as a small code so a redo can undo its counters.
FINISH_NAMES = {1: "stop", 2: "length", 3: "abort", 4: "other", 5: "tool_calls"}
FINISH_CODES = {name: code for code, name in FINISH_NAMES.items()}


# Each per-index bitmap and bitfield's width in bits. A new run creates them at their final size:
# Redis grows a string by doubling it, which would keep up to twice the bytes needed.
PER_INDEX_BITS = {"done": 1, "failed": 1, "pending": 1, "truncated": 1, "claims": 16,
                  "spent": 8, "tries": 8, "acc_attempt": 16, "acc_version": 16, "acc_tokens": 32,
                  "acc_ptoks": 32, "acc_finish": 8, "fail_kind": 8, "acc_cont": 32,
                  "acc_cached": 32}


def finish_code(reason: str | None) -> int:
    return FINISH_CODES.get(reason or "", FINISH_CODES["other"])


class _Own:
    """A key of genq's own state: ``genq:<run>:<attribute name>``; the doc says what it holds."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, keys: RunKeys, owner: type | None = None) -> str:
        return keys.prefix + self.name


class _Rq:
    """One of RQ's per-queue keys: ``rq:<kind>:<queue name>``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __get__(self, keys: RunKeys, owner: type | None = None) -> str:
        return f"rq:{self.kind}:{keys.queue_name}"


@dataclass(frozen=True)
class RunKeys:
    run: str

    def __post_init__(self) -> None:
        if not RUN_NAME.match(self.run):
            raise ValueError(f"run name {self.run!r} must be 1-64 letters, digits, '_' or '-'")

    # --- RQ's layout (rq 2.12) -------------------------------------------------------
    @property
    def queue_name(self) -> str:
        return f"genq-{self.run}"

    rq_queue = _Rq("queue")
    rq_wip = _Rq("wip")
    rq_finished = _Rq("finished")
    rq_failed = _Rq("failed")
    rq_canceled = _Rq("canceled")
    rq_workers_of_queue = _Rq("workers")
    rq_queues = "rq:queues"
    rq_workers = "rq:workers"
    rq_job_prefix = "rq:job:"
    rq_execution_prefix = "rq:execution:"
    rq_executions_prefix = "rq:executions:"
    rq_results_prefix = "rq:results:"

    def rq_worker(self, name: str) -> str:
        return f"rq:worker:{name}"

    def job_id(self, index: int) -> str:
        return f"{self.run}-{index}"

    def rq_job(self, index: int) -> str:
        return f"rq:job:{self.job_id(index)}"

    # --- genq's own state --------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"genq:{self.run}:"

    meta = _Own("Hash: data set path, fingerprint, total, queue, created_at, epoch (the run's "
                "identity: a run registered again under the same name gets a new one); "
                "continues: the version the last `requeue --continue` made.")
    done = _Own("Bitmap: the index's latest result is written and acknowledged (the truth).")
    failed = _Own("Bitmap: the index ran out of attempts or is a bad task.")
    pending = _Own("Bitmap: the index has a live RQ job (queued or leased).")
    truncated = _Own("Bitmap: the index's latest accepted result ended with finish length.")
    kept = _Own("Bitmap: the acc_* fields hold a result a redo set aside; it stands again (and the "
                "index is done) if the new attempt fails for good.")
    leases = _Own("Sorted set: job id -> lease deadline (Redis TIME seconds).")
    lease_owner = _Own('Hash: job id -> "<exec id>|<server>|<params version>" (fencing token).')
    claims = _Own("BITFIELD u16 per index: claims so far, monotonic; the record's attempt.")
    spent = _Own("BITFIELD u8 per index: attempts spent towards --max-attempts.")
    tries = _Own("BITFIELD u8 per index: claims towards --max-claims, whatever their outcome "
                 "(a refund gives back the attempt, not the claim); reset with spent.")
    acc_attempt = _Own("BITFIELD u16 per index: the attempt whose result was accepted.")
    acc_version = _Own("BITFIELD u16 per index: the parameter version of the accepted result.")
    acc_tokens = _Own("BITFIELD u32 per index: completion_tokens of the accepted result.")
    acc_ptoks = _Own("BITFIELD u32 per index: prompt_tokens of the accepted result.")
    acc_cached = _Own("BITFIELD u32 per index: prompt tokens the server reported cached for the "
                      "accepted result (0: none or not reported).")
    acc_finish = _Own("BITFIELD u8 per index: FINISH_CODES code of the accepted result.")
    acc_cont = _Own("BITFIELD u32 per index: tokens of the partial answer the accepted result "
                    "continued (`requeue --continue`), so a redo undoes its counters too.")
    counters = _Own("Hash of totals over done results: finish:<name>, ctok_sum, ptok_sum, "
                    "cached_sum (prompt tokens the servers found cached), boundary_unstable and "
                "boundary_checked (`--turns all`: turns whose prompt ids did not begin with the "
                "turn before's, of those checked); per "
                    "params version continued|<v>, saved|<v> (answers continued, tokens kept), "
                    "invalid|<v>, schema_failed|<v>, schema_cut|<v>, schema_unkept|<v> (answers "
                    "not matching the schema, prompts failed on it, answers cut at max_tokens, "
                    "failed prompts whose answer `invalid` has no room for).")
    length_hist = _Own("Hash: completion_tokens value -> number of done results with it.")
    errors = _Own("Hash: index -> last error of a task not settled yet (gone once it settles).")
    fail_kind = _Own("BITFIELD u8 per index: the number of the reason a failed index failed for "
                     "(fail_kinds; 0: none recorded, 255: one of the reasons past the 254th).")
    fail_kinds = _Own("Hash: failure reason, URLs and numbers blanked (reason_kind) -> its number.")
    invalid = _Own("Hash: index -> JSON last answer of a prompt failed on the schema (its "
                   "content, finish reason, violation), shown by export --include-failed; at "
                   "most GENQ_INVALID_KEEP entries (invalid.lua), each cut; its prompt's next "
                   "failure or accepted ack deletes it.")
    conv = _Own("Hash, in a `--turns all` run: task index -> JSON where its conversation stands "
                "(turns/state.py): the [version, attempt] key of each accepted generation "
                "before its last, and once its last is made, how it ended and at which turn.")
    conv_msgs = _Own("Hash, in a `--turns all` run: task index -> zstd JSON of the made "
                     "assistant messages before its last (the next turn's prompt); dropped when "
                     "its last is accepted, unless cut at max_tokens (a redo goes on from it).")
    conv_made = _Own("BITFIELD u16 per index, in a `--turns all` run: its conversation's "
                     "accepted generations before its last (status sums them).")
    conv_end = _Own("BITFIELD u16 per index, in a `--turns all` run: how its conversation ended "
                    "(turns/state.py END_CODES, top 3 bits) and at which turn (13 bits); 0 "
                    "while it runs.")
    params = _Own("Hash: version -> JSON parameters.")
    params_version = _Own("String: the current parameter version.")
    params_floor = _Own("String: the oldest parameter version still accepted; an abort raises it.")
    params_history = _Own("List of JSON entries {version, changes, redo, inflight, at}.")
    redo_marks = _Own('Hash: redo scope ("truncated", "done") -> the version it was issued '
                      "with; an older result acked later still falls under it.")
    consumers = _Own("Sorted set: consumer name -> last heartbeat (Redis TIME).")
    servers = _Own("Hash: server URL -> JSON {context_length, capacity, at} from its consumer.")
    sweep = _Own("Hash: where the reaper's sweep for RQ-side changes resumes, per bitmap.")
    partials = _Own("Hash: index -> zstd JSON partial answer `requeue --continue` continues (at "
                    "most one per truncated index, for one parameter version; its accepted ack, "
                    "a later requeue or a permanent failure deletes it).")
    exports = _Own("Hash: absolute path of an export -> its file as inode:size:mtime_ns, so that "
                   "a later export replaces only a file this run wrote.")
    outdirs = _Own("Set of output directories consumers wrote shards to (export reads them).")
    redo_missing = _Own("Bitmap, while `requeue --redo missing` runs: the done indices whose "
                        "accepted result S3 does not hold, undone by redo.lua.")
    shipped = _Own("Hash: S3 key -> JSON {sha256, bytes, records, shard, key} per shard shipped.")
    ship = _Own("Hash of shipping totals: shards, bytes, records; pending|<consumer>, "
                "pending_bytes|<consumer>, error|<consumer>, error_at|<consumer> while a "
                "consumer has a backlog or trouble; unshipped|<consumer>: its done results "
                "not in S3 yet, as last reported.")

    @property
    def rate_prefix(self) -> str:
        """Hash per RATE_BUCKET_S bucket: req, tok, req|<server>, tok|<server>, fin|<name>,
        vreq|<params version>, vlen|<params version> (results, and those truncated)."""
        return self.prefix + "rate:"

    def rate_bucket(self, bucket: int) -> str:
        return f"{self.rate_prefix}{bucket}"

    def consumer(self, name: str) -> str:
        """JSON heartbeat of one consumer: server, capacity, inflight, load; expires."""
        return f"{self.prefix}consumer:{name}"


RUNS = "genq:runs"


def server_lease(server: str) -> str:
    """String: the lease token of the one consumer driving this SGLang server, any run; `server`
    is its identity (consumer/servers.identity: a loopback URL carries its node's name)."""
    return f"genq:server:{server}"
