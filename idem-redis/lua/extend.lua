-- machine::extend. KEYS[1]: the record. ARGV: token, owner, ttl (ms).
-- Reply: the new lease_until (ms), or -1 if fenced.
local now = now_ms()
local key = KEYS[1]
local rec = load(key, now)
if not holds(rec, tonumber(ARGV[1]), ARGV[2]) then return -1 end
local old_until = rec.l or now
local keep = rec.x - old_until
if keep < 0 then keep = 0 end
rec.l = now + tonumber(ARGV[3])
rec.x = rec.l + keep
save(key, rec)
return rec.l
