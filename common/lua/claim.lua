-- claim: pop up to N queued jobs and lease each one atomically (queued -> started in RQ).
-- A popped job also tells what RQ's own tools did to it: requeued from rq's failed registry
-- (rq-dashboard's Requeue, `rq requeue`) revives the index; deleted or cancelled settles it as
-- failed with that reason; requeued from the finished registry is refused (shown finished).
-- KEYS: 1 queue, 2 wip, 3 leases, 4 lease_owner, 5 claims, 6 spent, 7 done, 8 failed,
--       9 params_version, 10 pending, 11 errors, 12 rq failed registry, 13 rq finished registry
-- ARGV: 1 n, 2 visibility timeout s, 3 wip margin s, 4 server, 5 worker name, 6 exec id base,
--       7 now iso (display only), 8 job key prefix, 9 execution key prefix,
--       10 executions key prefix, 11 run name, 12 finished ttl s
-- Returns {params_version, {job_id, index, exec_id, attempt, spent}...}
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local n, vt, margin = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local version = tonumber(redis.call('GET', KEYS[9]) or '1')
local deadline = now + vt
local out = {version}
local skip = #ARGV[11] + 2

-- Whether a popped job runs now, after making genq's bits follow what RQ did to it.
local function runnable(jid, idx)
  local status = redis.call('HGET', ARGV[8] .. jid, 'status')
  if redis.call('GETBIT', KEYS[7], idx) == 1 then
    if status == 'queued' then  -- rq requeued a finished job: `genq requeue --redo` does that
      redis.call('HSET', ARGV[8] .. jid, 'status', 'finished')
      redis.call('ZADD', KEYS[13], now + tonumber(ARGV[12]), jid)
    end
    return false  -- a duplicate push for a settled index is dropped, never run twice
  end
  if redis.call('GETBIT', KEYS[8], idx) == 1 then
    if status ~= 'queued' then return false end
    -- rq requeued a failed job: it runs again with fresh attempts, as `--redo failed` does.
    redis.call('SETBIT', KEYS[8], idx, 0)
    redis.call('SETBIT', KEYS[10], idx, 1)
    redis.call('BITFIELD', KEYS[6], 'SET', 'u8', '#' .. idx, 0)
    redis.call('HDEL', KEYS[11], idx)
    redis.call('ZREM', KEYS[12], jid)
    return true
  end
  if status == 'queued' or status == 'started' then return true end
  redis.call('SETBIT', KEYS[10], idx, 0)
  redis.call('SETBIT', KEYS[8], idx, 1)
  redis.call('HSET', KEYS[11], idx, 'job ' .. (status or 'deleted') .. ' through RQ; '
    .. '`genq requeue --redo failed` runs it again')
  return false
end

for i = 1, n do
  local jid = redis.call('LPOP', KEYS[1])
  if not jid then break end
  local idx = tonumber(string.sub(jid, skip))
  if runnable(jid, idx) then
    local attempt = redis.call('BITFIELD', KEYS[5], 'OVERFLOW', 'SAT', 'INCRBY', 'u16', '#' .. idx, 1)[1]
    local spent = redis.call('BITFIELD', KEYS[6], 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. idx, 1)[1]
    -- The claim number makes the fencing token unique per index even if a base repeats.
    local exec = ARGV[6] .. i .. '.' .. attempt
    redis.call('ZADD', KEYS[3], deadline, jid)
    redis.call('HSET', KEYS[4], jid, exec .. '|' .. ARGV[4] .. '|' .. version .. '|' .. attempt)
    redis.call('HSET', ARGV[8] .. jid, 'status', 'started', 'started_at', ARGV[7],
      'last_heartbeat', ARGV[7], 'worker_name', ARGV[5])
    redis.call('HSET', ARGV[9] .. jid .. ':' .. exec, 'id', exec, 'created_at', now,
      'last_heartbeat', now, 'worker_name', ARGV[5])
    redis.call('ZADD', ARGV[10] .. jid, deadline + margin, exec)
    -- rq's own sweeps must never reap a live lease: its wip score sits past ours by a margin.
    redis.call('ZADD', KEYS[2], deadline + margin, jid .. ':' .. exec)
    out[#out + 1] = {jid, idx, exec, attempt, spent}
  end
end
return out
