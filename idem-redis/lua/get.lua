-- get. keys[1]: the record. Reply: {the value (nil: none), its PEXPIRETIME}, read at once;
-- a value of another type is IDEMCORRUPT (read()).
local function get(keys)
  return { read(keys[1]), redis.call('PEXPIRETIME', keys[1]) }
end
