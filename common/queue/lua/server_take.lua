-- server_take: take a server's lease over from a holder known to be dead, unless it changed
-- hands meanwhile.
-- KEYS: 1 the server's lease   ARGV: 1 the dead holder's token, 2 our token, 3 lease ms
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
