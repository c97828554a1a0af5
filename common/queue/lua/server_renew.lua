-- server_renew: keep a server's lease if it is still ours; take it back if it is gone (expired
-- while Redis was away, or lost with Redis's data: spares wait a lease for this); refuse if
-- another consumer holds it.
-- KEYS: 1 the server's lease   ARGV: 1 our token, 2 lease ms
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not owner then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
