-- bump: make a new parameter version current and record the switch with Redis's time at the
-- switch itself, in one step: an ack comes wholly before it (judged by the versions before)
-- or after it (judged by it), and `genq recover`, comparing results' times with the recorded
-- one, decides the same. Refused if the version or its parameters changed since the caller
-- read them: it reads them again.
-- K: its keys by name (scripts.KEYS, put before it at load time)
-- A: version (read), old (its parameters as read, '' if none), new (the new parameters),
--    entry (the history entry, a JSON object without its time): these three by ARGV index;
--    abort (refuse older versions' results from now on: --inflight abort), scopes (the redo
--    scopes marked with the new version)
-- Returns the new version, or 0 when refused.
local version = A.version
if tonumber(redis.call('GET', K.params_version) or '1') ~= version then return 0 end
if (redis.call('HGET', K.params, version) or '') ~= ARGV[A.old] then return 0 end
local new = version + 1
local t = redis.call('TIME')
-- Appended as text: cjson writes 14 significant digits, losing the microseconds.
local entry = string.sub(ARGV[A.entry], 1, -2) .. ',"at":' .. t[1] .. '.' ..
  string.format('%06d', tonumber(t[2])) .. '}'
redis.call('HSET', K.params, new, ARGV[A.new])
redis.call('SET', K.params_version, new)
redis.call('RPUSH', K.params_history, entry)
if A.abort then redis.call('SET', K.params_floor, new) end
for _, scope in ipairs(A.scopes) do redis.call('HSET', K.redo_marks, scope, new) end
return new
