//! `rein demo` as a new user runs it: its summary adds up, and the database it drove holds no
//! broken invariant.

use crate::common;

use common::{rein, stderr, stdout};
use serde_json::Value;

fn summary_of(out: &std::process::Output) -> Value {
    assert_eq!(out.status.code(), Some(0), "{}", stderr(out));
    serde_json::from_str(&stdout(out)).unwrap_or_else(|e| panic!("{e}: {}", stdout(out)))
}

/// The runs of the real agent (`support-agent`, a model node) the demo adds to `--runs`.
const MODEL_AGENT_RUNS: i64 = 2;

/// The model agent's runs talked to the stand-in model (no REIN_MODEL_URL in the tests),
/// chose their tools, waited for the approver on the refund over 100, and ended done.
fn assert_the_model_agent_finished(summary: &Value) {
    let agent = &summary["model_agent"];
    assert_eq!(agent["stand_in"], true, "{agent}");
    let runs = agent["runs"].as_array().expect("the model agent's runs");
    assert_eq!(runs.len() as i64, MODEL_AGENT_RUNS, "{agent}");
    for run in runs {
        assert_eq!(run["state"], "DONE", "{run}");
        assert!(run["tokens"].as_u64() > Some(0), "usage is recorded: {run}");
        let log = run["log"].as_array().expect("its log");
        let chose: Vec<&str> = log
            .iter()
            .filter_map(|l| l["model_chose"].as_str())
            .collect();
        assert_eq!(chose.first(), Some(&"lookup_order"), "{run}");
        assert_eq!(chose.last(), Some(&"FINISH"), "{run}");
        let approved = log.iter().any(|l| l["type"] == "APPROVED");
        assert_eq!(
            approved,
            run["input"]["amount"].as_f64() > Some(100.0),
            "only the refund over 100 waits for a person: {run}"
        );
    }
}

fn assert_adds_up(summary: &Value, workload: i64) {
    let runs = workload + MODEL_AGENT_RUNS;
    assert_eq!(summary["runs"], runs, "{summary}");
    assert_the_model_agent_finished(summary);
    let by_state: i64 = summary["runs_by_final_state"]
        .as_object()
        .expect("runs_by_final_state")
        .values()
        .map(|v| v.as_i64().expect("a count"))
        .sum();
    assert_eq!(
        by_state, runs,
        "every run ends in some final state: {summary}"
    );
    assert_eq!(summary["replay_mismatches"], 0, "{summary}");
    assert_eq!(
        summary["cancelled"], 1,
        "the demo cancels one run: {summary}"
    );
    assert!(summary["events"].as_i64() > Some(runs), "{summary}");
    assert!(summary["retries"].as_i64() > Some(0), "{summary}");
    assert!(
        summary["api"]["url"]
            .as_str()
            .is_some_and(|u| u.starts_with("http://127.0.0.1:"))
            && summary["api"]["token"]
                .as_str()
                .is_some_and(|t| t.starts_with("rein_")),
        "the demo serves the API with a token: {summary}"
    );
    let approvals = &summary["approvals"];
    assert!(
        approvals["granted"].as_i64() > Some(0) && approvals["denied"].as_i64() > Some(0),
        "{summary}"
    );
    assert!(
        approvals["expired"].as_i64() > Some(0),
        "some approvals are left to time out through the scheduler: {summary}"
    );
}

/// The first README command, as written: no DATABASE_URL, so a private server is started.
#[test]
fn demo_on_its_own_private_postgres_adds_up() {
    let out = rein(&["demo", "--runs", "40", "--json"]);
    assert_adds_up(&summary_of(&out), 40);
    assert!(
        stderr(&out).contains("starting a private PostgreSQL"),
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_against_a_given_database_leaves_no_broken_invariant() {
    let url = common::fresh_database("demo");
    let out = rein(&["demo", "--runs", "60", "--json", "--database-url", &url]);
    let summary = summary_of(&out);
    assert_adds_up(&summary, 60);
    let store = rein_store::Store::connect(&url, 2).await.expect("connect");
    let report = store.audit().await.expect("audit");
    assert_eq!(report.runs, 60 + MODEL_AGENT_RUNS);
    assert_eq!(report.violations(), 0, "{report:?}");
    assert_eq!(
        summary["fenced_writes_rejected"], report.fenced_writes_rejected,
        "the summary reports the database's own count"
    );
}
