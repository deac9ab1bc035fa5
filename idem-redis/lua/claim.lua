-- machine::claim for every key in keys, in order (a key may appear more than once).
-- args: five per key: owner, lease ttl (ms), fingerprint (empty: none), max attempts,
-- retention (ms).
-- Reply: one array per key:
--   {1, token, attempts, lease_until, kind}  acquired; kind 0 first, 1 retry, 2 takeover
--   {2, response}                            completed
--   {3, owner, lease_until}                  in progress
--   {4, attempts, error}                     poisoned
--   {5}                                      mismatch

-- Grants claim c of key at now over prev (nil: none), writing the record into recs too.
local function grant(recs, now, prev, key, c, kind)
  local until_ms = now + c.ttl
  local rec = { s = 'P', o = c.owner, t = 1, n = 1, l = until_ms, x = until_ms + c.retention,
                f = c.fp, k = false }
  if prev then
    rec.t = prev.t + 1
    rec.n = prev.n + 1
    rec.f = prev.f
  end
  save(key, rec, now)
  recs[key] = rec
  -- The record's fingerprint too (empty for none): a retry keeps the stored one, and the
  -- lease names the record with it (a compare-and-set complete).
  return { 1, rec.t, rec.n, until_ms, kind, rec.f or '' }
end

-- The answer to claim c of key at now, given the records read so far (recs).
local function claim_one(recs, now, key, c)
  local rec = recs[key]
  if not rec then return grant(recs, now, nil, key, c, 0) end
  if rec.f ~= nil and c.fp ~= nil and rec.f ~= c.fp then return { 5 } end
  if rec.s == 'C' then return { 2, rec.r or '' } end
  if rec.s == 'F' then
    if rec.k or rec.n >= c.max then return { 4, rec.n, rec.e or '' } end
    return grant(recs, now, rec, key, c, 1)
  end
  if rec.l ~= nil and now < rec.l then return { 3, rec.o, rec.l } end
  if rec.n >= c.max then
    rec.s = 'F'
    rec.l = nil
    rec.e = 'lease lapsed during attempt ' .. rec.n
    rec.x = now + c.retention
    save(key, rec, now)
    return { 4, rec.n, rec.e }
  end
  return grant(recs, now, rec, key, c, 2)
end

local function claim(keys, args)
  local now = now_ms()
  -- Every record is read (and checked) before anything is written.
  local recs = {}
  for _, key in ipairs(keys) do
    if recs[key] == nil then recs[key] = load(key, now) or false end
  end
  local out = {}
  for i, key in ipairs(keys) do
    local b = (i - 1) * 5
    local fp = args[b + 3]
    if fp == '' then fp = nil end
    local max = tonumber(args[b + 4])
    if max < 1 then max = 1 end
    out[i] = claim_one(recs, now, key, {
      owner = args[b + 1], ttl = tonumber(args[b + 2]), fp = fp, max = max,
      retention = tonumber(args[b + 5]),
    })
  end
  return out
end
