-- Where one job is in one queue, in one atomic read.
-- KEYS: ready, locked, jobs, attempts, dead, reasons, errors, finished index
-- ARGV: id
-- Returns {now_ms, where, score, body, attempts, reason, error, finished}: where is
-- "locked", "dead", "ready" or "" (then finished is its record, or false); the score is
-- the lock expiry, the dead time or the activation time (ms).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local where, score, reason, finished = '', false, false, false
local s = redis.call('ZSCORE', KEYS[2], id)
if s then
  where, score = 'locked', s
else
  s = redis.call('ZSCORE', KEYS[5], id)
  if s then
    where, score = 'dead', s
    reason = redis.call('HGET', KEYS[6], id)
  else
    s = redis.call('ZSCORE', KEYS[1], id)
    if s then where, score = 'ready', s end
  end
end
if where == '' then
  for _, bucket in ipairs(redis.call('ZRANGEBYSCORE', KEYS[8], now, '+inf')) do
    finished = redis.call('HGET', bucket, id)
    if finished then break end
  end
end
return {now, where, score, redis.call('HGET', KEYS[3], id) or false,
        redis.call('HGET', KEYS[4], id) or false, reason,
        redis.call('HGET', KEYS[7], id) or false, finished or false}
