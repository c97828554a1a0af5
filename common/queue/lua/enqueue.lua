-- enqueue: create RQ jobs for indices that are not done, failed or already pending, so
-- running the producer twice enqueues nothing twice.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: job_prefix, run (name), queue (key), origin, now_iso, result_ttl, failure_ttl, epoch (the
--    caller registered or loaded; '' = any), jobs: each {idx, data (its ARGV index), description}
-- Returns the number of jobs enqueued, or -1 if the run is not (or no longer) that epoch:
-- after Redis lost the run, every bit reads 0 and a caller with a cached size would queue
-- the whole data set again, to run under whatever parameters a re-created run has.
if A.epoch ~= '' and redis.call('HGET', K.meta, 'epoch') ~= A.epoch then return -1 end
local count = 0
for _, it in ipairs(A.jobs) do
  local idx = it.idx
  if redis.call('GETBIT', K.done, idx) == 0 and redis.call('GETBIT', K.failed, idx) == 0
      and redis.call('SETBIT', K.pending, idx, 1) == 0 then
    local jid = A.run .. '-' .. idx
    local job = A.job_prefix .. jid
    redis.call('DEL', job)
    redis.call('HSET', job, 'status', 'queued', 'origin', A.origin, 'created_at', A.now_iso,
      'enqueued_at', A.now_iso, 'data', ARGV[it.data], 'description', it.description,
      'timeout', -1, 'result_ttl', A.result_ttl, 'failure_ttl', A.failure_ttl,
      'started_at', '', 'ended_at', '', 'last_heartbeat', '', 'worker_name', '',
      'group_id', '', 'success_callback_name', '', 'failure_callback_name', '',
      'stopped_callback_name', '')
    -- A job cancelled through RQ and revived by a redo is no longer rq's cancelled job.
    redis.call('ZREM', K.rq_canceled, jid)
    redis.call('RPUSH', K.rq_queue, jid)
    count = count + 1
  end
end
redis.call('SADD', K.rq_queues, A.queue)
return count
