-- machine::settle for every item, in order (a key may appear more than once: each item
-- reads what the one before it wrote).
-- keys: the record of each item. args: retention (ms), the channel announcing settled
-- keys, then three per item: the lease's fencing prefix (P<token>:<owner length>:<owner>),
-- the action (c complete, k complete keeping the key's expiry, f fail, F fail permanently,
-- r release), the response or error text.
-- `k` is sent for a lease the client sees live for a while yet. Its record then expires
-- at the lease's end plus the claim's retention (w), later than now plus retention; when
-- w is this settle's retention, the completed record keeps that expiry (SET KEEPTTL, about
-- 0.4 us a key cheaper than SET PX inside a function; README, "Native expiry"), as
-- PostgreSQL's settle keeps expires_at. Otherwise `k` is `c`.
-- Reply: one integer per item: 1 done, 0 fenced. The keys done (their records' Redis
-- keys) are published on the channel, in one message joined by NUL bytes, which wakes the
-- engines waiting on them.

-- One item whose record reads v (false when absent): 1 done or 0 fenced, and what the
-- key holds afterwards.
local function settle_one(key, v, prefix, action, text, px, keep)
  if not v then return 0, v end
  if string.sub(v, 1, #prefix) ~= prefix then
    check(key, v)
    return 0, v
  end
  local at = after_fingerprint(key, v, #prefix + 1)
  local semi = string.find(v, ';', at, true)
  if not semi then corrupt(key, 'not an idem record') end
  local new
  if action == 'c' or action == 'k' then
    new = 'C' .. string.sub(v, 2, semi) .. text
    -- The record's w is the digits between the last ':' and ';': keep = ':' .. retention.
    if action == 'k' and px and string.sub(v, semi - #keep, semi - 1) == keep then
      redis.call('SET', key, new, 'KEEPTTL')
      return 1, new
    end
  elseif action == 'f' then
    new = 'F' .. string.sub(v, 2, semi) .. '0' .. text
  elseif action == 'F' then
    new = 'F' .. string.sub(v, 2, semi) .. '1' .. text
  else
    local n, w = string.match(v, '^(%d+):(%d+);', at)
    if not n then corrupt(key, 'not an idem record') end
    n, w = num(key, n), num(key, w)
    -- A release needs a live lease (PTTL >= w: now < PEXPIRETIME + 1 - w); a lapsed one
    -- has no attempt left to give back. The lease then ends now, the expiry w later.
    -- An extend after a release revives the lease, not the attempt: none left, fenced.
    if n < 1 or redis.call('PTTL', key) < w then return 0, v end
    new = string.sub(v, 1, at - 1) .. string.format('%d:%d;', n - 1, w)
    if w < 2 then
      redis.call('DEL', key)
      return 1, false
    end
    redis.call('SET', key, new, 'PX', tostring(w - 1))
    return 1, new
  end
  if px then
    redis.call('SET', key, new, 'PX', px)
    return 1, new
  end
  redis.call('DEL', key)
  return 1, false
end

-- The records are read in one MGET and the settled keys published in one message, their
-- names joined by NUL (a byte no key holds): inside a function each redis.call costs
-- about 1.3 µs of its own, more than a GET or a PUBLISH does (README, "Server time").
-- MGET of every key, in slices: unpack is bounded by Lua's C stack (about 8,000 values).
local function read_all(keys)
  local read = {}
  for from = 1, #keys, 1000 do
    local part = redis.call('MGET', unpack(keys, from, math.min(from + 999, #keys)))
    for j = 1, #part do read[from + j - 1] = part[j] end
  end
  return read
end

local function settle(keys, args)
  local retention = tonumber(args[1])
  local channel = args[2]
  -- put()'s rule: a key expires one millisecond after its PEXPIRETIME, PX takes at least 1.
  local px = retention >= 2 and tostring(retention - 1) or nil
  local keep = ':' .. args[1]
  local read = read_all(keys)
  -- A key met again reads what its previous item wrote.
  local written = {}
  local out, done = {}, {}
  for i, key in ipairs(keys) do
    local b = 2 + (i - 1) * 3
    local v = read[i]
    if written[key] ~= nil then v = written[key] end
    local ok, now = settle_one(key, v, args[b + 1], args[b + 2], args[b + 3], px, keep)
    out[i] = ok
    if ok == 1 then
      written[key] = now
      done[#done + 1] = key
    end
  end
  if #done > 0 then redis.call('PUBLISH', channel, table.concat(done, '\0')) end
  return out
end
