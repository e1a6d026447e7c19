-- Sliding window counter: current and previous aligned window counts; the previous one is
-- weighted by the overlap. Integer arithmetic scaled by W, as in the Rust version.
-- A clock that stepped back into an older window stays in the stored one, at its start.
local idx = math.floor(sec / wsec)
local st = redis.call('HMGET', key, 'w', 'c', 'p')
local cur, prev = 0, 0
if st[1] then
  local sidx = tonumber(st[1])
  if sidx > idx then idx = sidx end
  if sidx == idx then
    cur = tonumber(st[2])
    prev = tonumber(st[3])
  elseif sidx == idx - 1 then
    prev = tonumber(st[2])
  end
end
local wstart = idx * w
local at = now
if at < wstart then at = wstart end
local skew = at - now
local elapsed = at - wstart
local weighted = prev * (w - elapsed)
local allowed = 0
if weighted + (cur + 1) * w <= n * w then
  cur = cur + 1
  allowed = 1
end
redis.call('HSET', key, 'w', idx, 'c', cur, 'p', prev)
local remaining = math.floor((n * w - weighted - cur * w) / w)
if remaining < 0 then remaining = 0 end
local reset = 0
if cur > 0 then
  reset = wstart + 2 * w - now
elseif prev > 0 then
  reset = wstart + w - now
end
local retry = 0
if allowed == 0 then
  if cur < n and prev > 0 then
    local e = w - math.min(math.floor((n - 1 - cur) * w / prev), w)
    retry = e - elapsed
    if retry < 1 then retry = 1 end
  else
    local c = cur
    if c < 1 then c = 1 end
    retry = (w - elapsed) + w - math.min(math.floor((n - 1) * w / c), w)
  end
  retry = skew + retry
end
return finish(allowed, remaining, reset, retry)
