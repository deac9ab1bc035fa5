//! The Lua of every operation that is not a plain command (claim of a key with a record,
//! settle, extend, get), loaded as one Redis Functions library: its helpers
//! (`lua/record.lua`, `lua/load.lua`) are defined once when the library loads, and a call
//! (`FCALL`) runs only its own function.
//!
//! The library is loaded where a call finds it missing (`ERR Function not found`: a new
//! server, `FUNCTION FLUSH`, a restart without persistence, a failover to a replica that
//! lacks it, a node added to a cluster) with `FUNCTION LOAD REPLACE`, sent to every
//! primary of a cluster, and the call is sent again.
//!
//! Its name is `idem_v2_` and 16 hex digits of a hash of its sources, and so are its
//! functions' names (`<library>_settle`): two versions of idem on one server load two
//! libraries side by side, and neither replaces the other's functions. `v2` is the record
//! layout.

use idem_core::Result;
use redis::{Cmd, RedisError, Value};

use crate::RedisBackend;

/// The library's sources, in load order; `library.lua` registers the functions.
const SOURCES: [&str; 7] = [
    include_str!("../lua/record.lua"),
    include_str!("../lua/load.lua"),
    include_str!("../lua/claim.lua"),
    include_str!("../lua/settle.lua"),
    include_str!("../lua/extend.lua"),
    include_str!("../lua/get.lua"),
    include_str!("../lua/library.lua"),
];

/// The functions of the library.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Function {
    Claim,
    Settle,
    Extend,
    Get,
}

/// The library's name and source, and its functions' names.
pub(crate) struct Library {
    name: String,
    source: String,
    functions: [String; 4],
}

impl Library {
    pub(crate) fn new() -> Self {
        let body = SOURCES.join("\n");
        let name = format!("idem_v2_{:016x}", fnv1a(body.as_bytes()));
        let source = format!("#!lua name={name}\nlocal LIB = '{name}'\n{body}");
        let functions = ["claim", "settle", "extend", "get"].map(|f| format!("{name}_{f}"));
        Library {
            name,
            source,
            functions,
        }
    }

    /// The library's name, `idem_v2_<hash>`.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// `FCALL <function> <key count>`, for the caller to add the keys, then the arguments:
    /// `args` of them (keys included) and about `bytes` bytes, room for which is made at
    /// once, so the command does not grow as they are added.
    pub(crate) fn fcall(&self, function: Function, keys: usize, args: usize, bytes: usize) -> Cmd {
        let name = &self.functions[function as usize];
        let mut cmd = Cmd::with_capacity(3 + args, name.len() + 32 + bytes);
        cmd.arg("FCALL").arg(name).arg(keys);
        cmd
    }

    /// `FUNCTION LOAD REPLACE <source>`, for every primary of a cluster.
    fn load_cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg("REPLACE").arg(&self.source);
        cmd
    }
}

impl RedisBackend {
    /// Sends `cmd` (from [`Library::fcall`]); if the server has no such function, loads
    /// the library and sends it again. All of it within the configured timeout.
    pub(crate) async fn fcall(&self, what: &str, cmd: Cmd) -> Result<Value> {
        let mut conn = self.conn.clone();
        let library = &self.shared.library;
        let call = async move {
            match cmd.query_async::<Value>(&mut conn).await {
                Err(e) if function_not_found(&e) => {
                    conn.query_all_primaries(library.load_cmd()).await?;
                    cmd.query_async(&mut conn).await
                }
                other => other,
            }
        };
        self.call(what, call).await
    }
}

/// Whether `err` is the server's answer to `FCALL` of a function it does not have.
fn function_not_found(err: &RedisError) -> bool {
    err.code() == Some("ERR")
        && err
            .detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

/// FNV-1a, 64 bits: stable across builds and platforms, enough to tell sources apart.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_versioned_by_the_sources() {
        let lib = Library::new();
        assert!(lib.name().starts_with("idem_v2_"), "{}", lib.name());
        assert_eq!(lib.name().len(), "idem_v2_".len() + 16);
        assert!(
            lib.source
                .starts_with(&format!("#!lua name={}\n", lib.name()))
        );
        let cmd = lib.fcall(Function::Settle, 1, 0, 0);
        let args: Vec<_> = cmd.args_iter().collect();
        assert_eq!(args.len(), 3);
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
