-- Requeue or delete dead letters by id (ids that are not dead letters are skipped).
-- KEYS: ready, jobs, attempts, dead, reasons, errors, wake
-- ARGV: "requeue" | "delete", then the ids.
-- Requeued: ready now, attempts reset, reason and last error dropped.
-- Returns how many moved.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local requeue = ARGV[1] == 'requeue'
local moved = 0
for k = 2, #ARGV do
  local id = ARGV[k]
  if redis.call('ZREM', KEYS[4], id) == 1 then
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[5], id)
    redis.call('HDEL', KEYS[6], id)
    if requeue then
      redis.call('ZADD', KEYS[1], now, id)
    else
      redis.call('HDEL', KEYS[2], id)
    end
    moved = moved + 1
  end
end
if requeue and moved > 0 then
  redis.call('LPUSH', KEYS[7], '1')
  redis.call('LTRIM', KEYS[7], 0, 15)
end
return moved
