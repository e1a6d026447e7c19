-- Fixed window: one counter per aligned window; the hash holds the window index and its count.
-- A clock that stepped back into an older window stays in the stored one, keeping its count.
local idx = math.floor(sec / wsec)
local st = redis.call('HMGET', key, 'w', 'c')
local count = 0
if st[1] and tonumber(st[1]) >= idx then
  idx = tonumber(st[1])
  count = tonumber(st[2])
end
local reset = (idx + 1) * w - now
local allowed = 0
if count < n then
  count = count + 1
  allowed = 1
  redis.call('HSET', key, 'w', idx, 'c', count)
end
local remaining = n - count
if remaining < 0 then remaining = 0 end
local retry = 0
if allowed == 0 then retry = reset end
return finish(allowed, remaining, reset, retry)
