//! `rein brief RUN`: the resume brief a model would be given to pick the run up (SPEC D3):
//! task, steps done with their results (or references), the pending step, the last error.

use rein_core::brief::{BriefValue, ResumeBrief};
use rein_ops::Code;
use rein_process::exit;
use uuid::Uuid;

use crate::print::fail;
use crate::remote::{Backend, Conn};

#[derive(clap::Args)]
pub struct BriefArgs {
    #[command(flatten)]
    conn: Conn,
    run: Uuid,
    /// The brief as canonical JSON (sorted keys), exactly what handlers and http nodes get.
    #[arg(long)]
    json: bool,
}

pub async fn brief(args: BriefArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let view = match backend.brief(args.run).await {
        Ok(view) => view,
        Err(e) if e.code == Code::NotFound => {
            eprintln!(
                "error: run {} not found (`rein runs list` shows the runs there are)",
                args.run
            );
            return exit::INPUT;
        }
        Err(e) => return fail(&e),
    };
    // The brief follows the log; what was not trusted is said, apart from the brief.
    for w in &view.warnings {
        eprintln!("warning: {w}; this brief was rebuilt from the log");
    }
    if args.json {
        println!("{}", view.brief.to_canonical_json());
    } else {
        print!("{}", human(&view.brief));
    }
    exit::OK
}

fn value(v: &BriefValue) -> String {
    match v {
        BriefValue::Inline(v) => rein_core::hash::canonical_json(v),
        BriefValue::Reference { sha256, bytes } => format!("({bytes} bytes, sha256 {sha256})"),
    }
}

fn human(b: &ResumeBrief) -> String {
    let mut out = format!(
        "run       {}@v{} in {} ({}), sequence {}\ntask      {}\n",
        b.definition,
        b.version,
        b.state,
        b.status,
        b.sequence,
        value(&b.task)
    );
    out.push_str(&format!("done      {} step(s)", b.steps_completed));
    if b.steps_omitted > 0 {
        out.push_str(&format!(", {} older result(s) not listed", b.steps_omitted));
    }
    out.push('\n');
    for s in &b.steps_done {
        let step = s.step.map_or("-".to_owned(), |n| n.to_string());
        let node = s.node.as_deref().unwrap_or("-");
        out.push_str(&format!("  step {step} at {node}: {}\n", value(&s.result)));
    }
    match &b.pending {
        Some(p) => out.push_str(&format!(
            "pending   step {} at {} ({}, attempt {}){}\n",
            p.step,
            p.node,
            p.status,
            p.attempt,
            p.tool
                .as_deref()
                .map(|t| format!(", tool {t}"))
                .unwrap_or_default()
        )),
        None => out.push_str("pending   nothing\n"),
    }
    if let Some(e) = &b.last_error {
        out.push_str(&format!("error     {}\n", value(e)));
    }
    if let Some(reason) = &b.terminal_reason {
        out.push_str(&format!("ended     {reason}\n"));
    }
    out
}
