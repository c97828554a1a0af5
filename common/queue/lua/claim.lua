-- claim: pop up to N queued jobs and lease each one atomically (queued -> started in RQ).
-- A popped job also tells what RQ's own tools did to it: requeued from rq's failed registry
-- (rq-dashboard's Requeue, `rq requeue`) revives the index; deleted or cancelled settles it as
-- failed with that reason; requeued from the finished registry is refused (shown finished).
-- The N jobs share their commands: one pop, one read of the done and failed bits, one
-- increment of the counters, one write of each lease structure; only RQ's per-job hashes cost
-- a command per job.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: n, vt (visibility timeout s), margin (wip margin s), server, worker (name), exec_base (exec
--    id base), now_iso (display only), job_prefix, exec_prefix (execution key), execs_prefix
--    (executions key), run (name), finished_ttl (s), life (the run's life the caller knows,
--    "epoch|generation"; '': not checked), conv (a --turns all consumer's claim: say whether
--    each conversation has made turns kept)
-- Returns {params_version, {job_id, index, exec_id, attempt, spent, tries, kept}...} (kept: 0
-- when a conv claim's conversation has no made turns kept, so it begins without reading
-- them; else 1), or {0} when
-- the run is not the life the caller knows (another run, or recovered since): it looks again
-- first.
if A.life ~= '' and life(K.meta) ~= A.life then return {0} end
local n, vt, margin = A.n, A.vt, A.margin
local version = tonumber(redis.call('GET', K.params_version) or '1')
local out = {version}
local jids = redis.call('LPOP', K.rq_queue, n)
if not jids then return out end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local deadline = now + vt
local skip = #A.run + 2

-- Whether a popped job runs now, after making genq's bits follow what RQ did to it.
local function runnable(jid, idx, done, failed)
  local status = redis.call('HGET', A.job_prefix .. jid, 'status')
  if done == 1 then
    if status == 'queued' then  -- rq requeued a finished job: `genq requeue --redo` does that
      redis.call('HSET', A.job_prefix .. jid, 'status', 'finished')
      redis.call('ZADD', K.rq_finished, now + A.finished_ttl, jid)
    end
    return false  -- a duplicate push for a settled index is dropped, never run twice
  end
  if failed == 1 then
    if status ~= 'queued' then return false end
    revive_requeued(K, idx, jid)  -- rq requeued a failed job: it runs again
    return true
  end
  if status == 'queued' or status == 'started' then return true end
  settle_removed(K, idx, status)  -- deleted or cancelled through RQ
  return false
end

local bits = {}
for i, jid in ipairs(jids) do
  local idx = tonumber(string.sub(jid, skip))
  bits[#bits + 1] = 'GET'; bits[#bits + 1] = 'u1'; bits[#bits + 1] = idx
end
local done = redis.call('BITFIELD', K.done, unpack(bits))
local failed = redis.call('BITFIELD', K.failed, unpack(bits))
local run, claims, spent = {}, {'OVERFLOW', 'SAT'}, {'OVERFLOW', 'SAT'}
for i, jid in ipairs(jids) do
  local idx = bits[3 * i]
  if runnable(jid, idx, done[i], failed[i]) then
    run[#run + 1] = {jid, idx, i}
    local at = '#' .. idx
    claims[#claims + 1] = 'INCRBY'; claims[#claims + 1] = 'u16'
    claims[#claims + 1] = at; claims[#claims + 1] = 1
    spent[#spent + 1] = 'INCRBY'; spent[#spent + 1] = 'u8'
    spent[#spent + 1] = at; spent[#spent + 1] = 1
  end
end
if #run == 0 then return out end
local attempts = redis.call('BITFIELD', K.claims, unpack(claims))
local spents = redis.call('BITFIELD', K.spent, unpack(spent))
-- The same increments on tries: a refund gives the attempt back, never the claim, so a task
-- the server fails every time still meets --max-claims.
local tries = redis.call('BITFIELD', K.tries, unpack(spent))
local leases, owners, wip = {}, {}, {}
for j, job in ipairs(run) do
  local jid, idx, attempt = job[1], job[2], attempts[j]
  -- The claim number makes the fencing token unique per index even if a base repeats.
  local exec = A.exec_base .. job[3] .. '.' .. attempt
  leases[#leases + 1] = deadline; leases[#leases + 1] = jid
  owners[#owners + 1] = jid
  owners[#owners + 1] = exec .. '|' .. A.server .. '|' .. version .. '|' .. attempt
  redis.call('HSET', A.job_prefix .. jid, 'status', 'started', 'started_at', A.now_iso,
    'last_heartbeat', A.now_iso, 'worker_name', A.worker)
  redis.call('HSET', A.exec_prefix .. jid .. ':' .. exec, 'id', exec, 'created_at', now,
    'last_heartbeat', now, 'worker_name', A.worker)
  redis.call('ZADD', A.execs_prefix .. jid, deadline + margin, exec)
  -- rq's own sweeps must never reap a live lease: its wip score sits past ours by a margin.
  wip[#wip + 1] = deadline + margin; wip[#wip + 1] = jid .. ':' .. exec
  local kept = A.conv and redis.call('HEXISTS', K.conv, idx) or 1
  out[#out + 1] = {jid, idx, exec, attempt, spents[j], tries[j], kept}
end
redis.call('ZADD', K.leases, unpack(leases))
redis.call('HSET', K.lease_owner, unpack(owners))
redis.call('ZADD', K.rq_wip, unpack(wip))
return out
