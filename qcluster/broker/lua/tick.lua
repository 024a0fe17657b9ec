-- Enqueue one tick of a periodic job and record it as the job's last tick, in one step,
-- unless the record holds that tick or a later one. Run again after any error (a late
-- reply, a reset, a retry, a failover), it stores nothing more: the record, in the
-- queue's own hash slot beside its jobs, says the tick is enqueued, whether its job is
-- still waiting, running or long finished.
-- Called with publish.lua as the function publish(KEYS, ARGV) (see redis_scripts.compose).
-- KEYS: ready, jobs, queue registry, wake list (publish.lua's), the queue's tick records
--       (qc:{NAME}:ticks, job -> tick ms), then on one Redis (not a Cluster) the periodic
--       jobs' records (qc:{periodic}:last), which refuse a tick too and are raised to
--       it in the same step.
-- ARGV: job name, tick ms, queue name, job id, body.
-- Returns {1 if this call enqueued the tick else 0, the job's recorded tick}.
local job, tick = ARGV[1], tonumber(ARGV[2])
-- A record that is not a number stops this job (an error), never another one.
local function recorded_in(key)
  local value = redis.call('HGET', key, job)
  if not value then return -1 end
  return tonumber(value) or error('periodic ' .. job .. ': its record in ' .. key ..
                                  ' is not a tick')
end
local recorded = recorded_in(KEYS[5])
if KEYS[6] then recorded = math.max(recorded, recorded_in(KEYS[6])) end
local stored = 0
if tick > recorded then
  redis.call('HSET', KEYS[5], job, ARGV[2])
  stored = #publish({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, {0, ARGV[3], ARGV[4], ARGV[5]})
  recorded = tick
end
if KEYS[6] and tonumber(redis.call('HGET', KEYS[6], job) or '-1') < recorded then
  redis.call('HSET', KEYS[6], job, string.format('%d', recorded))
end
return {stored, string.format('%d', recorded)}
