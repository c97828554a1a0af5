-- expire: end now every lease of the run held on one server, whose consumer is provably gone
-- (a consumer relaunched in place on the same host found its predecessor's process dead);
-- the next reap returns the tasks to the queue at once instead of after the visibility timeout.
-- KEYS: 1 leases, 2 lease_owner
-- ARGV: 1 server
-- Returns how many leases it ended.
local owners = redis.call('HGETALL', KEYS[2])
local ended = 0
for i = 1, #owners, 2 do
  local server = string.match(owners[i + 1], '^[^|]*|([^|]*)')
  if server == ARGV[1] and redis.call('ZADD', KEYS[1], 'XX', 'CH', 0, owners[i]) == 1 then
    ended = ended + 1
  end
end
return ended
