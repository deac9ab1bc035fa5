-- get. KEYS[1]: the record. Reply: {the value (nil: none), its PEXPIRETIME}, read at once.
return { redis.call('GET', KEYS[1]), redis.call('PEXPIRETIME', KEYS[1]) }
