-- server_renew: keep a server's lease if it is still ours; take it back if it is gone (expired
-- while Redis was away, or lost with Redis's data: spares wait a lease for this); refuse if
-- another consumer holds it.
-- K.lease: the server's lease (scripts.KEYS)   ARGV: 1 our token, 2 lease ms
local owner = redis.call('GET', K.lease)
if owner == ARGV[1] then return redis.call('PEXPIRE', K.lease, ARGV[2]) end
if not owner then redis.call('SET', K.lease, ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
