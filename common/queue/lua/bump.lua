-- bump: make a new parameter version current and record the switch with Redis's time at the
-- switch itself, in one step: an ack comes wholly before it (judged by the versions before)
-- or after it (judged by it), and `genq recover`, comparing results' times with the recorded
-- one, decides the same. Refused if the version or its parameters changed since the caller
-- read them: it reads them again.
-- K: its KEYS by name (scripts.KEYS["bump"], put before it at load time)
-- ARGV: 1 the version read, 2 its parameters as read ('' if none), 3 the new parameters,
--       4 the history entry, a JSON object without its time, 5 '1' to refuse older versions'
--       results from now on (--inflight abort), 6... the redo scopes marked with the new version
-- Returns the new version, or 0 when refused.
local version = tonumber(ARGV[1])
if tonumber(redis.call('GET', K.params_version) or '1') ~= version then return 0 end
if (redis.call('HGET', K.params, ARGV[1]) or '') ~= ARGV[2] then return 0 end
local new = version + 1
local t = redis.call('TIME')
-- Appended as text: cjson writes 14 significant digits, losing the microseconds.
local entry = string.sub(ARGV[4], 1, -2) .. ',"at":' .. t[1] .. '.' ..
  string.format('%06d', tonumber(t[2])) .. '}'
redis.call('HSET', K.params, new, ARGV[3])
redis.call('SET', K.params_version, new)
redis.call('RPUSH', K.params_history, entry)
if ARGV[5] == '1' then redis.call('SET', K.params_floor, new) end
for i = 6, #ARGV do redis.call('HSET', K.redo_marks, ARGV[i], new) end
return new
