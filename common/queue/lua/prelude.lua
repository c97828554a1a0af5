-- prelude: the lease checks and the switch rule the lease scripts share (scripts.LEASE_SCRIPTS), put after each
-- one's `#!lua` line when common/queue/scripts.py loads it, so none words them on its own.
-- Those scripts' KEYS (K) hold leases, lease_owner and rq_wip.

-- Whether the lease_owner entry `owner` ("exec|server|version|attempt", false when the lease
-- is gone) is this execution's: the fencing check before any change to a leased job.
local function owns(owner, exec)
  return owner and string.sub(owner, 1, #exec + 1) == exec .. '|'
end

-- Drop leases from genq's structures and RQ's started state together: the owner entries, the
-- deadlines, the wip members and RQ's execution keys. execs[i] is jids[i]'s execution id, nil
-- where its owner entry was already gone.
local function drop_leases(jids, execs, exec_prefix, executions_prefix)
  local members, dels = {}, {}
  for i, jid in ipairs(jids) do
    local exec = execs[i]
    if exec then
      members[#members + 1] = jid .. ':' .. exec
      dels[#dels + 1] = exec_prefix .. jid .. ':' .. exec
    end
    dels[#dels + 1] = executions_prefix .. jid
  end
  redis.call('HDEL', K.lease_owner, unpack(jids))
  redis.call('ZREM', K.leases, unpack(jids))
  if #members > 0 then redis.call('ZREM', K.rq_wip, unpack(members)) end
  redis.call('DEL', unpack(dels))
end


-- What a parameter switch refuses, the one rule (common/data/recovery.py's Rules.refused says
-- it of a shard line, so `genq recover` keeps what turn.lua and ack.lua kept): a result of a
-- version below params_floor written (its created_at, Redis's clock; none given: now) at or
-- after a switch to a newer version made with `--inflight abort`. abort_switches reads the
-- floor and those switches ({version, at} each) once per call.
local function abort_switches(floor_key, history_key)
  local aborts = {floor = tonumber(redis.call('GET', floor_key) or '0')}
  if aborts.floor == 0 then return aborts end
  for _, raw in ipairs(redis.call('LRANGE', history_key, 0, -1)) do
    local h = cjson.decode(raw)
    if h.inflight == 'abort' and tonumber(h.version) > 1 then
      aborts[#aborts + 1] = {tonumber(h.version), tonumber(h.at) or 0}
    end
  end
  return aborts
end

local function superseded(aborts, version, at)
  if version >= aborts.floor then return false end
  if type(at) ~= 'number' then return true end
  for _, switch in ipairs(aborts) do
    if switch[1] > version and at >= switch[2] then return true end
  end
  return false
end

-- A conversation's made turns' sums (its entry's fig: prompt, completion and cached tokens,
-- finish name -> count; turns/state.py) went from `before` to `now`: the made:* counters
-- change by as much, so a conversation set back (begun again, rewound) takes its set-aside
-- turns back out, and writing the same entry again adds nothing.
local function count_made(counters_key, now, before)
  now, before = now or {}, before or {}
  local function change(field, by)
    if by ~= 0 then redis.call('HINCRBY', counters_key, field, by) end
  end
  change('made:ptok_sum', (now.p or 0) - (before.p or 0))
  change('made:ctok_sum', (now.c or 0) - (before.c or 0))
  change('made:cached_sum', (now.k or 0) - (before.k or 0))
  local names, finish, finish_before = {}, now.f or {}, before.f or {}
  for name in pairs(finish) do names[name] = true end
  for name in pairs(finish_before) do names[name] = true end
  for name in pairs(names) do
    change('made:finish:' .. name, (finish[name] or 0) - (finish_before[name] or 0))
  end
end
