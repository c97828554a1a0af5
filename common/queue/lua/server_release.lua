-- server_release: drop a server's lease, if it is still ours.
-- KEYS: 1 the server's lease   ARGV: 1 our token
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
