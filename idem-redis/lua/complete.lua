-- machine::complete. KEYS[1]: the record. ARGV: token, owner, response, retention (ms).
-- Reply: 1 done, 0 fenced.
local now = now_ms()
local rec = held(now)
if not rec then return 0 end
rec.s, rec.l, rec.r, rec.e = 'c', nil, ARGV[3], nil
rec.x = now + tonumber(ARGV[4])
save(KEYS[1], rec)
return 1
