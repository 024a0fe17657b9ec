-- Take up to ARGV[1] ready jobs and lock them for ARGV[2] ms, in one atomic step, as the
-- take named ARGV[3] (its token: unique to one call of the caller).
-- KEYS: ready zset (id -> activation ms), locked zset (id -> lock expiry ms),
--       jobs hash (id -> body), attempts hash (id -> takes so far),
--       the caller's take record (a string: "TOKEN|" and the take's ids, see below)
-- Returns {now_ms, next_ms|false} when nothing is ready, else
-- {now_ms, lock_until_ms, n_suspect, id, body, attempts, activate_ms, ...} where a
-- negative attempts marks a suspect job: its previous take ended by lock expiry.
-- Times come from the Redis server's clock, never the client's.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Capped here, whatever the caller asks: unpack() below fails above a few thousand
-- values, and a script that fails after ZREMRANGEBYRANK would strand the jobs it removed.
local max_jobs = math.max(1, math.min(tonumber(ARGV[1]) or 1, 2000))
local lock_ms = tonumber(ARGV[2])
local lock_until = now + lock_ms
local token = ARGV[3] .. '|'

-- The record of the caller's last take that got jobs: its token, then (msgpack) the take's
-- time, its lock expiry and its ids. It lives as long as the locks. A call that carries
-- the recorded token is that take again: its reply was lost (a reset, a timeout) and the
-- caller retried. It gets the jobs that take still holds, locked anew and never charged
-- again, instead of new ones: the first jobs would otherwise stay locked to nobody until
-- expiry, then come back charged and suspect without having run. Only the ids are kept
-- (the take is the hot path): a replayed job's attempts are read again from the attempts
-- hash, which a take does not write, and its activation time is given as its take's.
if redis.call('GETRANGE', KEYS[5], 0, #token - 1) == token then
  local taken_at, held_until, taken = cmsgpack.unpack(
    string.sub(redis.call('GET', KEYS[5]), #token + 1))
  local ids, k, suspects = {}, 3, 0
  local out = {now, lock_until, 0}
  for _, id in ipairs(taken) do
    -- Held only while its lock is that take's: an expired one may be another's now.
    if tonumber(redis.call('ZSCORE', KEYS[2], id)) == held_until then
      local body = redis.call('HGET', KEYS[3], id)
      if body then
        local past = tonumber(redis.call('HGET', KEYS[4], id)) or 0
        local attempts = past + 1
        if past < 0 then attempts, suspects = past - 1, suspects + 1 end
        redis.call('ZADD', KEYS[2], lock_until, id)
        out[k + 1], out[k + 2], out[k + 3], out[k + 4] = id, body, attempts, taken_at
        k = k + 4
        ids[#ids + 1] = id
      end
    end
  end
  if k > 3 then
    out[3] = suspects
    redis.call('SET', KEYS[5], token .. cmsgpack.pack(taken_at, lock_until, ids), 'PX', lock_ms)
    return out
  end
  -- None held any longer: a take like any other.
end

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
-- The record (see above): the ids of jobs acked meanwhile too, which a replay skips.
if k > 3 then
  redis.call('SET', KEYS[5], token .. cmsgpack.pack(now, lock_until, ids), 'PX', lock_ms)
end
return out
