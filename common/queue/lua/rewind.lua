#!lua flags=allow-oom
-- rewind: `requeue --redo missing` of a --turns all run (turns/rewind.py): conversations go
-- back to the turns before their earliest one no given output holds, which is made again with
-- the turns after it. A conversation on a consumer loses its lease there and is queued again
-- (its consumer's next turn.lua or ack.lua is refused); one whose kept turns changed since
-- they were read is left as it is. redo.lua then undoes the done ones' results.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: job_prefix, exec_prefix (execution key), execs_prefix (executions key), items: each {task,
--    jid, standing and msgs: the ARGV index of where it stands now (JSON: the kept turns'
--    entries and sums) and of their messages (zstd JSON; '' when none is kept)}
-- Returns how many went back.
local count = 0
for _, it in ipairs(A.items) do
  local task, jid, standing, msgs = it.task, it.jid, ARGV[it.standing], ARGV[it.msgs]
  local now = cjson.decode(standing)
  local keep = now.made
  local raw = redis.call('HGET', K.conv, task)
  local before = raw and cjson.decode(raw) or {}
  local old = before.made or {}
  local same = #old >= #keep
  for j, e in ipairs(keep) do
    local o = old[j]
    if not o or o[1] ~= e[1] or o[2] ~= e[2] then same = false end
  end
  if same then
    count = count + 1
    for j = #keep + 1, #old do  -- made turns set aside no longer count as continued ones
      local e = old[j]
      if e[3] then
        redis.call('HINCRBY', K.counters, 'continued|' .. e[1], -1)
        redis.call('HINCRBY', K.counters, 'saved|' .. e[1], 0 - e[3])
      end
    end
    count_made(K.counters, now.fig, before.fig)  -- the kept turns' sums, no longer the old ones'
    local owner = redis.call('HGET', K.lease_owner, jid)
    if owner then  -- on a consumer now: given back, its attempt refunded
      drop_leases({jid}, {string.match(owner, '^[^|]*')}, A.exec_prefix, A.execs_prefix)
      redis.call('BITFIELD', K.spent, 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. task, -1)
      redis.call('HSET', A.job_prefix .. jid, 'status', 'queued')
      redis.call('LPUSH', K.rq_queue, jid)
    end
    if #keep == 0 then
      redis.call('HDEL', K.conv, task)
      redis.call('HDEL', K.conv_msgs, task)
    else
      redis.call('HSET', K.conv, task, standing)
      redis.call('HSET', K.conv_msgs, task, msgs)
    end
    redis.call('BITFIELD', K.conv_made, 'SET', 'u16', '#' .. task, #keep)
    redis.call('BITFIELD', K.conv_end, 'SET', 'u16', '#' .. task, 0)
  end
end
return count
