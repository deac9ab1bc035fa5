-- Shared by every idem script (the backend puts it in front of each one): the server's
-- clock, and reading and writing one record.
--
-- A record is one hash. Fields: s state (p processing, c completed, f failed), o owner,
-- t token, n attempts, l lease_until (ms), x expires_at (ms), f fingerprint (32 bytes),
-- r response, e error, k permanent ("1"). Absent optional fields mean "none".
-- The key expires natively one millisecond before x, so Redis drops it exactly when
-- idem_core::machine::is_live turns false.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function corrupt(key, why)
  error({ err = 'IDEMCORRUPT ' .. key .. ': ' .. why })
end

local KNOWN = { s = 1, o = 1, t = 1, n = 1, l = 1, x = 1, f = 1, r = 1, e = 1, k = 1 }

-- A decimal field as a number: at most 15 digits, so it is exact in a Lua number.
local function uint(key, name, text, required)
  if text == nil then
    if required then corrupt(key, 'missing field ' .. name) end
    return nil
  end
  if #text > 15 or not string.match(text, '^%d+$') then
    corrupt(key, 'field ' .. name .. ' is not a number')
  end
  return tonumber(text)
end

-- The record at key, or nil if there is none or it expired at now. Anything that does not
-- decode is an IDEMCORRUPT error (a foreign type is WRONGTYPE), raised before any write.
local function load(key, now)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local h = {}
  for i = 1, #flat, 2 do
    if KNOWN[flat[i]] == nil then corrupt(key, 'unknown field') end
    h[flat[i]] = flat[i + 1]
  end
  if h.s ~= 'p' and h.s ~= 'c' and h.s ~= 'f' then corrupt(key, 'bad state') end
  if h.o == nil then corrupt(key, 'missing field o') end
  if h.f ~= nil and #h.f ~= 32 then corrupt(key, 'bad fingerprint') end
  if h.k ~= nil and h.k ~= '1' then corrupt(key, 'bad permanent flag') end
  local rec = {
    s = h.s, o = h.o, f = h.f, r = h.r, e = h.e, k = h.k == '1',
    t = uint(key, 't', h.t, true),
    n = uint(key, 'n', h.n, true),
    l = uint(key, 'l', h.l, false),
    x = uint(key, 'x', h.x, true),
  }
  if now >= rec.x then return nil end
  return rec
end

-- Replaces the record at key with rec and sets its expiry.
local function save(key, rec)
  local a = { 's', rec.s, 'o', rec.o, 't', rec.t, 'n', rec.n, 'x', rec.x }
  if rec.l ~= nil then a[#a + 1] = 'l'; a[#a + 1] = rec.l end
  if rec.f ~= nil then a[#a + 1] = 'f'; a[#a + 1] = rec.f end
  if rec.r ~= nil then a[#a + 1] = 'r'; a[#a + 1] = rec.r end
  if rec.e ~= nil then a[#a + 1] = 'e'; a[#a + 1] = rec.e end
  if rec.k then a[#a + 1] = 'k'; a[#a + 1] = '1' end
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(a))
  redis.call('PEXPIREAT', key, rec.x - 1)
end

-- machine::holds: the record is Processing with the lease's token and owner.
local function holds(rec, token, owner)
  return rec ~= nil and rec.s == 'p' and rec.t == token and rec.o == owner
end
