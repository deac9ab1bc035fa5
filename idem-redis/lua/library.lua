-- The end of the idem library: registers its functions. The backend loads one library
-- (FUNCTION LOAD REPLACE): a first line `#!lua name=<LIB>` and `local LIB = '<LIB>'`, then
-- record.lua, load.lua, claim.lua, settle.lua, extend.lua, get.lua and this file. The
-- helpers are defined once, when the library loads; a call runs only its function.
-- LIB is idem_v2_ and a hash of those files (see src/library.rs), so two versions of idem
-- on one server load two libraries and never replace each other's functions.
redis.register_function(LIB .. '_claim', claim)
redis.register_function(LIB .. '_settle', settle)
redis.register_function(LIB .. '_extend', extend)
redis.register_function{
  function_name = LIB .. '_get', callback = get, flags = { 'no-writes' },
}
