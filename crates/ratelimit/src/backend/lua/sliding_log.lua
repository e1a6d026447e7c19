-- Sliding log: a sorted set of the times of allowed requests (rejections are not logged).
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - w)
local count = redis.call('ZCARD', key)
local allowed = 0
if count < n then
  redis.call('ZADD', key, now, ARGV[4])
  count = count + 1
  allowed = 1
end
local reset = 0
local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if newest[2] then reset = tonumber(newest[2]) + w - now end
local retry = 0
if allowed == 0 then
  -- the entry whose expiry brings the count below n
  local e = redis.call('ZRANGE', key, count - n, count - n, 'WITHSCORES')
  retry = tonumber(e[2]) + w - now
end
local remaining = n - count
if remaining < 0 then remaining = 0 end
return finish(allowed, remaining, reset, retry)
