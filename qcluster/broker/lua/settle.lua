-- Settle a batch in one atomic step: ack (delete), postpone (unlock, activate later),
-- dead (move to the dead-letter set with a reason).
-- KEYS: ready, locked, jobs, attempts, dead zset (id -> dead ms), reasons hash
-- ARGV: n_ack, n_postpone, n_dead, then n_ack ids,
--       then n_postpone triples (id, lock_until_ms, delay_ms),
--       then n_dead triples (id, lock_until_ms, reason).
-- Postpone and dead apply only while the caller still holds the lock (its lock_until
-- matches): a slot whose lock expired must not move a job another slot now runs. Both
-- count the take in the attempts hash (take.lua reads it).
-- Returns the number of jobs settled.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n_ack, n_post, n_dead = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local i = 4
local settled = 0

local function holds_lock(id, lock_until)
  local score = redis.call('ZSCORE', KEYS[2], id)
  return score and tonumber(score) == tonumber(lock_until)
end

if n_ack > 0 then
  local ids = {unpack(ARGV, i, i + n_ack - 1)}
  redis.call('ZREM', KEYS[2], unpack(ids))
  redis.call('ZREM', KEYS[1], unpack(ids))
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('HDEL', KEYS[4], unpack(ids)) end
  settled = settled + redis.call('HDEL', KEYS[3], unpack(ids))
  i = i + n_ack
end
for _ = 1, n_post do
  local id, lock_until, delay = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  i = i + 3
  if holds_lock(id, lock_until) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[1], now + delay, id)
    redis.call('HINCRBY', KEYS[4], id, 1)
    settled = settled + 1
  end
end
for _ = 1, n_dead do
  local id, lock_until, reason = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if holds_lock(id, lock_until) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[5], now, id)
    redis.call('HSET', KEYS[6], id, reason)
    redis.call('HINCRBY', KEYS[4], id, 1)
    settled = settled + 1
  end
end
return settled
