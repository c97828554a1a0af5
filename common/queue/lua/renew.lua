#!lua flags=allow-oom
-- renew: extend the leases this consumer still owns; report the ones it lost (fencing).
-- K: its KEYS by name (scripts.KEYS["renew"], put before it at load time)
-- ARGV: 1 visibility timeout s, 2 wip margin s, 3 executions key prefix, then job_id, exec_id pairs
-- Returns the job ids whose lease is no longer this consumer's.
local t = redis.call('TIME')
local deadline = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
local margin = tonumber(ARGV[2])
local lost = {}
for i = 4, #ARGV, 2 do
  local jid, exec = ARGV[i], ARGV[i + 1]
  if owns(redis.call('HGET', K.lease_owner, jid), exec) then
    redis.call('ZADD', K.leases, 'XX', deadline, jid)
    redis.call('ZADD', K.rq_wip, 'XX', deadline + margin, jid .. ':' .. exec)
    redis.call('ZADD', ARGV[3] .. jid, 'XX', deadline + margin, exec)
  else
    lost[#lost + 1] = jid
  end
end
return lost
