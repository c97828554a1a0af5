-- rq_sync: what claim and reap do when RQ's own tools acted on a job out of genq's sight, so
-- that both leave the same bits, reasons and registries; how a failure's reason is kept; the
-- run's life. `keys` is the calling script's K: its failed, pending, spent, tries, errors,
-- rq_failed (RQ's failed registry), fail_kind and fail_kinds keys.

-- RQ requeued a failed job (rq-dashboard's Requeue, `rq requeue`): the index runs again with
-- fresh attempts, as `genq requeue --redo failed` does.
local function revive_requeued(keys, idx, jid)
  redis.call('SETBIT', keys.failed, idx, 0)
  redis.call('SETBIT', keys.pending, idx, 1)
  redis.call('BITFIELD', keys.spent, 'SET', 'u8', '#' .. idx, 0)
  redis.call('BITFIELD', keys.tries, 'SET', 'u8', '#' .. idx, 0)
  redis.call('HDEL', keys.errors, idx)
  redis.call('ZREM', keys.rq_failed, jid)
end

-- The run's life as "epoch|generation": a recover starts a new generation of the same epoch.
local function life(meta)
  local m = redis.call('HMGET', meta, 'epoch', 'gen')
  return (m[1] or '') .. '|' .. (m[2] or '0')
end

-- Why `idx` failed, kept as the number of its reason (keys.fail_kinds: reason -> number): a byte
-- per index however long the reason; reasons past the 254th share the number 255.
local function record_failure(keys, idx, reason)
  redis.call('HDEL', keys.errors, idx)
  local id = tonumber(redis.call('HGET', keys.fail_kinds, reason))
  if not id then
    id = math.min(redis.call('HLEN', keys.fail_kinds) + 1, 255)
    if id < 255 then redis.call('HSET', keys.fail_kinds, reason, id) end
  end
  redis.call('BITFIELD', keys.fail_kind, 'SET', 'u8', '#' .. idx, id)
end

-- RQ's tools deleted or cancelled the job (`status` is RQ's, nil when the job hash is gone):
-- the index settles as failed with that reason, and never runs again unasked.
local function settle_removed(keys, idx, status)
  redis.call('SETBIT', keys.pending, idx, 0)
  redis.call('SETBIT', keys.failed, idx, 1)
  record_failure(keys, idx, 'job ' .. (status or 'deleted') .. ' through RQ; '
    .. '`genq requeue --redo failed` runs it again')
end

