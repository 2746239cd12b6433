//! `rein retention archive`: moves the event logs of runs that finished long ago out of the
//! hot table (SPEC L2), in batches of whole runs, with progress and a summary; `rein
//! retention detach` moves whole months of them by moving their partition.

use std::time::Instant;

use rein_store::{ARCHIVE_BATCH_MAX, ArchivedBatch, EventsTableSize};
use serde_json::{Value, json};

use rein_process::{DbArgs, connect, exit, report};

use crate::print::print_json;

/// Longest `--older-than` accepted: a hundred years.
const OLDER_THAN_MS_MAX: u64 = 100 * 365 * 24 * 3_600_000;

#[derive(clap::Subcommand)]
pub enum RetentionCommand {
    /// Move the events of terminal runs that finished more than DURATION ago into
    /// rein_events_archive, whole runs per transaction; their history, `runs verify` and
    /// `why` keep working. Run it as the schema owner.
    Archive(ArchiveArgs),
    /// Move whole months: each month partition of rein_events whose runs all ended more than
    /// DURATION ago is detached and attached to rein_events_archive, catalog changes instead
    /// of moving rows; their history, `runs verify` and `why` keep working. A month with a
    /// run still going (or ended since the cutoff) stays, and the command names one such run.
    /// Run it as the schema owner.
    Detach(DetachArgs),
}

#[derive(clap::Args)]
pub struct DetachArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Move months whose runs all finished longer ago than this, by the database clock: a
    /// number and a unit, ms, s, m, h, d or w (e.g. 30d).
    #[arg(long, value_parser = parse_duration_ms)]
    older_than: u64,
    /// List the months and what holds each back; move nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct ArchiveArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Archive runs finished longer ago than this, by the database clock: a number and a
    /// unit, ms, s, m, h, d or w (e.g. 30d, 12h).
    #[arg(long, value_parser = parse_duration_ms)]
    older_than: u64,
    /// Runs moved per transaction.
    #[arg(long, default_value_t = 500,
          value_parser = clap::value_parser!(i64).range(1..=ARCHIVE_BATCH_MAX))]
    batch: i64,
    /// Count what would be archived; move nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Milliseconds of a duration like `30d`, `12h`, `90m`, `45s` or `500ms`.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("`{text}` has no unit: write e.g. 30d, 12h, 90m, 45s or 500ms"))?;
    let (number, unit) = text.split_at(split);
    if number.is_empty() || number.len() > 12 {
        return Err(format!(
            "`{text}` must start with a whole number (at most 12 digits), e.g. 30d"
        ));
    }
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{number}` is not a whole number"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "w" => 7 * 86_400_000,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}`: use ms, s, m, h, d or w"
            ));
        }
    };
    match n.checked_mul(unit_ms) {
        Some(0) => Err("the duration must be longer than 0".to_owned()),
        Some(ms) if ms <= OLDER_THAN_MS_MAX => Ok(ms),
        _ => Err(format!("`{text}` is longer than 100 years")),
    }
}

pub async fn retention(cmd: RetentionCommand) -> u8 {
    match cmd {
        RetentionCommand::Archive(args) => archive(args).await,
        RetentionCommand::Detach(args) => detach(args).await,
    }
}

async fn detach(args: DetachArgs) -> u8 {
    let started = Instant::now();
    let (store, cutoff) = match open(&args.db, args.older_than).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let months = match store.month_candidates(cutoff).await {
        Ok(m) => m,
        Err(e) => return fail(&e),
    };
    let mut moved = Vec::new();
    let mut held = Vec::new();
    for month in &months {
        if month.unfinished > 0 {
            held.push(month);
            continue;
        }
        if args.dry_run {
            continue;
        }
        if !args.json {
            eprintln!(
                "moving {} ({} runs, {} bytes) to the archive ...",
                month.name, month.runs, month.bytes
            );
        }
        match store.archive_month(&month.name, cutoff).await {
            Ok(m) => {
                if !args.json {
                    println!(
                        "moved {}: {} runs, {} bytes in {:.3} s, {} bytes of WAL",
                        m.name, m.runs, m.bytes, m.seconds, m.wal_bytes
                    );
                }
                moved.push(m);
            }
            Err(e) => {
                eprintln!(
                    "{} months moved before this one failed; each month moves whole or not at all, so running the command again continues",
                    moved.len()
                );
                return fail(&e);
            }
        }
    }
    let summary = json!({
        "dry_run": args.dry_run,
        "older_than_ms": args.older_than,
        "cutoff": cutoff,
        "months": months,
        "moved": moved,
        "elapsed_ms": started.elapsed().as_millis() as u64,
    });
    if args.json {
        print_json(&summary);
        return exit::OK;
    }
    let when = crate::print::short_time(summary["cutoff"].as_str().unwrap_or(""));
    if months.is_empty() {
        println!(
            "no month of rein_events was created entirely before {when}: nothing to move (`rein retention archive` moves single runs)"
        );
    }
    for month in &months {
        if month.unfinished > 0 {
            println!(
                "{} stays: {} of its {} runs have not ended before {when}, e.g. {} (`rein why {}`)",
                month.name,
                month.unfinished,
                month.runs,
                month.example.map(|u| u.to_string()).unwrap_or_default(),
                month.example.map(|u| u.to_string()).unwrap_or_default(),
            );
        } else if args.dry_run {
            println!(
                "dry run: {} would move ({} runs, {} bytes); nothing moved",
                month.name, month.runs, month.bytes
            );
        }
    }
    if !held.is_empty() && !args.dry_run {
        println!(
            "{} months stay until their runs end; run this again then",
            held.len()
        );
    }
    exit::OK
}

/// The store and the cutoff `older_than_ms` before the database clock.
async fn open(
    db: &DbArgs,
    older_than_ms: u64,
) -> Result<(rein_store::Store, chrono::DateTime<chrono::Utc>), u8> {
    let store = connect(db, false).await?;
    match store.archive_cutoff(older_than_ms).await {
        Ok(cutoff) => Ok((store, cutoff)),
        Err(e) => Err(report(&e)),
    }
}

async fn archive(args: ArchiveArgs) -> u8 {
    let started = Instant::now();
    let (store, cutoff) = match open(&args.db, args.older_than).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let prepared = async {
        let candidates = store.archive_candidates(cutoff).await?;
        let before = store.events_table_size().await?;
        Ok::<_, rein_store::StoreError>((candidates, before))
    };
    let (candidates, before) = match prepared.await {
        Ok(p) => p,
        Err(e) => return report(&e),
    };
    let mut total = ArchivedBatch::default();
    let mut batches = 0u64;
    if !args.dry_run {
        let progress = rein_lab::progress_bar(
            candidates.runs as u64,
            "{elapsed:>4} [{bar:30}] {pos}/{len} runs archived, {msg}",
        );
        // Each batch takes at least one run or ends the loop; runs finishing meanwhile are
        // after the cutoff, so this bounds the loop (one more batch to see nothing is left).
        let batches_max = (candidates.runs as u64).div_ceil(args.batch as u64) + 1;
        while batches < batches_max {
            let moved = match store.archive_batch(cutoff, args.batch).await {
                Ok(m) => m,
                Err(e) => {
                    progress.abandon();
                    eprintln!(
                        "archived {} runs ({} events) before the failure; each batch is all or nothing, so running the command again continues where it stopped",
                        total.runs, total.events
                    );
                    return fail(&e);
                }
            };
            batches += 1;
            if moved.runs == 0 {
                break;
            }
            total.runs += moved.runs;
            total.events += moved.events;
            total.checkpoints += moved.checkpoints;
            progress.inc(moved.runs as u64);
            progress.set_message(format!("{} events moved", total.events));
        }
        progress.finish_and_clear();
    }
    let after = match store.events_table_size().await {
        Ok(a) => a,
        Err(e) => return report(&e),
    };
    let summary = json!({
        "dry_run": args.dry_run,
        "older_than_ms": args.older_than,
        "cutoff": cutoff,
        "batch": args.batch,
        "batches": batches,
        "candidates": candidates,
        "runs_archived": total.runs,
        "events_moved": total.events,
        "checkpoints_dropped": total.checkpoints,
        "hot_events_before": before,
        "hot_events_after": after,
        "elapsed_ms": started.elapsed().as_millis() as u64,
    });
    if args.json {
        print_json(&summary);
    } else {
        say(&summary, before, after);
    }
    exit::OK
}

fn fail(e: &rein_store::StoreError) -> u8 {
    if e.is_permission_denied() {
        eprintln!(
            "error: {e}\nthis database user may not move events: run `rein retention archive` as the schema owner (rein_owner)"
        );
        return exit::DATABASE;
    }
    report(e)
}

fn say(summary: &Value, before: EventsTableSize, after: EventsTableSize) {
    let n = |key: &str| summary[key].as_i64().unwrap_or(0);
    if summary["dry_run"] == true {
        println!(
            "dry run: {} runs finished before {} would be archived ({} events); nothing moved",
            summary["candidates"]["runs"],
            crate::print::short_time(summary["cutoff"].as_str().unwrap_or("")),
            summary["candidates"]["events"],
        );
    } else {
        println!(
            "archived {} runs finished before {}: {} events moved in {} batches, {} checkpoints dropped",
            n("runs_archived"),
            crate::print::short_time(summary["cutoff"].as_str().unwrap_or("")),
            n("events_moved"),
            n("batches"),
            n("checkpoints_dropped"),
        );
    }
    println!(
        "rein_events: {} rows, {} bytes before; {} rows, {} bytes after (space is reused by new events after VACUUM; VACUUM FULL gives it back to the system)",
        before.rows, before.bytes, after.rows, after.bytes
    );
}

#[cfg(test)]
mod tests {
    use super::parse_duration_ms;

    #[test]
    fn durations_need_a_number_and_a_known_unit() {
        assert_eq!(parse_duration_ms("30d"), Ok(30 * 86_400_000));
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("2w"), Ok(14 * 86_400_000));
        for bad in [
            "30",
            "d",
            "",
            "0s",
            "3y",
            "1.5h",
            "-1d",
            "99999999999999d",
            "101000d",
        ] {
            assert!(parse_duration_ms(bad).is_err(), "{bad} must be refused");
        }
    }
}
