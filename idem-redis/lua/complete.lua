-- machine::complete. KEYS[1]: the record. ARGV: token, owner, response, retention (ms).
-- Reply: 1 done, 0 fenced.
local now = now_ms()
local key = KEYS[1]
local rec = load(key, now)
if not holds(rec, tonumber(ARGV[1]), ARGV[2]) then return 0 end
rec.s = 'c'
rec.l = nil
rec.r = ARGV[3]
rec.e = nil
rec.x = now + tonumber(ARGV[4])
save(key, rec)
return 1
