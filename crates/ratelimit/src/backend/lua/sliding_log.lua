-- Sliding log: a sorted set of the times of allowed requests (rejections are not logged).
-- A key's time never goes backwards (a clock may step back): decide at the newest entry's time;
-- reset and retry are measured from `now`, so they include the step.
local at = now
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if last[2] and tonumber(last[2]) > at then at = tonumber(last[2]) end
redis.call('ZREMRANGEBYSCORE', key, '-inf', at - w)
local count = redis.call('ZCARD', key)
local allowed = 0
if count < n then
  redis.call('ZADD', key, at, ARGV[4])
  count = count + 1
  allowed = 1
end
-- the newest entry: the one just added, else the newest before (kept: a denial leaves n or more)
local reset = 0
if allowed == 1 then
  reset = at + w - now
elseif last[2] then
  reset = tonumber(last[2]) + w - now
end
local retry = 0
if allowed == 0 then
  -- the entry whose expiry brings the count below n
  local e = redis.call('ZRANGE', key, count - n, count - n, 'WITHSCORES')
  retry = tonumber(e[2]) + w - now
end
local remaining = n - count
if remaining < 0 then remaining = 0 end
return finish(allowed, remaining, reset, retry)
