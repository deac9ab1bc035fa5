-- machine::extend. keys[1]: the record. args: the lease's fencing prefix
-- (P<token>:<owner length>:<owner>), ttl (ms).
-- Reply: the new lease_until (ms), or -1 if fenced.
local function extend(keys, args)
  local key, prefix, ttl = keys[1], args[1], tonumber(args[2])
  local v = read(key)
  if not v then return -1 end
  if string.sub(v, 1, #prefix) ~= prefix then
    check(key, v)
    return -1
  end
  local w = string.match(v, '^%d+:(%d+);', after_fingerprint(key, v, #prefix + 1))
  if not w then corrupt(key, 'not an idem record') end
  w = num(key, w)
  -- Only the expiry moves: the lease ends ttl from now, the record w after that.
  if ttl + w >= 2 then
    redis.call('PEXPIRE', key, ttl + w - 1)
    return redis.call('PEXPIRETIME', key) + 1 - w
  end
  redis.call('DEL', key)
  return now_ms() + ttl
end
