-- redo: make settled indices from `start` on runnable again, undoing their counters,
-- histogram and bits in the same step, so `genq status` stays exact while a redo runs.
-- Stops after `limit` indices so one call holds Redis for tens of milliseconds at most.
-- KEYS: 1 done, 2 truncated, 3 failed, 4 counters, 5 length_hist, 6 acc_tokens, 7 acc_ptoks,
--       8 acc_finish, 9 acc_version, 10 spent, 11 errors, 12 rq failed registry, 13 pending,
--       14 kept, 15 tries, 16 acc_cont, 17 acc_cached, 18 redo_missing (what = missing: the
--       done indices `requeue --redo missing` found no accepted line for in S3)
-- ARGV: 1 what (truncated|done|failed|missing), 2 start, 3 stop (exclusive), 4 redo results whose
--       version is below this, 5 run name, 6 limit, 7.. finish names by code (keys.FINISH_NAMES)
-- Returns {indices made runnable, position to continue from (stop when finished)}
local what, start, stop = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local below, limit = tonumber(ARGV[4]), tonumber(ARGV[6])

local function undo_result(idx)
  local at = '#' .. idx
  local version = redis.call('BITFIELD', KEYS[9], 'GET', 'u16', at)[1]
  if version >= below then return 0 end
  if redis.call('GETBIT', KEYS[1], idx) == 0 then return 0 end
  local cont = redis.call('BITFIELD', KEYS[16], 'GET', 'u32', at)[1]
  if cont > 0 then  -- a continued answer set aside no longer counts as one
    redis.call('HINCRBY', KEYS[4], 'continued|' .. version, -1)
    redis.call('HINCRBY', KEYS[4], 'saved|' .. version, 0 - cont)
  end
  local ctoks = redis.call('BITFIELD', KEYS[6], 'GET', 'u32', at)[1]
  local ptoks = redis.call('BITFIELD', KEYS[7], 'GET', 'u32', at)[1]
  local code = redis.call('BITFIELD', KEYS[8], 'GET', 'u8', at)[1]
  redis.call('HINCRBY', KEYS[4], 'finish:' .. (ARGV[6 + code] or 'other'), -1)
  -- 0 - n, not -n: Lua's -0 reaches Redis as "-0", which HINCRBY rejects mid-script.
  redis.call('HINCRBY', KEYS[4], 'ctok_sum', 0 - ctoks)
  redis.call('HINCRBY', KEYS[4], 'ptok_sum', 0 - ptoks)
  redis.call('HINCRBY', KEYS[4], 'cached_sum',
             0 - redis.call('BITFIELD', KEYS[17], 'GET', 'u32', at)[1])
  if redis.call('HINCRBY', KEYS[5], ctoks, -1) <= 0 then redis.call('HDEL', KEYS[5], ctoks) end
  redis.call('SETBIT', KEYS[1], idx, 0)
  redis.call('SETBIT', KEYS[2], idx, 0)
  redis.call('SETBIT', KEYS[13], idx, 0)
  redis.call('BITFIELD', KEYS[10], 'SET', 'u8', at, 0)
  redis.call('BITFIELD', KEYS[15], 'SET', 'u8', at, 0)
  -- The acc_* fields stay: the result is set aside, not forgotten, until a new one is
  -- accepted; if the new attempt fails for good, fail.lua makes it stand again.
  if redis.call('SETBIT', KEYS[14], idx, 1) == 1 then
    redis.call('HINCRBY', KEYS[4], 'kept', -1)  -- it was a kept result standing; no longer
  end
  return 1
end

local function revive_failed(idx)
  redis.call('SETBIT', KEYS[3], idx, 0)
  redis.call('SETBIT', KEYS[13], idx, 0)
  redis.call('BITFIELD', KEYS[10], 'SET', 'u8', '#' .. idx, 0)
  redis.call('BITFIELD', KEYS[15], 'SET', 'u8', '#' .. idx, 0)
  redis.call('HDEL', KEYS[11], idx)
  redis.call('ZREM', KEYS[12], ARGV[5] .. '-' .. idx)
  return 1
end

local source, fn = KEYS[2], undo_result
if what == 'done' then source = KEYS[1] end
if what == 'missing' then source = KEYS[18] end
if what == 'failed' then source, fn = KEYS[3], revive_failed end
local count, pos = 0, start
while pos < stop and count < limit do
  pos = redis.call('BITPOS', source, 1, pos, stop - 1, 'BIT')
  if pos < 0 then pos = stop break end
  count = count + fn(pos)
  pos = pos + 1
end
return {count, pos}
