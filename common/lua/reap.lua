#!lua flags=allow-oom
-- reap: return every job whose lease deadline (Redis TIME) has passed to the front of the
-- queue. Any number of consumers and monitors may run it; each expired lease moves once.
-- KEYS: 1 leases, 2 lease_owner, 3 wip, 4 queue, 5 errors
-- ARGV: 1 limit, 2 job key prefix, 3 execution key prefix, 4 executions key prefix,
--       5 run name
-- Returns the job ids returned to the queue.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local skip = #ARGV[5] + 2
for _, jid in ipairs(expired) do
  local owner = redis.call('HGET', KEYS[2], jid) or ''
  local exec, server = string.match(owner, '^([^|]*)|([^|]*)')
  redis.call('HDEL', KEYS[2], jid)
  redis.call('ZREM', KEYS[1], jid)
  if exec then
    redis.call('ZREM', KEYS[3], jid .. ':' .. exec)
    redis.call('DEL', ARGV[3] .. jid .. ':' .. exec)
  end
  redis.call('DEL', ARGV[4] .. jid)
  redis.call('HSET', KEYS[5], string.sub(jid, skip),
    'lease expired on ' .. (server or '?') .. ' (consumer died, stalled or lost Redis)')
  redis.call('HSET', ARGV[2] .. jid, 'status', 'queued')
  redis.call('LPUSH', KEYS[4], jid)
end
return expired
