//! `rein blobs`: large payload values stored once by content hash (SPEC E5), read back by the
//! hash an event's `{"$blob": {"sha256": ...}}` reference names.

use std::path::PathBuf;

use rein_ops::Code;
use rein_process::{DbArgs, connect, exit};
use serde_json::{Value, json};

use crate::print::{fail, print_json};
use crate::remote::{Backend, Conn};

#[derive(clap::Subcommand)]
pub enum BlobsCommand {
    /// Print the value stored under a hash (checked against it). Through the API a token
    /// sees it only when a run it may read refers to it.
    Get(GetArgs),
    /// How many blobs are stored and their bytes (on the database).
    Stats(StatsArgs),
}

#[derive(clap::Args)]
pub struct GetArgs {
    #[command(flatten)]
    conn: Conn,
    /// The blob's sha256: 64 lowercase hex digits.
    sha256: String,
    /// Print `{sha256, bytes, value}` as one JSON object instead of the value alone.
    #[arg(long)]
    json: bool,
    /// Write the value (pretty JSON; with --json the whole object) to this file instead of
    /// printing it.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Print the totals as one JSON object.
    #[arg(long)]
    json: bool,
}

pub async fn blobs(cmd: BlobsCommand) -> u8 {
    match cmd {
        BlobsCommand::Get(args) => get(args).await,
        BlobsCommand::Stats(args) => stats(args).await,
    }
}

async fn get(args: GetArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let view = match backend.blob(&args.sha256).await {
        Ok(view) => view,
        Err(e) if e.code == Code::NotFound => {
            eprintln!(
                "error: {} (a blob's hash is in the event that refers to it: `rein runs history RUN`)",
                e.message
            );
            return exit::INPUT;
        }
        Err(e) => return fail(&e),
    };
    let shown: &Value = if args.json { &view } else { &view["value"] };
    match &args.out {
        Some(path) => {
            let text = serde_json::to_string_pretty(shown).unwrap_or_default() + "\n";
            if let Err(e) = std::fs::write(path, text) {
                eprintln!("error: cannot write {}: {e}", path.display());
                return exit::INPUT;
            }
            eprintln!(
                "wrote blob {} ({} bytes) to {}",
                view["sha256"].as_str().unwrap_or(""),
                view["bytes"],
                path.display()
            );
        }
        None if args.json => print_json(shown),
        None => println!(
            "{}",
            serde_json::to_string_pretty(shown).unwrap_or_default()
        ),
    }
    exit::OK
}

async fn stats(args: StatsArgs) -> u8 {
    rein_process::init_logging_at(false, "warn,sqlx=error");
    let store = match connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match rein_ops::service::blob_stats(&store).await {
        Ok(s) if args.json => {
            print_json(&json!(s));
            exit::OK
        }
        Ok(s) => {
            println!("blobs        {}\nstored bytes {}", s.blobs, s.stored_bytes);
            if s.refs_to_review > 0 {
                println!(
                    "to review    {} references recorded before commits recorded them, to blobs \
                     another queue's runs refer to too (a forged reply's would be among them): \
                     SELECT * FROM rein_blob_refs_to_review",
                    s.refs_to_review
                );
            }
            exit::OK
        }
        Err(e) => fail(&e),
    }
}
