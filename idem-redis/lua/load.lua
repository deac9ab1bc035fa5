-- Whole records (after record.lua): reading this layout and the first one, writing this
-- one. The first layout, read only:
--
--   <s><t>,<n>,<l>,<x>,<k>,<#o>,<#f>,<#r>,<#e>;<o><f><r><e>
--
-- s state (p processing, c completed, f failed), t token, n attempts, l lease_until (ms,
-- empty: none), x expires_at (ms), k permanent (0 or 1), then the byte lengths of o owner,
-- f fingerprint (0: none, or 32), r response and e error (empty: none), then those bytes.

local V1_HEADER = '^([pcf])(%d+),(%d+),(%d*),(%d+),([01]),(%d+),(%d+),(%d*),(%d*);()'

-- The record v holds in the first layout, with its state in upper case.
local function load_v1(key, v)
  local s, t, n, l, x, k, lo, lf, lr, le, at = string.match(v, V1_HEADER)
  if not s then corrupt(key, 'not an idem record') end
  lo, lf, lr, le = num(key, lo), num(key, lf), num(key, lr, true), num(key, le, true)
  if lf ~= 0 and lf ~= 32 then corrupt(key, 'bad fingerprint length') end
  if at - 1 + lo + lf + (lr or 0) + (le or 0) ~= #v then corrupt(key, 'bad length') end
  local rec = { s = string.upper(s), t = num(key, t), n = num(key, n), l = num(key, l, true),
                x = num(key, x), k = k == '1' }
  rec.o = string.sub(v, at, at + lo - 1)
  at = at + lo
  if lf == 32 then rec.f = string.sub(v, at, at + 31) end
  at = at + lf
  if lr then rec.r = string.sub(v, at, at + lr - 1); at = at + lr end
  if le then rec.e = string.sub(v, at, at + le - 1) end
  return rec
end

-- The fields of a record in this layout (deadlines not included), or nil if v is not one.
local function parse(key, v)
  local s, t, lo, at = string.match(v, '^([PCF])(%d+):(%d+):()')
  if not s then return nil end
  lo = num(key, lo)
  local rec = { s = s, t = num(key, t), o = string.sub(v, at, at + lo - 1) }
  at = at + lo
  if at > #v then corrupt(key, 'bad length') end
  local flag_at = at
  at = after_fingerprint(key, v, at)
  if at == flag_at + 33 then rec.f = string.sub(v, flag_at + 1, flag_at + 32) end
  local n, w, body = string.match(v, '^(%d+):(%d+);()', at)
  if not n then corrupt(key, 'not an idem record') end
  rec.n, rec.w = num(key, n), num(key, w)
  if s == 'C' then
    rec.r = string.sub(v, body)
  elseif s == 'F' then
    local k = string.sub(v, body, body)
    if k ~= '0' and k ~= '1' then corrupt(key, 'bad permanent flag') end
    rec.k = k == '1'
    rec.e = string.sub(v, body + 1)
  elseif body <= #v then
    corrupt(key, 'bad length')
  end
  return rec
end

-- The record at key, or nil if there is none or it expired at now. A value of another type
-- is a WRONGTYPE error, a string that does not decode an IDEMCORRUPT one.
local function load(key, now)
  local v = redis.call('GET', key)
  if not v then return nil end
  local rec = parse(key, v)
  if rec then
    rec.x = redis.call('PEXPIRETIME', key) + 1
    if rec.x <= 0 then corrupt(key, 'no expiry') end
    if rec.s == 'P' then rec.l = rec.x - rec.w end
  else
    rec = load_v1(key, v)
  end
  if now >= rec.x then return nil end
  return rec
end

-- Replaces the record at key with rec (in this layout) and sets its expiry to rec.x.
local function save(key, rec, now)
  local w = 0
  if rec.s == 'P' then w = rec.x - rec.l end
  local v = string.format('%s%d:%d:', rec.s, rec.t, #rec.o) .. rec.o
  if rec.f then v = v .. '#' .. rec.f else v = v .. '-' end
  v = v .. string.format('%d:%d;', rec.n, w)
  if rec.s == 'C' then
    v = v .. (rec.r or '')
  elseif rec.s == 'F' then
    v = v .. (rec.k and '1' or '0') .. (rec.e or '')
  end
  put(key, v, rec.x - now)
end

-- Raises IDEMCORRUPT unless v is an idem record in either layout: for the fencing scripts,
-- where a record that does not start with the lease's prefix is fenced only if it is one.
local function check(key, v)
  if not parse(key, v) then load_v1(key, v) end
end
