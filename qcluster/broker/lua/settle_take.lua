-- settle.lua then take.lua in one atomic step: the slot's loop, one round trip per batch.
-- Called with settle.lua as the function settle(KEYS, ARGV) and take.lua as the function
-- take(KEYS, ARGV) (see redis_scripts.compose).
-- KEYS: settle.lua's nine, then take.lua's take record; take's keys are settle's first
--       four and that record.
-- ARGV: the count n of settle's arguments, settle's arguments, then take's arguments.
-- A take presenting its record's token is replayed (take.lua): the settle it carried ran
-- with it, so it is not applied again.
local n = tonumber(ARGV[1])
local token = ARGV[n + 4] .. '|'
if redis.call('GETRANGE', KEYS[10], 0, #token - 1) ~= token then
  settle(KEYS, {unpack(ARGV, 2, n + 1)})
end
return take({KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[10]}, {unpack(ARGV, n + 2, #ARGV)})
