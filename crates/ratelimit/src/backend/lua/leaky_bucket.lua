-- Leaky bucket as a meter (GCRA): level scaled by W (one request = W), drains N per microsecond.
local cap = burst * w
local st = redis.call('HMGET', key, 'lv', 'ts')
local level, ts = 0, now
if st[1] then
  level = tonumber(st[1])
  ts = tonumber(st[2])
end
local at = now
if ts > at then at = ts end
level = math.max(0, level - (at - ts) * n)
local allowed = 0
if level + w <= cap then
  level = level + w
  allowed = 1
end
redis.call('HSET', key, 'lv', level, 'ts', at)
local skew = at - now
-- a rules reload that lowered the capacity can leave the level above it
local remaining = math.floor((cap - level) / w)
if remaining < 0 then remaining = 0 end
local reset = skew + math.ceil(level / n)
local retry = 0
if allowed == 0 then retry = skew + math.ceil((level + w - cap) / n) end
return finish(allowed, remaining, reset, retry)
