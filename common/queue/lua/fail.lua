#!lua flags=allow-oom
-- fail: settle a leased job as failed (a bad task, or out of attempts): failed bit, the
-- reason's number (record_failure, rq_sync.lua), and RQ's failed registry with a result
-- rq-dashboard can show, both kept for the failure ttl as RQ keeps them.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: jid, idx, exec (id), reason (per-prompt parts blanked), exc_string (rq's: b64 zlib),
--    worker (name), failure_ttl, now_iso, job_prefix, exec_prefix (execution key), execs_prefix
--    (executions key), results_prefix, finish_names (by code)
-- Returns 1 if failed, 0 if the lease was no longer ours, 2 if a redo had set a result aside
-- for this index: that result stands again (done, counted, marked kept) instead.
local jid, idx, exec = A.jid, A.idx, A.exec
if not owns(redis.call('HGET', K.lease_owner, jid), exec) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
drop_leases({jid}, {exec}, A.exec_prefix, A.execs_prefix)
redis.call('SETBIT', K.pending, idx, 0)
redis.call('HDEL', K.errors, idx)
-- An answer kept from an earlier failure on the schema is not this failure's: the consumer
-- keeps this one's (invalid.lua) if it was the schema again.
redis.call('HDEL', K.invalid, idx)
if redis.call('GETBIT', K.kept, idx) == 1 then
  -- A redo never loses a result: the one it set aside is what this index keeps.
  local at = '#' .. idx
  local ctoks = redis.call('BITFIELD', K.acc_tokens, 'GET', 'u32', at)[1]
  local ptoks = redis.call('BITFIELD', K.acc_ptoks, 'GET', 'u32', at)[1]
  local code = redis.call('BITFIELD', K.acc_finish, 'GET', 'u8', at)[1]
  redis.call('SETBIT', K.done, idx, 1)
  redis.call('SETBIT', K.truncated, idx, code == 2 and 1 or 0)
  redis.call('HINCRBY', K.counters, 'finish:' .. (A.finish_names[code] or 'other'), 1)
  redis.call('HINCRBY', K.counters, 'ctok_sum', ctoks)
  redis.call('HINCRBY', K.counters, 'ptok_sum', ptoks)
  redis.call('HINCRBY', K.counters, 'cached_sum',
             redis.call('BITFIELD', K.acc_cached, 'GET', 'u32', at)[1])
  redis.call('HINCRBY', K.counters, 'kept', 1)
  redis.call('HINCRBY', K.length_hist, ctoks, 1)
  local cont = redis.call('BITFIELD', K.acc_cont, 'GET', 'u32', at)[1]
  if cont > 0 then  -- a continued answer counts as one again (redo.lua uncounted it)
    local version = redis.call('BITFIELD', K.acc_version, 'GET', 'u16', at)[1]
    redis.call('HINCRBY', K.counters, 'continued|' .. version, 1)
    redis.call('HINCRBY', K.counters, 'saved|' .. version, cont)
  end
  redis.call('HSET', A.job_prefix .. jid, 'status', 'finished', 'ended_at', A.now_iso)
  return 2
end
redis.call('SETBIT', K.failed, idx, 1)
record_failure(K, idx, A.reason)
local job = A.job_prefix .. jid
redis.call('HSET', job, 'status', 'failed', 'ended_at', A.now_iso)
redis.call('EXPIRE', job, A.failure_ttl)
redis.call('ZADD', K.rq_failed, now + A.failure_ttl, jid)
redis.call('XADD', A.results_prefix .. jid, 'MAXLEN', '~', 10, '*', 'type', 2,
  'worker_name', A.worker, 'exc_string', A.exc_string, 'execution_id', exec)
redis.call('EXPIRE', A.results_prefix .. jid, A.failure_ttl)
return 1
