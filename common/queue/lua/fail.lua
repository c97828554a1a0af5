#!lua flags=allow-oom
-- fail: settle a leased job as failed (a bad task, or out of attempts): failed bit, the
-- reason's number (record_failure, rq_sync.lua), and RQ's failed registry with a result
-- rq-dashboard can show, both kept for the failure ttl as RQ keeps them.
-- K: its KEYS by name (scripts.KEYS["fail"], put before it at load time)
-- ARGV: 1 job id, 2 index, 3 exec id, 4 reason (per-prompt parts blanked), 5 rq exc_string (b64 zlib), 6 worker name,
--       7 failure ttl, 8 now iso, 9 job key prefix, 10 execution key prefix,
--       11 executions key prefix, 12 results key prefix, 13.. finish names by code
-- Returns 1 if failed, 0 if the lease was no longer ours, 2 if a redo had set a result aside
-- for this index: that result stands again (done, counted, marked kept) instead.
local jid, idx, exec = ARGV[1], tonumber(ARGV[2]), ARGV[3]
if not owns(redis.call('HGET', K.lease_owner, jid), exec) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
drop_leases({jid}, {exec}, ARGV[10], ARGV[11])
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
  redis.call('HINCRBY', K.counters, 'finish:' .. (ARGV[12 + code] or 'other'), 1)
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
  redis.call('HSET', ARGV[9] .. jid, 'status', 'finished', 'ended_at', ARGV[8])
  return 2
end
redis.call('SETBIT', K.failed, idx, 1)
record_failure(K, idx, ARGV[4])
local job = ARGV[9] .. jid
redis.call('HSET', job, 'status', 'failed', 'ended_at', ARGV[8])
redis.call('EXPIRE', job, ARGV[7])
redis.call('ZADD', K.rq_failed, now + tonumber(ARGV[7]), jid)
redis.call('XADD', ARGV[12] .. jid, 'MAXLEN', '~', 10, '*', 'type', 2, 'worker_name', ARGV[6],
  'exc_string', ARGV[5], 'execution_id', exec)
redis.call('EXPIRE', ARGV[12] .. jid, ARGV[7])
return 1
