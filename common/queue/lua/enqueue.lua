-- enqueue: create RQ jobs for indices that are not done, failed or already pending, so
-- running the producer twice enqueues nothing twice.
-- K: its KEYS by name (scripts.KEYS["enqueue"], put before it at load time)
-- ARGV: 1 job key prefix, 2 run name, 3 queue key, 4 origin, 5 now iso, 6 result ttl,
--       7 failure ttl, 8 epoch the caller registered or loaded ('' = any), then
--       (index, data, description) triples
-- Returns the number of jobs enqueued, or -1 if the run is not (or no longer) that epoch:
-- after Redis lost the run, every bit reads 0 and a caller with a cached size would queue
-- the whole data set again, to run under whatever parameters a re-created run has.
if ARGV[8] ~= '' and redis.call('HGET', K.meta, 'epoch') ~= ARGV[8] then return -1 end
local count = 0
for i = 9, #ARGV, 3 do
  local idx = tonumber(ARGV[i])
  if redis.call('GETBIT', K.done, idx) == 0 and redis.call('GETBIT', K.failed, idx) == 0
      and redis.call('SETBIT', K.pending, idx, 1) == 0 then
    local jid = ARGV[2] .. '-' .. idx
    local job = ARGV[1] .. jid
    redis.call('DEL', job)
    redis.call('HSET', job, 'status', 'queued', 'origin', ARGV[4], 'created_at', ARGV[5],
      'enqueued_at', ARGV[5], 'data', ARGV[i + 1], 'description', ARGV[i + 2],
      'timeout', -1, 'result_ttl', ARGV[6], 'failure_ttl', ARGV[7],
      'started_at', '', 'ended_at', '', 'last_heartbeat', '', 'worker_name', '',
      'group_id', '', 'success_callback_name', '', 'failure_callback_name', '',
      'stopped_callback_name', '')
    -- A job cancelled through RQ and revived by a redo is no longer rq's cancelled job.
    redis.call('ZREM', K.rq_canceled, jid)
    redis.call('RPUSH', K.rq_queue, jid)
    count = count + 1
  end
end
redis.call('SADD', K.rq_queues, ARGV[3])
return count
