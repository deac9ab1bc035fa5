-- The helpers every idem function shares (the first part of the library, see
-- library.lua), defined once when the library loads: the server's clock, and reading and
-- writing one record.
--
-- A record is one string whose front is fixed: state, token and owner, so that the fencing
-- scripts check a prefix instead of decoding it. No deadline is stored: the key's
-- server-side expiry (PEXPIRETIME) is the record's, and a Processing record carries the
-- retention w that follows its lease, so its lease ends at PEXPIRETIME + 1 - w.
--
--   <S><t>:<#o>:<o><F><n>:<w>;<body>
--
-- S state (P processing, C completed, F failed), t token, #o the owner's byte length, o the
-- owner, F the fingerprint ('-' none, or '#' and its 32 bytes), n attempts, w retention
-- after the lease (ms); body: C the response, F '0' or '1' (permanent) and the error text,
-- P nothing. Redis drops a key at the first millisecond past its PEXPIRETIME, so a record
-- live until x (idem_core::machine::is_live) has PEXPIRETIME x - 1.
--
-- load.lua follows it: whole records.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Raises IDEMCORRUPT for the value at key, which is not an idem record. Redis appends
-- where the error was raised (` script: <function>, on @user_function:<line>.`), which
-- the client strips (src/error.rs).
local function corrupt(key, why)
  error({ err = 'IDEMCORRUPT ' .. key .. ': ' .. why })
end

-- The string at key, or false if there is none. A value of another type is IDEMCORRUPT
-- saying which type, not the WRONGTYPE a plain GET raises.
local function read(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    if string.sub(v.err, 1, 9) ~= 'WRONGTYPE' then error(v) end
    corrupt(key, 'holds a Redis ' .. redis.call('TYPE', key).ok .. ', not an idem record')
  end
  return v
end

-- A decimal of at most 15 digits (exact in a Lua number); '' is nil when optional.
local function num(key, text, optional)
  if text == '' and optional then return nil end
  if #text > 15 then corrupt(key, 'a number is too long') end
  return tonumber(text)
end

-- Writes value at key, live for ms more milliseconds (gone at once if ms < 2: a key
-- expires one millisecond after its PEXPIRETIME, and PX takes at least 1).
local function put(key, value, ms)
  if ms >= 2 then
    redis.call('SET', key, value, 'PX', ms - 1)
  else
    redis.call('DEL', key)
  end
end

-- Where the attempts field starts in v, a record whose first `at - 1` bytes are its fencing
-- prefix (the fingerprint flag is at `at`).
local function after_fingerprint(key, v, at)
  local flag = string.byte(v, at)
  if flag == 45 then return at + 1 end -- '-'
  if flag == 35 and #v >= at + 32 then return at + 33 end -- '#'
  corrupt(key, 'bad fingerprint')
end
