-- Whole records (after record.lua): reading and writing them. A value that is not one is
-- IDEMCORRUPT: a string not in this layout is "not an idem record", a value of another
-- type "holds a Redis <type>" (read() in record.lua).

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

-- The record at key, or nil if there is none or it expired at now. Anything else there is
-- an IDEMCORRUPT error.
local function load(key, now)
  local v = read(key)
  if not v then return nil end
  local rec = parse(key, v)
  if not rec then corrupt(key, 'not an idem record') end
  rec.x = redis.call('PEXPIRETIME', key) + 1
  if rec.x <= 0 then corrupt(key, 'no expiry') end
  if rec.s == 'P' then rec.l = rec.x - rec.w end
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

-- Raises IDEMCORRUPT unless v is an idem record: for the fencing scripts, where a record
-- that does not start with the lease's prefix is fenced only if it is one.
local function check(key, v)
  if not parse(key, v) then corrupt(key, 'not an idem record') end
end
