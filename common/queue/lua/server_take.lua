-- server_take: take a server's lease over from a holder known to be dead, unless it changed
-- hands meanwhile.
-- K.lease: the server's lease (scripts.KEYS)   ARGV: 1 the dead holder's token, 2 our token, 3 lease ms
if redis.call('GET', K.lease) ~= ARGV[1] then return 0 end
redis.call('SET', K.lease, ARGV[2], 'PX', ARGV[3])
return 1
