-- Settle a batch in one atomic step: ack (delete), postpone (unlock, activate later),
-- dead (move to the dead-letter set with a reason), release (unlock, ready now, unstarted),
-- crashed (unlock, ready now, counted, suspect), refused (dead, not counted).
-- KEYS: ready, locked, jobs, attempts, dead zset (id -> dead ms), reasons hash, wake list,
--       errors hash (id -> last error JSON), finished index hash (bucket key -> jobs)
-- ARGV: n_ack, n_postpone, n_dead, n_release, n_crashed, n_refused, n_ack_held, n_errors,
--       dead_max_count, dead_max_age_ms, keep_finished_ms, finished_cap, n_runs,
--       then n_ack ids,
--       then n_postpone triples (id, lock_until_ms, delay_ms),
--       then n_dead triples (id, lock_until_ms, reason),
--       then n_release triples (id, lock_until_ms, activate_ms),
--       then n_crashed pairs (id, lock_until_ms),
--       then n_refused triples (id, lock_until_ms, reason),
--       then n_ack_held pairs (id, lock_until_ms),
--       then n_errors pairs (id, last error JSON),
--       then n_runs triples (taken_ms, attempts, count): the acks, in order, run-length
--       encoded (keep_finished_ms 0: the queue keeps no finished records, and n_runs is 0).
-- Postpone, dead and release apply only while the caller still holds the lock (its
-- lock_until matches): a slot whose lock expired must not move a job another slot now
-- runs. Postpone and dead count the take in the attempts hash (take.lua reads it); a
-- release does not: the job was never handed to a handler.
-- The attempts hash holds |takes that ended without an ack|; a negative value says the
-- last of them ended by lock expiry (take.lua), which a settled take clears.
-- Dead letters are kept at most dead_max_count per queue and dead_max_age_ms.
-- A postponed or dead-lettered job keeps its last error (replacing an earlier one) until it
-- is acked, requeued or forgotten. An acked job leaves a finished record for
-- keep_finished_ms (see the finished section), at most finished_cap per time bucket.
-- Returns the number of jobs settled.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n_ack, n_post = tonumber(ARGV[1]), tonumber(ARGV[2])
local n_dead, n_release = tonumber(ARGV[3]), tonumber(ARGV[4])
local n_crashed, n_refused = tonumber(ARGV[5]), tonumber(ARGV[6])
local n_ack_held, n_errors = tonumber(ARGV[7]), tonumber(ARGV[8])
local max_count, max_age = tonumber(ARGV[9]), tonumber(ARGV[10])
local keep, cap, n_runs = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local i = 14
local settled = 0
local moved = {}  -- postponed and dead-lettered here: their errors are stored

local function holds_lock(id, lock_until)
  local score = redis.call('ZSCORE', KEYS[2], id)
  return score and tonumber(score) == tonumber(lock_until)
end

local function count_attempt(id)
  local before = tonumber(redis.call('HGET', KEYS[4], id)) or 0
  redis.call('HSET', KEYS[4], id, math.abs(before) + 1)
end

if n_ack > 0 then
  local ids = {unpack(ARGV, i, i + n_ack - 1)}
  redis.call('ZREM', KEYS[2], unpack(ids))
  redis.call('ZREM', KEYS[1], unpack(ids))
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('HDEL', KEYS[4], unpack(ids)) end
  if redis.call('EXISTS', KEYS[8]) == 1 then redis.call('HDEL', KEYS[8], unpack(ids)) end
  settled = settled + redis.call('HDEL', KEYS[3], unpack(ids))
  i = i + n_ack
end
for _ = 1, n_post do
  local id, lock_until, delay = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]) or 0
  i = i + 3
  if holds_lock(id, lock_until) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[1], now + delay, id)
    count_attempt(id)
    moved[id] = true
    settled = settled + 1
  end
end
local died = 0
for _ = 1, n_dead do
  local id, lock_until, reason = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if holds_lock(id, lock_until) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[5], now, id)
    redis.call('HSET', KEYS[6], id, reason)
    count_attempt(id)
    moved[id] = true
    settled = settled + 1
    died = died + 1
  end
end
local released = 0
for _ = 1, n_release do
  local id, lock_until, activate = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]) or now
  i = i + 3
  if holds_lock(id, lock_until) then
    redis.call('ZREM', KEYS[2], id)
    -- Its old activation time (at most now): it keeps its place at the head of the queue.
    redis.call('ZADD', KEYS[1], math.min(activate, now), id)
    settled = settled + 1
    released = released + 1
  end
end
-- Crashed: their slot died while running them; counted, suspect (negative, as a lock
-- expiry does), ready now.
for _ = 1, n_crashed do
  local id, lock_until = ARGV[i], ARGV[i + 1]
  i = i + 2
  if holds_lock(id, lock_until) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[1], now, id)
    local before = tonumber(redis.call('HGET', KEYS[4], id)) or 0
    redis.call('HSET', KEYS[4], id, -(math.abs(before) + 1))
    settled = settled + 1
    released = released + 1
  end
end
-- Refused: dead-lettered without running; the take that found them is not counted.
for _ = 1, n_refused do
  local id, lock_until, reason = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if holds_lock(id, lock_until) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[5], now, id)
    redis.call('HSET', KEYS[6], id, reason)
    local before = tonumber(redis.call('HGET', KEYS[4], id)) or 0
    redis.call('HSET', KEYS[4], id, math.abs(before))
    moved[id] = true
    settled = settled + 1
    died = died + 1
  end
end
-- Acked only while that lock is held.
for _ = 1, n_ack_held do
  local id, lock_until = ARGV[i], ARGV[i + 1]
  i = i + 2
  if holds_lock(id, lock_until) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('HDEL', KEYS[4], id)
    redis.call('HDEL', KEYS[8], id)
    settled = settled + redis.call('HDEL', KEYS[3], id)
  end
end
-- The last errors of jobs postponed or dead-lettered above.
for _ = 1, n_errors do
  local id, err = ARGV[i], ARGV[i + 1]
  i = i + 2
  if moved[id] then redis.call('HSET', KEYS[8], id, err) end
end
-- Finished records of the acks (none when the queue keeps none): one list entry per run
-- of acks, "finished_ms taken_ms attempts:,id,id,...,", in the list of the current time bucket (it expires whole: no per-job expiry work, one push per batch).
-- The index hash counts each live bucket's jobs (at most finished_cap are kept).
if keep > 0 and n_ack > 0 then
  local width = math.max(1000, math.ceil(keep / 8))
  local index = math.floor(now / width)
  local bucket = KEYS[9] .. ':' .. width .. ':' .. index
  local count = redis.call('HINCRBY', KEYS[9], bucket, n_ack)
  if count <= cap then
    local entries, a = {}, 14  -- the acks' ids start at ARGV[14]
    for r = 1, n_runs do
      local n = tonumber(ARGV[i + 2])
      entries[r] = now .. ' ' .. ARGV[i] .. ' ' .. ARGV[i + 1] .. ':,'
        .. table.concat(ARGV, ',', a, a + n - 1) .. ','
      a = a + n
      i = i + 3
    end
    redis.call('RPUSH', bucket, unpack(entries))
  end
  if count == n_ack then  -- a new bucket: it expires whole; forget the expired ones
    redis.call('PEXPIREAT', bucket, (index + 1) * width + keep)
    for _, old in ipairs(redis.call('HKEYS', KEYS[9])) do
      if redis.call('EXISTS', old) == 0 then redis.call('HDEL', KEYS[9], old) end
    end
  end
end
if released > 0 then
  redis.call('LPUSH', KEYS[7], '1')
  redis.call('LTRIM', KEYS[7], 0, 15)
end

-- Dead-letter retention, only when this call added dead letters: the oldest go first.
local function forget(ids)
  if #ids == 0 then return end
  redis.call('ZREM', KEYS[5], unpack(ids))
  redis.call('HDEL', KEYS[3], unpack(ids))
  redis.call('HDEL', KEYS[6], unpack(ids))
  redis.call('HDEL', KEYS[4], unpack(ids))
  redis.call('HDEL', KEYS[8], unpack(ids))
end
if died > 0 then
  forget(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. (now - max_age), 'LIMIT', 0, 1000))
  local over = redis.call('ZCARD', KEYS[5]) - max_count
  if over > 0 then forget(redis.call('ZRANGE', KEYS[5], 0, math.min(over, 1000) - 1)) end
end
return settled
