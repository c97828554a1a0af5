-- server_release: drop a server's lease, if it is still ours.
-- K.lease: the server's lease (scripts.KEYS)   ARGV: 1 our token
if redis.call('GET', K.lease) == ARGV[1] then return redis.call('DEL', K.lease) end
return 0
