#!lua flags=allow-oom
-- turn: a conversation's made turn is written; say where the conversation stands now, iff the
-- task's lease is still ours (turns/state.py). Its last turn is acknowledged by ack.lua.
-- KEYS: 1 leases, 2 lease_owner, 3 wip, 4 conv, 5 conv_msgs, 6 counters
-- ARGV: 1 job id, 2 exec id, 3 task index, 4 where it stands (JSON), 5 the made assistant
--       messages before its last (zstd JSON; '' leaves them as they are), 6 turns whose
--       prompt did not begin with the turn before's ids (boundary unstable), 7 turns checked
-- Returns 1 if written, 0 if the lease was no longer ours.
if not owns(redis.call('HGET', KEYS[2], ARGV[1]), ARGV[2]) then return 0 end
redis.call('HSET', KEYS[4], ARGV[3], ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[5], ARGV[3], ARGV[5]) end
if ARGV[6] ~= '0' then redis.call('HINCRBY', KEYS[6], 'boundary_unstable', ARGV[6]) end
if ARGV[7] ~= '0' then redis.call('HINCRBY', KEYS[6], 'boundary_checked', ARGV[7]) end
return 1
