-- redo: make settled indices from `start` on runnable again, undoing their counters,
-- histogram and bits in the same step, so `genq status` stays exact while a redo runs.
-- Stops after `limit` indices so one call holds Redis for tens of milliseconds at most.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: what (truncated|done|failed|missing: K.redo_missing, the done indices `requeue --redo
--    missing` found no accepted line for in S3), start, stop (exclusive), below (redo results
--    whose version is below this), run (name), limit, finish_names (by code:
--    keys.FINISH_NAMES)
-- Returns {indices made runnable, position to continue from (stop when finished)}
local what, start, stop = A.what, A.start, A.stop
local below, limit = A.below, A.limit

local function undo_result(idx)
  local at = '#' .. idx
  local version = redis.call('BITFIELD', K.acc_version, 'GET', 'u16', at)[1]
  if version >= below then return 0 end
  if redis.call('GETBIT', K.done, idx) == 0 then return 0 end
  local cont = redis.call('BITFIELD', K.acc_cont, 'GET', 'u32', at)[1]
  if cont > 0 then  -- a continued answer set aside no longer counts as one
    redis.call('HINCRBY', K.counters, 'continued|' .. version, -1)
    redis.call('HINCRBY', K.counters, 'saved|' .. version, 0 - cont)
  end
  local ctoks = redis.call('BITFIELD', K.acc_tokens, 'GET', 'u32', at)[1]
  local ptoks = redis.call('BITFIELD', K.acc_ptoks, 'GET', 'u32', at)[1]
  local code = redis.call('BITFIELD', K.acc_finish, 'GET', 'u8', at)[1]
  redis.call('HINCRBY', K.counters, 'finish:' .. (A.finish_names[code] or 'other'), -1)
  -- 0 - n, not -n: Lua's -0 reaches Redis as "-0", which HINCRBY rejects mid-script.
  redis.call('HINCRBY', K.counters, 'ctok_sum', 0 - ctoks)
  redis.call('HINCRBY', K.counters, 'ptok_sum', 0 - ptoks)
  redis.call('HINCRBY', K.counters, 'cached_sum',
             0 - redis.call('BITFIELD', K.acc_cached, 'GET', 'u32', at)[1])
  if redis.call('HINCRBY', K.length_hist, ctoks, -1) <= 0 then
    redis.call('HDEL', K.length_hist, ctoks)
  end
  redis.call('SETBIT', K.done, idx, 0)
  redis.call('SETBIT', K.truncated, idx, 0)
  redis.call('SETBIT', K.pending, idx, 0)
  redis.call('BITFIELD', K.spent, 'SET', 'u8', at, 0)
  redis.call('BITFIELD', K.tries, 'SET', 'u8', at, 0)
  -- The acc_* fields stay: the result is set aside, not forgotten, until a new one is
  -- accepted; if the new attempt fails for good, fail.lua makes it stand again.
  if redis.call('SETBIT', K.kept, idx, 1) == 1 then
    redis.call('HINCRBY', K.counters, 'kept', -1)  -- it was a kept result standing; no longer
  end
  return 1
end

local function revive_failed(idx)
  redis.call('SETBIT', K.failed, idx, 0)
  redis.call('SETBIT', K.pending, idx, 0)
  redis.call('BITFIELD', K.spent, 'SET', 'u8', '#' .. idx, 0)
  redis.call('BITFIELD', K.tries, 'SET', 'u8', '#' .. idx, 0)
  redis.call('HDEL', K.errors, idx)
  redis.call('ZREM', K.rq_failed, A.run .. '-' .. idx)
  return 1
end

local source, fn = K.truncated, undo_result
if what == 'done' then source = K.done end
if what == 'missing' then source = K.redo_missing end
if what == 'failed' then source, fn = K.failed, revive_failed end
local count, pos = 0, start
while pos < stop and count < limit do
  pos = redis.call('BITPOS', source, 1, pos, stop - 1, 'BIT')
  if pos < 0 then pos = stop break end
  count = count + fn(pos)
  pos = pos + 1
end
return {count, pos}
