-- Token bucket: tokens scaled by W (one token = W), refilled at N per microsecond.
local cap = burst * w
local st = redis.call('HMGET', key, 'tk', 'ts')
local tokens, ts = cap, now
if st[1] then
  tokens = tonumber(st[1])
  ts = tonumber(st[2])
end
local at = now
if ts > at then at = ts end
tokens = math.min(cap, tokens + (at - ts) * n)
local allowed = 0
if tokens >= w then
  tokens = tokens - w
  allowed = 1
end
redis.call('HSET', key, 'tk', tokens, 'ts', at)
local skew = at - now
local remaining = math.floor(tokens / w)
local reset = skew + math.ceil((cap - tokens) / n)
local retry = 0
if allowed == 0 then retry = skew + math.ceil((w - tokens) / n) end
return finish(allowed, remaining, reset, retry)
