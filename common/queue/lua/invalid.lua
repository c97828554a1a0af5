-- invalid: keep a copy of the last answer of a prompt failed on its schema, bounded in total,
-- and count the prompt as failed on it, together: no copy for a prompt no longer failed (a
-- redo revived it since), none past the bound (counted as not kept: the shards hold it).
-- KEYS: 1 invalid, 2 counters, 3 failed
-- ARGV: 1 index, 2 the answer as JSON, 3 params version, 4 the most copies the run keeps
-- Returns 1 if kept, 0 if the prompt is no longer failed, 2 if past the bound.
local idx, version = ARGV[1], ARGV[3]
redis.call('HINCRBY', KEYS[2], 'schema_failed|' .. version, 1)
if redis.call('GETBIT', KEYS[3], idx) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[1], idx) == 0
    and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  redis.call('HINCRBY', KEYS[2], 'schema_unkept|' .. version, 1)
  return 2
end
redis.call('HSET', KEYS[1], idx, ARGV[2])
return 1
