#!lua flags=allow-oom
-- rewind: `requeue --redo missing` of a --turns all run (turns/rewind.py): conversations go
-- back to the turns before their earliest one no given output holds, which is made again with
-- the turns after it. A conversation on a consumer loses its lease there and is queued again
-- (its consumer's next turn.lua or ack.lua is refused); one whose kept turns changed since
-- they were read is left as it is. redo.lua then undoes the done ones' results.
-- KEYS: 1 leases, 2 lease_owner, 3 wip, 4 conv, 5 conv_msgs, 6 conv_made, 7 conv_end,
--       8 counters, 9 queue, 10 spent
-- ARGV: 1 job key prefix, 2 execution key prefix, 3 executions key prefix, then 4 each:
--       task, job id, where it stands now (JSON: the kept turns' entries and sums), their messages
--       (zstd JSON; '' when none is kept)
-- Returns how many went back.
local count = 0
for i = 4, #ARGV, 4 do
  local task, jid, standing, msgs = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local now = cjson.decode(standing)
  local keep = now.made
  local raw = redis.call('HGET', KEYS[4], task)
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
        redis.call('HINCRBY', KEYS[8], 'continued|' .. e[1], -1)
        redis.call('HINCRBY', KEYS[8], 'saved|' .. e[1], 0 - e[3])
      end
    end
    count_made(KEYS[8], now.fig, before.fig)  -- the kept turns' sums, no longer the old ones'
    local owner = redis.call('HGET', KEYS[2], jid)
    if owner then  -- on a consumer now: given back, its attempt refunded
      drop_leases({jid}, {string.match(owner, '^[^|]*')}, ARGV[2], ARGV[3])
      redis.call('BITFIELD', KEYS[10], 'OVERFLOW', 'SAT', 'INCRBY', 'u8', '#' .. task, -1)
      redis.call('HSET', ARGV[1] .. jid, 'status', 'queued')
      redis.call('LPUSH', KEYS[9], jid)
    end
    if #keep == 0 then
      redis.call('HDEL', KEYS[4], task)
      redis.call('HDEL', KEYS[5], task)
    else
      redis.call('HSET', KEYS[4], task, standing)
      redis.call('HSET', KEYS[5], task, msgs)
    end
    redis.call('BITFIELD', KEYS[6], 'SET', 'u16', '#' .. task, #keep)
    redis.call('BITFIELD', KEYS[7], 'SET', 'u16', '#' .. task, 0)
  end
end
return count
