-- On a Redis Cluster, raise a periodic job's record to its last enqueued tick, after
-- tick.lua ran in the queue's hash slot (the records live in another one).
-- KEYS: the periodic jobs' records (qc:{periodic}:last, job -> tick ms)
-- ARGV: job name, tick ms.
-- Returns 1 if the record was raised, 0 if it held that tick or a later one.
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1') or -1
if tonumber(ARGV[2]) <= last then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
