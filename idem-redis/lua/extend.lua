-- machine::extend. KEYS[1]: the record. ARGV: token, owner, ttl (ms).
-- Reply: the new lease_until (ms), or -1 if fenced.
local now = now_ms()
local rec = held(now)
if not rec then return -1 end
-- The expiry keeps its distance past the lease's end (zero if it was before it).
local keep = math.max(rec.x - (rec.l or now), 0)
rec.l = now + tonumber(ARGV[3])
rec.x = rec.l + keep
save(KEYS[1], rec)
return rec.l
