-- invalid: keep a copy of the last answer of a prompt failed on its schema, bounded in total,
-- and count the prompt as failed on it, together: no copy for a prompt no longer failed (a
-- redo revived it since), none past the bound (counted as not kept: the shards hold it).
-- K: its KEYS by name (scripts.KEYS["invalid"], put before it at load time)
-- ARGV: 1 index, 2 the answer as JSON, 3 params version, 4 the most copies the run keeps
-- Returns 1 if kept, 0 if the prompt is no longer failed, 2 if past the bound.
local idx, version = ARGV[1], ARGV[3]
redis.call('HINCRBY', K.counters, 'schema_failed|' .. version, 1)
if redis.call('GETBIT', K.failed, idx) == 0 then return 0 end
if redis.call('HEXISTS', K.invalid, idx) == 0
    and redis.call('HLEN', K.invalid) >= tonumber(ARGV[4]) then
  redis.call('HINCRBY', K.counters, 'schema_unkept|' .. version, 1)
  return 2
end
redis.call('HSET', K.invalid, idx, ARGV[2])
return 1
