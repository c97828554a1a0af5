#!lua flags=allow-oom
-- ack: accept one written result iff the lease is still ours: done bit, exact counters,
-- rate buckets and RQ's finished state change together or not at all.
-- KEYS: 1 leases, 2 lease_owner, 3 wip, 4 done, 5 pending, 6 truncated, 7 counters,
--       8 length_hist, 9 acc_tokens, 10 acc_finish, 11 acc_version, 12 acc_attempt, 13 spent,
--       14 rq finished registry, 15 acc_ptoks, 16 params_floor, 17 queue, 18 redo_marks,
--       19 kept, 20 errors
-- ARGV: 1 job id, 2 index, 3 exec id, 4 completion_tokens, 5 prompt_tokens, 6 finish name,
--       7 finish code, 8 params version, 9 attempt, 10 server, 11 result ttl, 12 now iso,
--       13 job key prefix, 14 execution key prefix, 15 executions key prefix,
--       16 rate key prefix, 17 rate bucket seconds, 18 rate bucket ttl,
--       19 finished jobs kept for rq's tools
-- Returns 1 if accepted, 0 if the lease was lost (a stale ack is refused), 2 if the result's
-- parameters were superseded by a requeue that aborts old work (the task is queued again),
-- 3 if a redo issued after this result's version covers it (set aside as the index's
-- previous result, the task queued again).
local jid, idx, exec = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local owner = redis.call('HGET', KEYS[2], jid)
if not owner or string.sub(owner, 1, #exec + 1) ~= exec .. '|' then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('HDEL', KEYS[2], jid)
redis.call('ZREM', KEYS[1], jid)
redis.call('ZREM', KEYS[3], jid .. ':' .. exec)
redis.call('DEL', ARGV[14] .. jid .. ':' .. exec, ARGV[15] .. jid)
if tonumber(ARGV[8]) < tonumber(redis.call('GET', KEYS[16]) or '0') then
  -- Run again under the new parameters; the old attempt costs nothing.
  redis.call('BITFIELD', KEYS[13], 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. idx, -1)
  redis.call('HSET', ARGV[13] .. jid, 'status', 'queued')
  redis.call('LPUSH', KEYS[17], jid)
  return 2
end
local ctoks, ptoks, fname = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local function keep_fields()
  redis.call('BITFIELD', KEYS[9], 'SET', 'u32', '#' .. idx, ctoks)
  redis.call('BITFIELD', KEYS[15], 'SET', 'u32', '#' .. idx, ptoks)
  redis.call('BITFIELD', KEYS[10], 'SET', 'u8', '#' .. idx, ARGV[7])
  redis.call('BITFIELD', KEYS[11], 'SET', 'u16', '#' .. idx, ARGV[8])
  redis.call('BITFIELD', KEYS[12], 'SET', 'u16', '#' .. idx, ARGV[9])
end
-- A redo covers every result of an older version, also one still in flight when it was issued
-- (--inflight finish): such a result is kept as the previous one and the index runs again.
local marks = redis.call('HMGET', KEYS[18], 'done', 'truncated')
local ver = tonumber(ARGV[8])
if redis.call('GETBIT', KEYS[4], idx) == 0 and (ver < tonumber(marks[1] or '0')
    or (fname == 'length' and ver < tonumber(marks[2] or '0'))) then
  keep_fields()
  redis.call('SETBIT', KEYS[19], idx, 1)
  redis.call('BITFIELD', KEYS[13], 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. idx, -1)
  redis.call('HSET', ARGV[13] .. jid, 'status', 'queued')
  redis.call('LPUSH', KEYS[17], jid)
  return 3
end
if redis.call('SETBIT', KEYS[4], idx, 1) == 0 then
  redis.call('SETBIT', KEYS[5], idx, 0)
  keep_fields()
  redis.call('SETBIT', KEYS[19], idx, 0)  -- a new result replaces any kept previous one
  redis.call('BITFIELD', KEYS[13], 'SET', 'u8', '#' .. idx, 0)
  redis.call('SETBIT', KEYS[6], idx, fname == 'length' and 1 or 0)
  redis.call('HINCRBY', KEYS[7], 'finish:' .. fname, 1)
  redis.call('HINCRBY', KEYS[7], 'ctok_sum', ctoks)
  redis.call('HINCRBY', KEYS[7], 'ptok_sum', ptoks)
  redis.call('HINCRBY', KEYS[8], ctoks, 1)
  local bucket = ARGV[16] .. math.floor(now / tonumber(ARGV[17]))
  local server = ARGV[10]
  redis.call('HINCRBY', bucket, 'req', 1)
  redis.call('HINCRBY', bucket, 'tok', ctoks)
  redis.call('HINCRBY', bucket, 'req|' .. server, 1)
  redis.call('HINCRBY', bucket, 'tok|' .. server, ctoks)
  redis.call('HINCRBY', bucket, 'fin|' .. fname, 1)
  -- Per parameter version: the truncation alert judges only the current parameters, and the
  -- page says whether a raised max_tokens is enough.
  redis.call('HINCRBY', bucket, 'vreq|' .. ARGV[8], 1)
  if fname == 'length' then redis.call('HINCRBY', bucket, 'vlen|' .. ARGV[8], 1) end
  redis.call('EXPIRE', bucket, ARGV[18])
end
redis.call('HDEL', KEYS[20], idx)
local job = ARGV[13] .. jid
-- rq's tools see the last few finished jobs, never one hash per task: the oldest beyond the
-- bound leave the registry and Redis together. A job RQ deleted meanwhile is not recreated.
if redis.call('EXISTS', job) == 1 then
  redis.call('HSET', job, 'status', 'finished', 'ended_at', ARGV[12])
  redis.call('EXPIRE', job, ARGV[11])
  redis.call('ZADD', KEYS[14], now + tonumber(ARGV[11]), jid)
  local extra = redis.call('ZCARD', KEYS[14]) - tonumber(ARGV[19])
  if extra > 0 then
    local oldest = redis.call('ZPOPMIN', KEYS[14], extra)
    for i = 1, #oldest, 2 do
      -- A member left by a redo may name a job queued again since: that one stays.
      local old = ARGV[13] .. oldest[i]
      if redis.call('HGET', old, 'status') == 'finished' then redis.call('DEL', old) end
    end
  end
end
return 1
