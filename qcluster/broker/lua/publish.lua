-- Store jobs whose ids are new and make them ready at server time + ARGV[1] ms.
-- An id the queue holds already (ready, delayed, locked or dead: its body is in the jobs
-- hash) is left exactly as it is: storing it again would make a locked job ready for a
-- second slot while the first still runs it, and would forget its lock.
-- KEYS: ready, jobs, queue registry set (qc:queues; on a Redis Cluster the queue's own
--       qc:{NAME}:queues, as a script may only touch keys of one hash slot), wake list
-- ARGV: delay_ms, queue name, then (id, body) pairs.
-- Returns the ids stored, in the order given (an id given twice in one call is one job,
-- and may be listed twice: the caller lists it once).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = now + tonumber(ARGV[1])
local n = (#ARGV - 2) / 2
local ids, scores = {}, {}
for k = 1, n do
  local id = ARGV[2 * k + 1]
  ids[k] = id
  scores[2 * k - 1] = at
  scores[2 * k] = id
end
local held = redis.call('HMGET', KEYS[2], unpack(ids))
redis.call('SADD', KEYS[3], ARGV[2])
local stored = ids
local any_held = false
for k = 1, n do
  if held[k] then
    any_held = true
    break
  end
end
if any_held then
  -- The rare case; when every id is new, the arguments are stored as given.
  local bodies, seen = {}, {}
  stored, scores = {}, {}
  for k = 1, n do
    local id = ids[k]
    if not held[k] and not seen[id] then
      seen[id] = true
      stored[#stored + 1] = id
      scores[#scores + 1] = at
      scores[#scores + 1] = id
      bodies[#bodies + 1] = id
      bodies[#bodies + 1] = ARGV[2 * k + 2]
    end
  end
  if #stored == 0 then return stored end
  redis.call('HSET', KEYS[2], unpack(bodies))
else
  redis.call('HSET', KEYS[2], unpack(ARGV, 3))
end
redis.call('ZADD', KEYS[1], unpack(scores))
-- Wake idle slots blocked on the wake list; a few tokens at most.
local tokens = math.min(#stored, 16)
for _ = 1, tokens do redis.call('LPUSH', KEYS[4], '1') end
redis.call('LTRIM', KEYS[4], 0, 15)
return stored
