-- Move every dead job back to ready now, attempts reset.
-- KEYS: ready, attempts, dead, reasons, errors
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGE', KEYS[3], 0, -1)
for start = 1, #ids, 1000 do
  local chunk, scores = {}, {}
  for k = start, math.min(start + 999, #ids) do
    chunk[#chunk + 1] = ids[k]
    scores[#scores + 1] = now
    scores[#scores + 1] = ids[k]
  end
  redis.call('ZADD', KEYS[1], unpack(scores))
  redis.call('HDEL', KEYS[2], unpack(chunk))
  redis.call('HDEL', KEYS[4], unpack(chunk))
  if KEYS[5] then redis.call('HDEL', KEYS[5], unpack(chunk)) end
end
redis.call('DEL', KEYS[3])
return #ids
