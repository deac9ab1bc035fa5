-- machine::fail. KEYS[1]: the record. ARGV: token, owner, error, permanent ("1" or "0"),
-- retention (ms). Reply: 1 done, 0 fenced.
local now = now_ms()
local key = KEYS[1]
local rec = load(key, now)
if not holds(rec, tonumber(ARGV[1]), ARGV[2]) then return 0 end
rec.s = 'f'
rec.l = nil
rec.e = ARGV[3]
rec.k = ARGV[4] == '1'
rec.x = now + tonumber(ARGV[5])
save(key, rec)
return 1
