-- server_release: drop a server's lease, if it is still ours.
-- K.lease: the server's lease (scripts.KEYS)   A: token (ours)
if redis.call('GET', K.lease) == A.token then return redis.call('DEL', K.lease) end
return 0
