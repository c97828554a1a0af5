#!lua flags=allow-oom
-- turn: a conversation's made turn is written; say where the conversation stands now, iff the
-- task's lease is still ours and no switch superseded the turn (the prelude's rule, as ack.lua
-- and `genq recover` apply it) (turns/state.py). Its last turn is acknowledged by ack.lua.
-- K: its KEYS by name (scripts.KEYS["turn"], put before it at load time)
-- ARGV: 1 job id, 2 exec id, 3 task index, 4 where it stands (JSON), 5 the made assistant
--       messages before its last (zstd JSON; '' leaves them as they are), 6 turns whose
--       prompt did not begin with the turn before's ids (boundary unstable), 7 turns checked,
--       8 its made turns' count, 9 how it ended and at which turn (state.ended; 0: not yet),
--       10 a turn before the last: its completion tokens, for the rate (0: the last, which
--       ack.lua counts), 11 server, 12 rate key prefix, 13 rate bucket seconds, 14 its ttl,
--       15 a turn before the last continued by `requeue --continue`: its partial's tokens (0:
--       not continued), 16 its params version, 17 its record's created_at (Redis's clock)
-- A conversation begun again (ARGV 8 <= 1) no longer counts the continued turns it set aside
-- (an entry's third number: the partial's tokens). The made turns' sums (ARGV 4's fig,
-- turns/state.py) change the made:* counters by as much: status adds them to ack.lua's.
-- Returns 1 if written, 0 if the lease was no longer ours, 2 if a switch that aborts older
-- work superseded it (nothing recorded: the consumer gives the task back).
if not owns(redis.call('HGET', K.lease_owner, ARGV[1]), ARGV[2]) then return 0 end
if superseded(abort_switches(K.params_floor, K.params_history), tonumber(ARGV[16]), tonumber(ARGV[17])) then
  return 2
end
local old, standing = redis.call('HGET', K.conv, ARGV[3]), cjson.decode(ARGV[4])
old = old and cjson.decode(old) or {}
if tonumber(ARGV[8]) <= 1 then  -- begun (again): made turns of before set aside are no
  if old.made then  -- longer continued ones (as redo.lua's)
    local now = standing.made
    for i, e in ipairs(old.made) do
      local n = now[i]
      if e[3] and (not n or n[1] ~= e[1] or n[2] ~= e[2]) then
        redis.call('HINCRBY', K.counters, 'continued|' .. e[1], -1)
        redis.call('HINCRBY', K.counters, 'saved|' .. e[1], 0 - e[3])
      end
    end
  end
end
count_made(K.counters, standing.fig, old.fig)
redis.call('HSET', K.conv, ARGV[3], ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', K.conv_msgs, ARGV[3], ARGV[5]) end
redis.call('BITFIELD', K.conv_made, 'SET', 'u16', '#' .. ARGV[3], ARGV[8])
if ARGV[9] ~= '0' then redis.call('BITFIELD', K.conv_end, 'SET', 'u16', '#' .. ARGV[3], ARGV[9]) end
if ARGV[6] ~= '0' then redis.call('HINCRBY', K.counters, 'boundary_unstable', ARGV[6]) end
if ARGV[7] ~= '0' then redis.call('HINCRBY', K.counters, 'boundary_checked', ARGV[7]) end
if ARGV[10] ~= '0' then  -- the rate's buckets, as ack.lua keeps them: tokens, generations
  local t = redis.call('TIME')
  local key = ARGV[12] .. math.floor(tonumber(t[1]) / tonumber(ARGV[13]))
  redis.call('HINCRBY', key, 'tok', ARGV[10])
  redis.call('HINCRBY', key, 'tok|' .. ARGV[11], ARGV[10])
  redis.call('HINCRBY', key, 'gen', 1)
  redis.call('HINCRBY', key, 'gen|' .. ARGV[11], 1)
  redis.call('EXPIRE', key, ARGV[14])
end
if ARGV[15] ~= '0' then  -- as ack.lua counts a continued answer, and drops its partial
  redis.call('HINCRBY', K.counters, 'continued|' .. ARGV[16], 1)
  redis.call('HINCRBY', K.counters, 'saved|' .. ARGV[16], ARGV[15])
  redis.call('HDEL', K.partials, ARGV[3])
end
return 1
