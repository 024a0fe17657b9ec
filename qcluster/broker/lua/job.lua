-- Where one job is in one queue, in one atomic read.
-- KEYS: ready, locked, jobs, attempts, dead, reasons, errors
-- ARGV: id
-- Returns {now_ms, where, score, body, attempts, reason, error}: where is "locked",
-- "dead", "ready" or "" (in none: finished, or unknown); the score is the lock expiry,
-- the dead time or the activation time (ms). Finished records are searched by the caller
-- (a scan of lists, in chunks, not in one script that would hold the server).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local where, score, reason = '', false, false
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
return {now, where, score, redis.call('HGET', KEYS[3], id) or false,
        redis.call('HGET', KEYS[4], id) or false, reason,
        redis.call('HGET', KEYS[7], id) or false}
