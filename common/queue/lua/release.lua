#!lua flags=allow-oom
-- release: give a leased job back to the front of the queue (infrastructure trouble, an
-- abort for new parameters, shutdown); optionally refund the attempt the claim spent, and
-- the claim itself where genq let go before the server had its say (tries).
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: jid, idx, exec (id), refund, reason, job_prefix, exec_prefix (execution key),
--    execs_prefix (executions key), unclaim
-- Returns 1 if released, 0 if the lease was no longer ours.
local jid, idx, exec = A.jid, A.idx, A.exec
if not owns(redis.call('HGET', K.lease_owner, jid), exec) then return 0 end
drop_leases({jid}, {exec}, A.exec_prefix, A.execs_prefix)
if A.refund then
  redis.call('BITFIELD', K.spent, 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. idx, -1)
end
if A.unclaim then
  redis.call('BITFIELD', K.tries, 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. idx, -1)
end
if A.reason ~= '' then redis.call('HSET', K.errors, idx, A.reason) end
redis.call('HSET', A.job_prefix .. jid, 'status', 'queued')
redis.call('LPUSH', K.rq_queue, jid)
return 1
