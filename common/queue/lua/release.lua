#!lua flags=allow-oom
-- release: give a leased job back to the front of the queue (infrastructure trouble, an
-- abort for new parameters, shutdown); optionally refund the attempt the claim spent, and
-- the claim itself where genq let go before the server had its say (tries).
-- K: its KEYS by name (scripts.KEYS["release"], put before it at load time)
-- ARGV: 1 job id, 2 index, 3 exec id, 4 refund (1/0), 5 reason, 6 job key prefix,
--       7 execution key prefix, 8 executions key prefix, 9 unclaim (1/0)
-- Returns 1 if released, 0 if the lease was no longer ours.
local jid, idx, exec = ARGV[1], ARGV[2], ARGV[3]
if not owns(redis.call('HGET', K.lease_owner, jid), exec) then return 0 end
drop_leases({jid}, {exec}, ARGV[7], ARGV[8])
if ARGV[4] == '1' then
  redis.call('BITFIELD', K.spent, 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. idx, -1)
end
if ARGV[9] == '1' then
  redis.call('BITFIELD', K.tries, 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. idx, -1)
end
if ARGV[5] ~= '' then redis.call('HSET', K.errors, idx, ARGV[5]) end
redis.call('HSET', ARGV[6] .. jid, 'status', 'queued')
redis.call('LPUSH', K.rq_queue, jid)
return 1
