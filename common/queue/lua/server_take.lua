-- server_take: take a server's lease over from a holder known to be dead, unless it changed
-- hands meanwhile.
-- K.lease: the server's lease (scripts.KEYS)
-- A: holder (the dead holder's token), token (ours), ms (lease)
if redis.call('GET', K.lease) ~= A.holder then return 0 end
redis.call('SET', K.lease, A.token, 'PX', A.ms)
return 1
