//! Operator commands: inspect, list, release, delete, purge, migrate.

use idem_core::Timestamp;
use idem_core::backend::ListFilter;
use idem_core::backend::machine;
use idem_core::{ClaimKind, Error as CoreError, FailureKind, Key, Lease, Record, State};

use crate::cli::{
    ChangeArgs, ChangeKeyArgs, InspectArgs, KeyArgs, ListArgs, ReleaseArgs, StateArg,
};
use crate::confirm::confirm;
use crate::error::{Error, Result, StoreContext};
use crate::show::{RecordView, record_text, records_table};
use crate::target::Target;
use idem_once::backend::driver::{Options, Store};

pub(crate) async fn open(url: &str) -> Result<(Target, Box<dyn Store>)> {
    let target = Target::parse(url)?;
    let store = target.connect(&Options::new()).await?;
    Ok((target, store))
}

fn key_of(args: &KeyArgs) -> Result<Key> {
    Key::new(args.namespace.clone(), args.id.clone()).map_err(|e| Error::Usage(e.to_string()))
}

async fn read(store: &dyn Store, key: &Key) -> Result<Option<Record>> {
    store.backend().get(key).await.store(format!("read {key}"))
}

pub(crate) fn print_json(value: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::Refused(format!("encode JSON: {e}")))?;
    out!("{text}");
    Ok(())
}

/// `idem inspect`: the record, readable. No record is [`Error::NotFound`] (exit 4), after
/// `null` with `--json`.
pub async fn inspect(args: &InspectArgs) -> Result<()> {
    let key = key_of(&args.key)?;
    let (_, store) = open(&args.key.backend.backend).await?;
    let record = read(store.as_ref(), &key).await?;
    let now = Timestamp::now();
    match (record, args.json) {
        (Some(r), false) => out!("{}", record_text(&r, now)),
        (Some(r), true) => print_json(&RecordView::new(&r, now))?,
        (None, json) => {
            if json {
                out!("null");
            }
            return Err(Error::not_found(&key, ""));
        }
    }
    Ok(())
}

/// `idem list`: records passing the filter; `--stuck` keeps lapsed leases only. Entries the
/// store skipped as not idem records are counted after the table (on stderr with `--json`).
pub async fn list(args: &ListArgs) -> Result<()> {
    if args.stuck && args.state.is_some_and(|s| s != StateArg::Processing) {
        return Err(Error::Usage(
            "--stuck lists processing records; it cannot go with another --state".into(),
        ));
    }
    if args.poisoned && args.state.is_some() {
        return Err(Error::Usage(
            "--poisoned picks failed and lapsed records itself; it cannot go with --state".into(),
        ));
    }
    let (target, store) = open(&args.backend.backend).await?;
    let backend = store.backend();
    if !backend.capabilities().list {
        return Err(Error::Refused(format!(
            "the {} backend cannot list records (it has no way to enumerate keys); use `idem inspect <namespace> <id>`",
            target.kind()
        )));
    }
    // --stuck and --poisoned filter here, so the store lists every record of the state;
    // otherwise it is asked for one more than the limit, to tell a cut listing.
    let here = args.stuck || args.poisoned;
    let filter = ListFilter {
        namespace: args.namespace.clone(),
        state: if args.stuck {
            Some(State::Processing)
        } else if args.poisoned {
            None
        } else {
            args.state.map(State::from)
        },
        limit: if here || args.limit == 0 {
            0
        } else {
            args.limit.saturating_add(1)
        },
    };
    let listing = backend.list(&filter).await.store("list records")?;
    let skipped = listing.skipped.first().map(|first| {
        let (n, plural) = (listing.skipped_total, listing.skipped_total != 1);
        let (entries, are, records) = if plural {
            ("entries", "are", "idem records")
        } else {
            ("entry", "is", "an idem record")
        };
        let place = if target.kind() == "redis" {
            "under the key prefix"
        } else {
            "in the table"
        };
        let (key, why) = (&first.key, &first.reason);
        format!("skipped {n} {entries} {place} that {are} not {records} (first: {key:?}: {why})")
    });
    let mut records = listing.records;
    let now = Timestamp::now();
    if args.stuck {
        records.retain(|r| !machine::lease_is_live(r, now));
    }
    if args.poisoned {
        records.retain(|r| machine::is_poisoned(r, args.max_attempts, now));
    }
    records.sort_by(|a, b| a.key.cmp(&b.key));
    let cut = args.limit > 0 && records.len() > args.limit;
    if cut {
        records.truncate(args.limit);
    }
    let more = "more match: raise --limit (0 lists all)";
    if args.json {
        if cut {
            eprintln!("idem: {} record(s) shown; {more}", records.len());
        }
        let views: Vec<RecordView> = records.iter().map(|r| RecordView::new(r, now)).collect();
        print_json(&views)?;
        if let Some(line) = skipped {
            eprintln!("idem: {line}");
        }
        return Ok(());
    }
    if records.is_empty() {
        out!("no records match");
    } else {
        out!("{}", records_table(&records, now));
        if cut {
            out!("{} record(s) shown; {more}", records.len());
        } else {
            out!("{} record(s)", records.len());
        }
    }
    if let Some(line) = skipped {
        out!("{line}");
    }
    Ok(())
}

/// `idem release`: a `Processing` record becomes a retryable `Failed` one, through
/// `fail` with the record's own token and owner, so that if the record moved on since it
/// was read (completed, taken over), nothing changes.
pub async fn release(args: &ReleaseArgs) -> Result<()> {
    let key_args = &args.target.key;
    let key = key_of(key_args)?;
    let (_, store) = open(&key_args.backend.backend).await?;
    let Some(record) = read(store.as_ref(), &key).await? else {
        return Err(Error::not_found(&key, ": nothing to release"));
    };
    let now = Timestamp::now();
    if record.state != State::Processing {
        return Err(Error::Refused(format!(
            "{key} is {}, not processing: nothing to release",
            record.state.as_str()
        )));
    }
    if machine::lease_is_live(&record, now) && !args.force {
        return Err(Error::Refused(format!(
            "the lease on {key} is live (owner {}, until {}): its worker may still be running; wait for it to lapse, or pass --force to let another worker run it now",
            record.owner,
            crate::show::when(record.lease_until.unwrap_or(now), now)
        )));
    }
    out!("{}", record_text(&record, now));
    confirm(
        &format!(
            "release {key} (token {}, owner {})",
            record.token, record.owner
        ),
        args.target.yes.yes,
    )?;
    let lease = Lease {
        key: key.clone(),
        owner: record.owner.clone(),
        token: record.token,
        attempts: record.attempts,
        lease_until: record.lease_until.unwrap_or(now),
        kind: ClaimKind::Takeover,
        fingerprint: record.fingerprint,
    };
    let backend = store.backend();
    match backend
        .fail(&lease, &args.reason, FailureKind::Retry, args.retention)
        .await
    {
        Ok(()) => {
            out!(
                "released {key}: now failed and retryable; the next claim runs attempt {} if the consumer allows that many",
                record.attempts.saturating_add(1)
            );
            Ok(())
        }
        Err(CoreError::Fenced { token, .. }) => Err(Error::Refused(format!(
            "{key} changed after it was read (token {token} no longer holds the record): nothing released"
        ))),
        Err(e) => Err(e).store(format!("release {key}")),
    }
}

/// `idem delete`: removes one record, whatever its state.
pub async fn delete(args: &ChangeKeyArgs) -> Result<()> {
    let key = key_of(&args.key)?;
    let (_, store) = open(&args.key.backend.backend).await?;
    let Some(record) = read(store.as_ref(), &key).await? else {
        return Err(Error::not_found(&key, ": nothing to delete"));
    };
    out!("{}", record_text(&record, Timestamp::now()));
    confirm(
        &format!("delete {key} (a later delivery of its message runs the handler again)"),
        args.yes.yes,
    )?;
    let existed = store
        .backend()
        .delete(&key)
        .await
        .store(format!("delete {key}"))?;
    if !existed {
        // Gone between the read and the delete (deleted or expired meanwhile).
        return Err(Error::not_found(&key, ": nothing to delete"));
    }
    out!("deleted {key}");
    Ok(())
}

/// `idem purge`: drops expired records.
pub async fn purge(args: &ChangeArgs) -> Result<()> {
    let (target, store) = open(&args.backend.backend).await?;
    confirm(
        &format!("purge expired records from {target}"),
        args.yes.yes,
    )?;
    let backend = store.backend();
    let n = backend.purge_expired().await.store("purge")?;
    let native = if backend.capabilities().native_expiry {
        " (this store also expires records by itself)"
    } else {
        ""
    };
    out!("purged {n} expired record(s){native}");
    Ok(())
}

/// `idem migrate`: PostgreSQL migrations or the DynamoDB table.
pub async fn migrate(args: &ChangeArgs) -> Result<()> {
    let (target, store) = open(&args.backend.backend).await?;
    confirm(&format!("migrate {target}"), args.yes.yes)?;
    out!("{}", store.migrate().await.store("migrate")?);
    Ok(())
}
