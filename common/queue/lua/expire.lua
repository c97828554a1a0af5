-- expire: end now every lease of the run held on one server, whose consumer is provably gone
-- (a consumer relaunched in place on the same host found its predecessor's process dead);
-- the next reap returns the tasks to the queue at once instead of after the visibility timeout.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: server
-- Returns how many leases it ended.
local owners = redis.call('HGETALL', K.lease_owner)
local ended = 0
for i = 1, #owners, 2 do
  local server = string.match(owners[i + 1], '^[^|]*|([^|]*)')
  if server == A.server and redis.call('ZADD', K.leases, 'XX', 'CH', 0, owners[i]) == 1 then
    ended = ended + 1
  end
end
return ended
