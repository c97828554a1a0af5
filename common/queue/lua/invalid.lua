-- invalid: keep a copy of the last answer of a prompt failed on its schema, bounded in total,
-- and count the prompt as failed on it, together: no copy for a prompt no longer failed (a
-- redo revived it since), none past the bound (counted as not kept: the shards hold it).
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: idx, answer (its ARGV index: the answer as JSON), version (params), keep (the most copies
-- the run keeps)
-- Returns 1 if kept, 0 if the prompt is no longer failed, 2 if past the bound.
local idx, version = A.idx, A.version
redis.call('HINCRBY', K.counters, 'schema_failed|' .. version, 1)
if redis.call('GETBIT', K.failed, idx) == 0 then return 0 end
if redis.call('HEXISTS', K.invalid, idx) == 0
    and redis.call('HLEN', K.invalid) >= A.keep then
  redis.call('HINCRBY', K.counters, 'schema_unkept|' .. version, 1)
  return 2
end
redis.call('HSET', K.invalid, idx, ARGV[A.answer])
return 1
