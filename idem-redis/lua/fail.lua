-- machine::fail. KEYS[1]: the record. ARGV: token, owner, error, permanent ("1" or "0"),
-- retention (ms). Reply: 1 done, 0 fenced.
local now = now_ms()
local rec = held(now)
if not rec then return 0 end
rec.s, rec.l, rec.e, rec.k = 'f', nil, ARGV[3], ARGV[4] == '1'
rec.x = now + tonumber(ARGV[5])
save(KEYS[1], rec)
return 1
