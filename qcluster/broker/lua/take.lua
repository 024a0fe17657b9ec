-- Take up to ARGV[1] ready jobs and lock them for ARGV[2] ms, in one atomic step.
-- KEYS: ready zset (id -> activation ms), locked zset (id -> lock expiry ms),
--       jobs hash (id -> body), attempts hash (id -> takes so far)
-- Returns {now_ms, next_ms|false, id, body, attempts, activate_ms, ...}
-- Times come from the Redis server's clock, never the client's.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local max_jobs = tonumber(ARGV[1])
local lock_until = now + tonumber(ARGV[2])

-- Expired locks: their slot died or hung; the jobs are ready again from now.
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1000)
if #expired > 0 then
  local back = {}
  for i, id in ipairs(expired) do back[2 * i - 1] = now; back[2 * i] = id end
  redis.call('ZADD', KEYS[1], unpack(back))
  redis.call('ZREM', KEYS[2], unpack(expired))
end

local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, max_jobs)
local n = #items / 2
if n == 0 then
  -- Nothing ready: tell the caller when the next delayed job or lock comes due.
  local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
  local lck = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')[2]
  if lck and (not nxt or tonumber(lck) < tonumber(nxt)) then nxt = lck end
  return {now, nxt or false}
end

local ids, locks = {}, {}
for i = 1, n do
  ids[i] = items[2 * i - 1]
  locks[2 * i - 1] = lock_until
  locks[2 * i] = ids[i]
end
-- The n lowest scores are exactly ranks 0..n-1 (same ordering as ZRANGEBYSCORE).
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - 1)
redis.call('ZADD', KEYS[2], unpack(locks))
local bodies = redis.call('HMGET', KEYS[3], unpack(ids))
-- Attempts of the whole batch in two calls (one read, one variadic write), not n.
local before = redis.call('HMGET', KEYS[4], unpack(ids))

local out = {now, lock_until}
local counts, gone = {}, {}
for i = 1, n do
  if bodies[i] then
    local attempts = (tonumber(before[i]) or 0) + 1
    counts[#counts + 1] = ids[i]
    counts[#counts + 1] = attempts
    out[#out + 1] = ids[i]
    out[#out + 1] = bodies[i]
    out[#out + 1] = attempts
    out[#out + 1] = items[2 * i]
  else
    -- Acked meanwhile by a slot whose lock had expired: nothing left to do.
    gone[#gone + 1] = ids[i]
  end
end
if #counts > 0 then redis.call('HSET', KEYS[4], unpack(counts)) end
if #gone > 0 then redis.call('ZREM', KEYS[2], unpack(gone)) end
return out
