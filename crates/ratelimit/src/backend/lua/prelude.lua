-- Shared head of every rate-limit script (the algorithm's body follows).
-- KEYS[1]  counter key (hash-tagged, so a multi-key variant would stay in one cluster slot)
-- ARGV[1]  N, requests per unit        ARGV[2]  W, unit length in seconds
-- ARGV[3]  B, burst capacity           ARGV[4]  unique request id (sliding log member)
-- Returns {allowed (0/1), remaining, reset_us, retry_after_us, server_now_us}.
-- Time is the server's clock (TIME), the one clock every web replica shares.
local t = redis.call('TIME')
local sec = tonumber(t[1])
local now = sec * 1000000 + tonumber(t[2])
local key = KEYS[1]
local n = tonumber(ARGV[1])
local wsec = tonumber(ARGV[2])
local w = wsec * 1000000
local burst = tonumber(ARGV[3])

local function finish(allowed, remaining, reset, retry)
  -- The state is equivalent to a fresh one after `reset`: let Redis drop it then (rounded
  -- up, plus 1 ms because Redis counts the TTL from its millisecond clock).
  if reset > 0 then
    redis.call('PEXPIRE', key, math.ceil(reset / 1000) + 1)
  end
  return {allowed, remaining, reset, retry, now}
end
