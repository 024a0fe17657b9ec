-- Take up to ARGV[1] ready jobs and lock them for ARGV[2] ms, in one atomic step.
-- KEYS: ready zset (id -> activation ms), locked zset (id -> lock expiry ms),
--       jobs hash (id -> body), attempts hash (id -> takes so far)
-- Returns {now_ms, next_ms|false} when nothing is ready, else
-- {now_ms, lock_until_ms, n_suspect, id, body, attempts, activate_ms, ...} where a
-- negative attempts marks a suspect job: its previous take ended by lock expiry.
-- Times come from the Redis server's clock, never the client's.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Capped here, whatever the caller asks: unpack() below fails above a few thousand
-- values, and a script that fails after ZREMRANGEBYRANK would strand the jobs it removed.
local max_jobs = math.max(1, math.min(tonumber(ARGV[1]) or 1, 2000))
local lock_until = now + tonumber(ARGV[2])

-- Expired locks: their slot died or hung; the jobs are ready again from now, and the
-- take that died counts as an attempt (a job acked meanwhile is skipped below). The
-- count is stored negative: the job is suspect (it may be what killed its slot).
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1000)
if #expired > 0 then
  local back = {}
  for i, id in ipairs(expired) do
    back[2 * i - 1] = now
    back[2 * i] = id
    if redis.call('HEXISTS', KEYS[3], id) == 1 then
      local before = tonumber(redis.call('HGET', KEYS[4], id)) or 0
      redis.call('HSET', KEYS[4], id, -(math.abs(before) + 1))
    end
  end
  redis.call('ZADD', KEYS[1], unpack(back))
  redis.call('ZREM', KEYS[2], unpack(expired))
end

local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, max_jobs)
local n = #items / 2
if n == 0 then
  -- Nothing ready: tell the caller when the next delayed job or lock comes due.
  local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
  local lck = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2]
  if lck and (not nxt or tonumber(lck) < tonumber(nxt)) then nxt = lck end
  return {now, nxt or false}
end

-- The first member of the lock set is a name longer than zset-max-listpack-value: Redis
-- then keeps the set a skiplist for good. In a listpack every insert scans the whole set,
-- and locking a batch of 100 cost five times as much. Its score +inf never expires.
local marker = '~qcluster: keeps this lock set a skiplist; never a job, never expires~'
local ids, locks = {}, {'+inf', marker}
for i = 1, n do
  ids[i] = items[2 * i - 1]
  locks[2 * i + 1] = lock_until
  locks[2 * i + 2] = ids[i]
end
-- The n lowest scores are exactly ranks 0..n-1 (same ordering as ZRANGEBYSCORE).
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - 1)
redis.call('ZADD', KEYS[2], unpack(locks))
local bodies = redis.call('HMGET', KEYS[3], unpack(ids))
-- The attempts hash holds only takes that ended without an ack (an expired lock, a
-- postpone, a dead letter), written when they end: a take writes nothing per job, and
-- while no job fails the hash does not even exist.
local before = {}
if redis.call('EXISTS', KEYS[4]) == 1 then before = redis.call('HMGET', KEYS[4], unpack(ids)) end

local out = {now, lock_until, 0}
local k = 3
local gone = {}
local suspects = 0
local has_before = #before > 0  -- false while no job failed: the common, fast case
for i = 1, n do
  if bodies[i] then
    local attempts = 1
    if has_before then
      local past = tonumber(before[i]) or 0
      if past < 0 then
        attempts = past - 1  -- still negative: marks the job suspect for the caller
        suspects = suspects + 1
      else
        attempts = past + 1
      end
    end
    out[k + 1] = ids[i]
    out[k + 2] = bodies[i]
    out[k + 3] = attempts
    out[k + 4] = items[2 * i]
    k = k + 4
  else
    -- Acked meanwhile by a slot whose lock had expired: nothing left to do.
    gone[#gone + 1] = ids[i]
  end
end
if #gone > 0 then redis.call('ZREM', KEYS[2], unpack(gone)) end
out[3] = suspects
return out
