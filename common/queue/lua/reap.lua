#!lua flags=allow-oom
-- reap: return every job whose lease deadline (Redis TIME) has passed to the front of the
-- queue. Any number of consumers and monitors may run it; each expired lease moves once.
-- It also sweeps a bounded slice of the run for what RQ's own tools did out of genq's sight
-- (a queued or running job deleted, cancelled or emptied away; a failed job requeued), so
-- genq's bits follow rq's state without waiting for a claim to pop the job.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: limit, job_prefix, exec_prefix (execution key), execs_prefix (executions key), run (name),
--    sweep_budget (indices checked per bitmap per sweep), sweep_every_s (between sweeps)
-- Returns the job ids returned to the queue.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local expired = redis.call('ZRANGEBYSCORE', K.leases, '-inf', now, 'LIMIT', 0, A.limit)
local skip = #A.run + 2

-- Drops the lease on jid whoever holds it; returns the holder's server.
local function drop_lease(jid)
  local owner = redis.call('HGET', K.lease_owner, jid) or ''
  local exec, server = string.match(owner, '^([^|]*)|([^|]*)')
  drop_leases({jid}, {exec}, A.exec_prefix, A.execs_prefix)
  return server
end

-- A job RQ's tools deleted or cancelled settles as failed with that reason; its lease, if
-- any, is dropped so no ack lands.
local function removed(idx, jid, status)
  drop_lease(jid)
  settle_removed(K, idx, status)
end

for _, jid in ipairs(expired) do
  local idx = string.sub(jid, skip)
  local status = redis.call('HGET', A.job_prefix .. jid, 'status')
  if status ~= 'started' and status ~= 'queued' then
    removed(tonumber(idx), jid, status)
  else
    local server = drop_lease(jid)
    redis.call('HSET', K.errors, idx,
      'lease expired on ' .. (server or '?') .. ' (consumer died, stalled or lost Redis)')
    redis.call('HSET', A.job_prefix .. jid, 'status', 'queued')
    redis.call('LPUSH', K.rq_queue, jid)
  end
end

-- A pending index whose rq job is gone or no longer queued/started was taken by RQ's tools.
local function check_pending(idx)
  local jid = A.run .. '-' .. idx
  local status = redis.call('HGET', A.job_prefix .. jid, 'status')
  if status ~= 'queued' and status ~= 'started' then removed(idx, jid, status) end
end

-- A failed index whose rq job is queued again was requeued through RQ: it runs again.
local function check_failed(idx)
  local jid = A.run .. '-' .. idx
  if redis.call('HGET', A.job_prefix .. jid, 'status') ~= 'queued' then return end
  revive_requeued(K, idx, jid)
end

-- Goes on round the bitmap from where the last sweep stopped, checking at most `budget` set
-- bits; past its end the next sweep starts over at 0. BITPOS skips runs of zeros, and each
-- set bit found brings the CHUNK bytes after it along, so a dense bitmap costs one HGET per
-- index checked and a sparse one two commands per index.
local CHUNK = 64
local function sweep(bits, field, check)
  local pos = tonumber(redis.call('HGET', K.sweep, field) or '0')
  local budget = A.sweep_budget
  while budget > 0 do
    local found = redis.call('BITPOS', bits, 1, pos, -1, 'BIT')
    if found < 0 then pos = 0 break end
    local first = math.floor(found / 8)
    local chunk = redis.call('GETRANGE', bits, first, first + CHUNK - 1)
    pos = (first + #chunk) * 8  -- past the chunk, unless the budget ends inside it
    for idx = found, pos - 1 do
      local byte = string.byte(chunk, math.floor(idx / 8) - first + 1)
      if bit.band(byte, bit.rshift(128, idx % 8)) ~= 0 then
        if budget == 0 then pos = idx break end
        check(idx)
        budget = budget - 1
      end
    end
  end
  redis.call('HSET', K.sweep, field, pos)
end

-- One sweep every A.sweep_every_s seconds for the whole run, however many consumers and
-- monitors reap.
local last = tonumber(redis.call('HGET', K.sweep, 'at') or '0')
if now - last < A.sweep_every_s then return expired end
redis.call('HSET', K.sweep, 'at', now)
sweep(K.pending, 'pending', check_pending)
sweep(K.failed, 'failed', check_failed)
return expired
