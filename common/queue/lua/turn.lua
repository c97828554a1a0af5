#!lua flags=allow-oom
-- turn: a conversation's made turn is written; say where the conversation stands now, iff the
-- task's lease is still ours and no switch superseded the turn (the prelude's rule, as ack.lua
-- and `genq recover` apply it) (turns/state.py). Its last turn is acknowledged by ack.lua.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: jid, exec (id), task (index), standing and messages (ARGV indices: where it stands, JSON;
--    the made assistant messages before its last, zstd JSON, '' leaves them as they are),
--    unstable (turns whose prompt did not begin with the turn before's ids), checked (turns
--    checked), made (its made turns' count), ended (how it ended and at which turn:
--    state.ended; 0: not yet), tokens (a turn before the last: its completion tokens, for the
--    rate; 0: the last, which ack.lua counts), server, rate_prefix, bucket_s, bucket_ttl,
--    continued (a turn before the last continued by `requeue --continue`: its partial's
--    tokens; 0: not continued), version (params), created_at (its record's, Redis's clock)
-- A conversation begun again (A.made <= 1) no longer counts the continued turns it set aside
-- (an entry's third number: the partial's tokens). The made turns' sums (standing's fig,
-- turns/state.py) change the made:* counters by as much: status adds them to ack.lua's.
-- Returns 1 if written, 0 if the lease was no longer ours, 2 if a switch that aborts older
-- work superseded it (nothing recorded: the consumer gives the task back).
if not owns(redis.call('HGET', K.lease_owner, A.jid), A.exec) then return 0 end
if superseded(abort_switches(K.params_floor, K.params_history), A.version, A.created_at) then
  return 2
end
local task, raw = A.task, ARGV[A.standing]
local old, standing = redis.call('HGET', K.conv, task), cjson.decode(raw)
old = old and cjson.decode(old) or {}
if A.made <= 1 then  -- begun (again): made turns of before set aside are no
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
redis.call('HSET', K.conv, task, raw)
local messages = ARGV[A.messages]
if messages ~= '' then redis.call('HSET', K.conv_msgs, task, messages) end
redis.call('BITFIELD', K.conv_made, 'SET', 'u16', '#' .. task, A.made)
if A.ended ~= 0 then redis.call('BITFIELD', K.conv_end, 'SET', 'u16', '#' .. task, A.ended) end
if A.unstable ~= 0 then redis.call('HINCRBY', K.counters, 'boundary_unstable', A.unstable) end
if A.checked ~= 0 then redis.call('HINCRBY', K.counters, 'boundary_checked', A.checked) end
if A.tokens ~= 0 then  -- the rate's buckets, as ack.lua keeps them: tokens, generations
  local t = redis.call('TIME')
  local key = A.rate_prefix .. math.floor(tonumber(t[1]) / A.bucket_s)
  redis.call('HINCRBY', key, 'tok', A.tokens)
  redis.call('HINCRBY', key, 'tok|' .. A.server, A.tokens)
  redis.call('HINCRBY', key, 'gen|' .. A.server, 1)
  -- Its first generation made the bucket, or found it made by ack.lua (which sets its TTL
  -- then): its TTL is set once, not a command more every turn.
  if redis.call('HINCRBY', key, 'gen', 1) == 1 then redis.call('EXPIRE', key, A.bucket_ttl) end
end
if A.continued ~= 0 then  -- as ack.lua counts a continued answer, and drops its partial
  redis.call('HINCRBY', K.counters, 'continued|' .. A.version, 1)
  redis.call('HINCRBY', K.counters, 'saved|' .. A.version, A.continued)
  redis.call('HDEL', K.partials, task)
end
return 1
