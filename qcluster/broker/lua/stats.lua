-- Exact counts at server time. Expired locks count as ready (a take returns them).
-- KEYS: ready, locked, dead
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ready = redis.call('ZCOUNT', KEYS[1], '-inf', now)
local expired = redis.call('ZCOUNT', KEYS[2], '-inf', now)
local locked = redis.call('ZCOUNT', KEYS[2], '(' .. now, '(+inf')  -- not take.lua's +inf marker
local delayed = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
return {ready + expired, locked, delayed, redis.call('ZCARD', KEYS[3])}
