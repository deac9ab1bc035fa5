-- machine::settle for every item, in order (a key may appear more than once: each item
-- reads what the one before it wrote).
-- keys: the record of each item. args: retention (ms), the channel announcing settled
-- keys, then three per item: the lease's fencing prefix (P<token>:<owner length>:<owner>),
-- the action (c complete, f fail, F fail permanently, r release), the response or error
-- text.
-- Reply: one integer per item: 1 done, 0 fenced. Each key done is published on the
-- channel (its record's Redis key), which wakes the engines waiting on it.

-- One item: 1 done, 0 fenced.
local function settle_one(key, prefix, action, text, retention)
  local v = redis.call('GET', key)
  if not v then return 0 end
  if string.sub(v, 1, #prefix) ~= prefix then
    check(key, v)
    return 0
  end
  local at = after_fingerprint(key, v, #prefix + 1)
  local semi = string.find(v, ';', at, true)
  if not semi then corrupt(key, 'not an idem record') end
  if action == 'c' then
    put(key, 'C' .. string.sub(v, 2, semi) .. text, retention)
  elseif action == 'f' then
    put(key, 'F' .. string.sub(v, 2, semi) .. '0' .. text, retention)
  elseif action == 'F' then
    put(key, 'F' .. string.sub(v, 2, semi) .. '1' .. text, retention)
  else
    local n, w = string.match(v, '^(%d+):(%d+);', at)
    if not n then corrupt(key, 'not an idem record') end
    n, w = num(key, n), num(key, w)
    -- A release needs a live lease (PTTL >= w: now < PEXPIRETIME + 1 - w); a lapsed one
    -- has no attempt left to give back. The lease then ends now, the expiry w later.
    -- An extend after a release revives the lease, not the attempt: none left, fenced.
    if n < 1 or redis.call('PTTL', key) < w then return 0 end
    put(key, string.sub(v, 1, at - 1) .. string.format('%d:%d;', n - 1, w), w)
  end
  return 1
end

local function settle(keys, args)
  local retention = tonumber(args[1])
  local channel = args[2]
  local out = {}
  for i, key in ipairs(keys) do
    local b = 2 + (i - 1) * 3
    out[i] = settle_one(key, args[b + 1], args[b + 2], args[b + 3], retention)
    if out[i] == 1 then redis.call('PUBLISH', channel, key) end
  end
  return out
end
