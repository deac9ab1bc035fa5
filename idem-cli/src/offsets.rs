//! `idem offsets show|reset`: the consumer offsets transactional mode stores beside the
//! records, in PostgreSQL or MySQL.

use std::sync::Arc;

use comfy_table::Table;
use comfy_table::presets::UTF8_FULL_CONDENSED;
use idem_core::Offsets;
use idem_core::backend::StoredOffset;
use serde::Serialize;

use crate::cli::{OffsetsArgs, OffsetsCommand, OffsetsResetArgs, OffsetsShowArgs};
use crate::confirm::confirm;
use crate::error::{Error, Result, StoreContext};
use crate::ops::{open, print_json};

/// `idem offsets`.
pub async fn run(args: &OffsetsArgs) -> Result<()> {
    match &args.command {
        OffsetsCommand::Show(a) => show(a).await,
        OffsetsCommand::Reset(a) => reset(a).await,
    }
}

/// The store's offsets, or a refusal naming the stores that keep them.
async fn offsets_of(url: &str) -> Result<Arc<dyn Offsets>> {
    let (target, store) = open(url).await?;
    store.offsets().ok_or_else(|| {
        Error::Refused(format!(
            "the {} backend keeps no consumer offsets: transactional mode, and its offsets, are PostgreSQL's and MySQL's",
            target.kind()
        ))
    })
}

/// One stored offset, as `--json` prints it.
#[derive(Serialize)]
struct OffsetView<'a> {
    topic: &'a str,
    partition: i32,
    next_offset: i64,
}

async fn show(args: &OffsetsShowArgs) -> Result<()> {
    let offsets = offsets_of(&args.backend.backend).await?;
    let stored = offsets
        .offsets(&args.group)
        .await
        .store(format!("read the offsets of group {:?}", args.group))?;
    if args.json {
        let views: Vec<OffsetView<'_>> = stored
            .iter()
            .map(|s| OffsetView {
                topic: &s.topic,
                partition: s.partition,
                next_offset: s.next_offset,
            })
            .collect();
        return print_json(&views);
    }
    if stored.is_empty() {
        out!(
            "no offsets stored for group {:?}: its consumers start from the offsets committed to Kafka",
            args.group
        );
    } else {
        out!("{}", table(&stored));
    }
    Ok(())
}

fn table(stored: &[StoredOffset]) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_header(["topic", "partition", "next offset"]);
    for s in stored {
        t.add_row([
            s.topic.clone(),
            s.partition.to_string(),
            s.next_offset.to_string(),
        ]);
    }
    t.to_string()
}

async fn reset(args: &OffsetsResetArgs) -> Result<()> {
    let group = &args.group;
    if let Some(to) = args.to {
        let (Some(topic), Some(partition)) = (&args.topic, args.partition) else {
            return Err(Error::Usage(
                "--to moves one partition: name it with --topic and --partition".into(),
            ));
        };
        let offsets = offsets_of(&args.backend.backend).await?;
        confirm(
            &format!(
                "store {to} as group {group:?}'s next offset of {topic} partition {partition} (stop the group's consumers first)"
            ),
            args.yes.yes,
        )?;
        let next = StoredOffset {
            topic: topic.clone(),
            partition,
            next_offset: to,
        };
        offsets
            .set_offset(group, &next)
            .await
            .store(format!("store the offset of {topic} partition {partition}"))?;
        out!(
            "group {group:?} starts {topic} partition {partition} at offset {to} when next assigned it"
        );
        return Ok(());
    }
    if args.partition.is_some() && args.topic.is_none() {
        return Err(Error::Usage(
            "--partition needs --topic: a partition number is per topic".into(),
        ));
    }
    let offsets = offsets_of(&args.backend.backend).await?;
    let what = match (&args.topic, args.partition) {
        (Some(t), Some(p)) => format!("{t} partition {p}"),
        (Some(t), None) => format!("every partition of {t}"),
        _ => "every topic".to_owned(),
    };
    confirm(
        &format!(
            "delete group {group:?}'s stored offsets of {what} (its consumers then start from the offsets committed to Kafka)"
        ),
        args.yes.yes,
    )?;
    let removed = offsets
        .delete_offsets(group, args.topic.as_deref(), args.partition)
        .await
        .store(format!("delete the offsets of {what}"))?;
    out!("deleted {removed} stored offset(s) of group {group:?}");
    Ok(())
}
