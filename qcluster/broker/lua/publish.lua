-- Store jobs and make them ready at server time + ARGV[1] ms.
-- KEYS: ready, jobs, queue registry set (qc:queues; on a Redis Cluster the queue's own
--       qc:{NAME}:queues, as a script may only touch keys of one hash slot), wake list
-- ARGV: delay_ms, queue name, then (id, body) pairs.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = now + tonumber(ARGV[1])
local n = (#ARGV - 2) / 2
local scores, bodies = {}, {}
for k = 1, n do
  local id, body = ARGV[2 * k + 1], ARGV[2 * k + 2]
  scores[2 * k - 1] = at
  scores[2 * k] = id
  bodies[2 * k - 1] = id
  bodies[2 * k] = body
end
redis.call('HSET', KEYS[2], unpack(bodies))
redis.call('ZADD', KEYS[1], unpack(scores))
redis.call('SADD', KEYS[3], ARGV[2])
-- Wake idle slots blocked on the wake list; a few tokens at most.
local tokens = math.min(n, 16)
for _ = 1, tokens do redis.call('LPUSH', KEYS[4], '1') end
redis.call('LTRIM', KEYS[4], 0, 15)
return n
