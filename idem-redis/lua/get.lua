-- get. keys[1]: the record. Reply: {the value (nil: none), its PEXPIRETIME}, read at once.
local function get(keys)
  return { redis.call('GET', keys[1]), redis.call('PEXPIRETIME', keys[1]) }
end
