-- Delete ready and delayed jobs (and jobs whose lock expired); keep live locks and dead.
-- KEYS: ready, locked, jobs, attempts, errors
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local removed = 0
local function drop(ids)
  for start = 1, #ids, 1000 do
    local chunk = {unpack(ids, start, math.min(start + 999, #ids))}
    redis.call('HDEL', KEYS[3], unpack(chunk))
    redis.call('HDEL', KEYS[4], unpack(chunk))
    if KEYS[5] then redis.call('HDEL', KEYS[5], unpack(chunk)) end
    removed = removed + #chunk
  end
end
drop(redis.call('ZRANGE', KEYS[1], 0, -1))
redis.call('DEL', KEYS[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
drop(expired)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
return removed
