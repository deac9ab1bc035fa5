-- Shared by every idem script (the backend puts it in front of each one): the server's
-- clock, and reading and writing one record.
--
-- A record is one string, a short ASCII header and then the variable parts, so that one
-- GET reads it and one SET ... PXAT writes it and its expiry:
--
--   <s><t>,<n>,<l>,<x>,<k>,<#o>,<#f>,<#r>,<#e>;<o><f><r><e>
--
-- s state (p processing, c completed, f failed), t token, n attempts, l lease_until (ms,
-- empty: none), x expires_at (ms), k permanent (0 or 1), then the byte lengths of o owner,
-- f fingerprint (0: none, or 32), r response and e error (empty: none), then those bytes.
-- The key expires natively one millisecond before x, so Redis drops it exactly when
-- idem_core::machine::is_live turns false.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function corrupt(key, why)
  error({ err = 'IDEMCORRUPT ' .. key .. ': ' .. why })
end

local HEADER = '^([pcf])(%d+),(%d+),(%d*),(%d+),([01]),(%d+),(%d+),(%d*),(%d*);()'

-- A decimal of at most 15 digits (exact in a Lua number); '' is nil when optional.
local function num(key, text, optional)
  if text == '' and optional then return nil end
  if #text > 15 then corrupt(key, 'a number is too long') end
  return tonumber(text)
end

-- The record at key, or nil if there is none or it expired at now. A value of another type
-- is a WRONGTYPE error, a string that does not decode an IDEMCORRUPT one.
local function load(key, now)
  local v = redis.call('GET', key)
  if not v then return nil end
  local s, t, n, l, x, k, lo, lf, lr, le, at = string.match(v, HEADER)
  if not s then corrupt(key, 'not an idem record') end
  lo, lf, lr, le = num(key, lo), num(key, lf), num(key, lr, true), num(key, le, true)
  if lf ~= 0 and lf ~= 32 then corrupt(key, 'bad fingerprint length') end
  if at - 1 + lo + lf + (lr or 0) + (le or 0) ~= #v then corrupt(key, 'bad length') end
  local rec = { s = s, t = num(key, t), n = num(key, n), l = num(key, l, true),
                x = num(key, x), k = k == '1' }
  rec.o = string.sub(v, at, at + lo - 1)
  at = at + lo
  if lf == 32 then rec.f = string.sub(v, at, at + 31) end
  at = at + lf
  if lr then rec.r = string.sub(v, at, at + lr - 1); at = at + lr end
  if le then rec.e = string.sub(v, at, at + le - 1) end
  if now >= rec.x then return nil end
  return rec
end

-- Replaces the record at key with rec and sets its expiry.
local function save(key, rec)
  local f, r, e = rec.f or '', rec.r or '', rec.e or ''
  local head = string.format('%s%d,%d,%s,%d,%s,%d,%d,%s,%s;', rec.s, rec.t, rec.n,
    rec.l and string.format('%d', rec.l) or '', rec.x, rec.k and '1' or '0', #rec.o, #f,
    rec.r and tostring(#r) or '', rec.e and tostring(#e) or '')
  redis.call('SET', key, head .. rec.o .. f .. r .. e, 'PXAT', rec.x - 1)
end

-- machine::holds for the fencing scripts (KEYS[1] the record, ARGV[1] the lease's token,
-- ARGV[2] its owner): the record if it is Processing with that token and owner, else nil.
local function held(now)
  local rec = load(KEYS[1], now)
  if rec ~= nil and rec.s == 'p' and rec.t == tonumber(ARGV[1]) and rec.o == ARGV[2] then
    return rec
  end
  return nil
end
