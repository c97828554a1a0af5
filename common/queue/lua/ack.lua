#!lua flags=allow-oom
-- ack: accept written results, each iff its lease is still ours: done bit, exact counters,
-- rate buckets and RQ's finished state change together or not at all.
-- One call carries the results one consumer wrote together (consumer/batch.py). Each is
-- judged as if it came alone (they are different indices); what they change in common (the
-- bitmaps, the counters, the rate bucket, the registries) goes to Redis once for all of them,
-- so the commands per result fall as the batch grows.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: server, result_ttl, now_iso, job_prefix, exec_prefix (execution key), execs_prefix
--    (executions key), rate_prefix, bucket_s and bucket_ttl (the rate's), finished_keep (jobs
--    kept for rq's tools), life (the run's life the caller knows, "epoch|generation"; '': not
--    checked), results: each {jid, idx, exec (id), ctoks and ptoks (completion and prompt
--    tokens), fname and fcode (finish name and code), ver (params version), attempt, at
--    (created_at, Redis's clock; null: now), cont (tokens of the partial answer it continued),
--    cached (prompt tokens)}
-- Returns one code per result: 1 accepted, 0 the lease was lost (a stale ack is refused),
-- 2 its parameters were superseded by a requeue that aborts old work (the task is queued
-- again), 3 a redo issued after its version covers it (set aside as the index's previous
-- result, the task queued again). All are refused when the run is not the life the caller
-- knows: a consumer that slept through a loss and a recover holds claims of the run before it.
local items, jids, out = {}, {}, {}
for n, it in ipairs(A.results) do
  it.n, items[n], jids[n], out[n] = n, it, it.jid, 0
end
local function push(list, ...)
  for _, v in ipairs({...}) do list[#list + 1] = v end
end

if A.life ~= '' and life(K.meta) ~= A.life then return out end
local owners = redis.call('HMGET', K.lease_owner, unpack(jids))
local mine, owned, execs = {}, {}, {}
for i, it in ipairs(items) do
  if owns(owners[i], it.exec) then
    mine[#mine + 1], owned[#owned + 1], execs[#execs + 1] = it, it.jid, it.exec
  end
end
if #mine == 0 then return out end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
drop_leases(owned, execs, A.exec_prefix, A.execs_prefix)

-- A result of an older version written at or after an abort switch is refused: the prelude's
-- `superseded`, the rule turn.lua and `genq recover` apply too.
local aborts = abort_switches(K.params_floor, K.params_history)
local marks = redis.call('HMGET', K.redo_marks, 'done', 'truncated')
local mark_done, mark_trunc = tonumber(marks[1] or '0'), tonumber(marks[2] or '0')
local spent, kept, requeue, keep, accept, covered = {'OVERFLOW', 'SAT'}, {}, {}, {}, {}, {}
local function give_back(it, code)  -- the task runs again; this attempt costs nothing
  push(spent, 'INCRBY', 'u8', '#' .. it.idx, -1)
  redis.call('HSET', A.job_prefix .. it.jid, 'status', 'queued')
  requeue[#requeue + 1] = it.jid
  out[it.n] = code
end
for _, it in ipairs(mine) do
  if superseded(aborts, it.ver, it.at) then
    give_back(it, 2)  -- run again under the new parameters
  elseif it.ver < mark_done or (it.fname == 'length' and it.ver < mark_trunc) then
    covered[#covered + 1] = it
  else
    accept[#accept + 1] = it
  end
end
-- A redo covers every result of an older version, also one still in flight when it was issued
-- (--inflight finish): such a result is kept as the previous one and the index runs again.
if #covered > 0 then
  local get = {}
  for _, it in ipairs(covered) do push(get, 'GET', 'u1', it.idx) end
  local bits = redis.call('BITFIELD', K.done, unpack(get))
  for i, it in ipairs(covered) do
    if bits[i] == 0 then
      keep[#keep + 1] = it
      push(kept, 'SET', 'u1', it.idx, 1)
      give_back(it, 3)
    else
      accept[#accept + 1] = it  -- already done: only RQ's view is finished below
    end
  end
end

local counters, hist, bucket = {}, {}, {}
local function add(tbl, field, by) tbl[field] = (tbl[field] or 0) + by end
if #accept > 0 then
  local set = {}
  for _, it in ipairs(accept) do push(set, 'SET', 'u1', it.idx, 1) end
  local was = redis.call('BITFIELD', K.done, unpack(set))
  local pending, truncated = {}, {}
  for i, it in ipairs(accept) do
    out[it.n] = 1
    if was[i] == 0 then  -- a new result; one already done is not counted twice
      keep[#keep + 1] = it
      push(pending, 'SET', 'u1', it.idx, 0)
      push(kept, 'SET', 'u1', it.idx, 0)  -- a new result replaces any kept previous one
      push(spent, 'SET', 'u8', '#' .. it.idx, 0)
      push(truncated, 'SET', 'u1', it.idx, it.fname == 'length' and 1 or 0)
      add(counters, 'finish:' .. it.fname, 1)
      add(counters, 'ctok_sum', it.ctoks)
      add(counters, 'ptok_sum', it.ptoks)
      add(counters, 'cached_sum', it.cached)
      add(hist, it.ctoks, 1)
      add(bucket, 'req', 1)
      -- The rate is what the servers decode now: not a continued answer's partial.
      add(bucket, 'tok', it.ctoks - it.cont)
      add(bucket, 'req|' .. A.server, 1)
      add(bucket, 'tok|' .. A.server, it.ctoks - it.cont)
      add(bucket, 'fin|' .. it.fname, 1)
      -- Per parameter version: the truncation alert judges only the current parameters, and
      -- the page says whether a raised max_tokens is enough.
      add(bucket, 'vreq|' .. it.ver, 1)
      if it.fname == 'length' then add(bucket, 'vlen|' .. it.ver, 1) end
      if it.cont > 0 then  -- `requeue --continue`: answers continued, tokens not decoded again
        add(counters, 'continued|' .. it.ver, 1)
        add(counters, 'saved|' .. it.ver, it.cont)
      end
    end
  end
  if #pending > 0 then
    redis.call('BITFIELD', K.pending, unpack(pending))
    redis.call('BITFIELD', K.truncated, unpack(truncated))
  end
end
if #keep > 0 then
  local tokens, ptoks, finish, version, attempt, cont, cached = {}, {}, {}, {}, {}, {}, {}
  for _, it in ipairs(keep) do
    local at = '#' .. it.idx
    push(tokens, 'SET', 'u32', at, it.ctoks)
    push(cont, 'SET', 'u32', at, it.cont)
    push(ptoks, 'SET', 'u32', at, it.ptoks)
    push(cached, 'SET', 'u32', at, it.cached)
    push(finish, 'SET', 'u8', at, it.fcode)
    push(version, 'SET', 'u16', at, it.ver)
    push(attempt, 'SET', 'u16', at, it.attempt)
  end
  redis.call('BITFIELD', K.acc_tokens, unpack(tokens))
  redis.call('BITFIELD', K.acc_ptoks, unpack(ptoks))
  redis.call('BITFIELD', K.acc_finish, unpack(finish))
  redis.call('BITFIELD', K.acc_version, unpack(version))
  redis.call('BITFIELD', K.acc_attempt, unpack(attempt))
  redis.call('BITFIELD', K.acc_cont, unpack(cont))
  redis.call('BITFIELD', K.acc_cached, unpack(cached))
end
if #kept > 0 then redis.call('BITFIELD', K.kept, unpack(kept)) end
if #spent > 2 then
  redis.call('BITFIELD', K.spent, unpack(spent))
  -- tries follows spent here: a result given back was answered (genq's own reason to run it
  -- again, not the server's trouble), and an accepted one starts its index's count afresh.
  redis.call('BITFIELD', K.tries, unpack(spent))
end
if #requeue > 0 then redis.call('LPUSH', K.rq_queue, unpack(requeue)) end
for field, by in pairs(counters) do redis.call('HINCRBY', K.counters, field, by) end
for value, count in pairs(hist) do redis.call('HINCRBY', K.length_hist, value, count) end
if next(bucket) then
  local key = A.rate_prefix .. math.floor(now / A.bucket_s)
  -- Every new result counts in 'req': equal to this call's count, the bucket is new.
  if redis.call('HINCRBY', key, 'req', bucket.req) == bucket.req then
    redis.call('EXPIRE', key, A.bucket_ttl)
  end
  bucket.req = nil
  for field, by in pairs(bucket) do redis.call('HINCRBY', key, field, by) end
end
if #accept == 0 then return out end

local indices, finished, old = {}, {}, {}
for _, it in ipairs(accept) do indices[#indices + 1] = it.idx end
redis.call('HDEL', K.errors, unpack(indices))
redis.call('HDEL', K.partials, unpack(indices))  -- a partial is continued once at most
-- The prompt ended: an answer it once failed its schema with is no longer export's to show.
redis.call('HDEL', K.invalid, unpack(indices))
-- A conversation (--turns all) needs its made turns again only if a redo goes on from its end
-- (A.conv: a --turns all run's; a one-turn run has none to drop).
local ended = {}
for _, it in ipairs(A.conv and accept or {}) do
  if it.fname ~= 'length' then ended[#ended + 1] = it.idx end
end
if #ended > 0 then redis.call('HDEL', K.conv_msgs, unpack(ended)) end
-- rq's tools see the last few finished jobs, never one hash per task: the oldest beyond the
-- bound leave the registry and Redis together. A job RQ deleted meanwhile is not recreated.
for _, it in ipairs(accept) do
  local job = A.job_prefix .. it.jid
  if redis.call('EXISTS', job) == 1 then
    redis.call('HSET', job, 'status', 'finished', 'ended_at', A.now_iso)
    redis.call('EXPIRE', job, A.result_ttl)
    push(finished, now + A.result_ttl, it.jid)
  end
end
if #finished == 0 then return out end
redis.call('ZADD', K.rq_finished, unpack(finished))
local extra = redis.call('ZCARD', K.rq_finished) - A.finished_keep
if extra > 0 then
  local oldest = redis.call('ZPOPMIN', K.rq_finished, extra)
  for i = 1, #oldest, 2 do
    -- A member left by a redo may name a job queued again since: that one stays.
    local job = A.job_prefix .. oldest[i]
    if redis.call('HGET', job, 'status') == 'finished' then old[#old + 1] = job end
  end
  if #old > 0 then redis.call('DEL', unpack(old)) end
end
return out
