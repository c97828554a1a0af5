-- server_renew: keep a server's lease if it is still ours; take it back if it is gone (expired
-- while Redis was away, or lost with Redis's data: spares wait a lease for this); refuse if
-- another consumer holds it.
-- K.lease: the server's lease (scripts.KEYS)   A: token (ours), ms (lease)
local owner = redis.call('GET', K.lease)
if owner == A.token then return redis.call('PEXPIRE', K.lease, A.ms) end
if not owner then redis.call('SET', K.lease, A.token, 'PX', A.ms); return 1 end
return 0
