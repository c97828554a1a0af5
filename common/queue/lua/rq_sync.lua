-- rq_sync: what claim and reap do when RQ's own tools acted on a job out of genq's sight, so
-- that both leave the same bits, reasons and registries. `keys` names the calling script's
-- failed, pending, spent, errors and rq_failed (RQ's failed registry) keys.

-- RQ requeued a failed job (rq-dashboard's Requeue, `rq requeue`): the index runs again with
-- fresh attempts, as `genq requeue --redo failed` does.
local function revive_requeued(keys, idx, jid)
  redis.call('SETBIT', keys.failed, idx, 0)
  redis.call('SETBIT', keys.pending, idx, 1)
  redis.call('BITFIELD', keys.spent, 'SET', 'u8', '#' .. idx, 0)
  redis.call('HDEL', keys.errors, idx)
  redis.call('ZREM', keys.rq_failed, jid)
end

-- RQ's tools deleted or cancelled the job (`status` is RQ's, nil when the job hash is gone):
-- the index settles as failed with that reason, and never runs again unasked.
local function settle_removed(keys, idx, status)
  redis.call('SETBIT', keys.pending, idx, 0)
  redis.call('SETBIT', keys.failed, idx, 1)
  redis.call('HSET', keys.errors, idx, 'job ' .. (status or 'deleted') .. ' through RQ; '
    .. '`genq requeue --redo failed` runs it again')
end

