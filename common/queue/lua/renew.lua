#!lua flags=allow-oom
-- renew: extend the leases this consumer still owns; report the ones it lost (fencing).
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: vt (visibility timeout s), margin (wip margin s), execs_prefix (executions key), held
--    ({jid, exec} each)
-- Returns the job ids whose lease is no longer this consumer's.
local t = redis.call('TIME')
local deadline = tonumber(t[1]) + tonumber(t[2]) / 1e6 + A.vt
local margin = A.margin
local lost = {}
for _, held in ipairs(A.held) do
  local jid, exec = held.jid, held.exec
  if owns(redis.call('HGET', K.lease_owner, jid), exec) then
    redis.call('ZADD', K.leases, 'XX', deadline, jid)
    redis.call('ZADD', K.rq_wip, 'XX', deadline + margin, jid .. ':' .. exec)
    redis.call('ZADD', A.execs_prefix .. jid, 'XX', deadline + margin, exec)
  else
    lost[#lost + 1] = jid
  end
end
return lost
