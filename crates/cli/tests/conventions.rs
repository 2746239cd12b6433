//! What a user of kubectl, temporal or restate expects of a command line: completions for
//! their shell, `--json` where a command reports, a wrong value refused with the right ones
//! listed, plain text in a log file, and tokens they can list.

use crate::common;

use std::time::Duration;

use common::{Fleet, fresh_store, rein, stderr, stdout, token_with};

fn code_of(out: &std::process::Output) -> i32 {
    out.status.code().unwrap_or(-1)
}
use serde_json::Value;

fn json_of(out: &std::process::Output) -> Value {
    serde_json::from_str(&stdout(out))
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", stdout(out)))
}

#[test]
fn completions_cover_every_command_in_bash_zsh_and_fish() {
    for (shell, marker) in [
        ("bash", "complete -F _rein"),
        ("zsh", "#compdef rein"),
        ("fish", "complete -c rein"),
    ] {
        let out = rein(&["completions", shell]);
        assert_eq!(code_of(&out), 0, "{shell}: {}", stderr(&out));
        let script = stdout(&out);
        assert!(script.contains(marker), "{shell} script lacks `{marker}`");
        for command in ["enqueue", "approvals", "tokens", "completions", "why"] {
            assert!(script.contains(command), "{shell} script lacks `{command}`");
        }
        assert!(script.contains("--database-url"), "{shell} lacks flags");
    }
    // The bash script is valid bash.
    let out = rein(&["completions", "bash"]);
    let path = common::tmp_dir("completions").join("rein.bash");
    std::fs::write(&path, out.stdout).unwrap();
    let check = std::process::Command::new("bash")
        .arg("-n")
        .arg(&path)
        .output()
        .expect("run bash -n");
    assert!(check.status.success(), "{}", stderr(&check));

    let out = rein(&["completions", "tcsh"]);
    assert_eq!(code_of(&out), 1, "an unknown shell is a usage error");
    for shell in ["bash", "zsh", "fish"] {
        assert!(stderr(&out).contains(shell), "{}", stderr(&out));
    }
}

#[test]
fn an_unknown_status_is_refused_with_the_valid_ones_listed() {
    let out = rein(&[
        "runs",
        "list",
        "--status",
        "waiting",
        "--database-url",
        "postgres://nobody@127.0.0.1:1/none",
    ]);
    assert_eq!(code_of(&out), 1, "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("waiting"), "{err}");
    for status in ["runnable", "parked", "needs_operator", "terminal"] {
        assert!(err.contains(status), "`{status}` not listed: {err}");
    }
}

#[test]
fn definitions_check_reports_as_json_with_the_same_exit_code() {
    let root = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../definitions/refund-agent.toml"
    );
    let out = rein(&["definitions", "check", root, "--json"]);
    assert_eq!(code_of(&out), 0, "{}", stderr(&out));
    let v = json_of(&out);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["name"], "refund-agent");
    assert!(v["states"].as_u64().unwrap_or(0) >= 5, "{v}");
    assert!(v["warnings"].is_array(), "{v}");

    let bad = common::tmp_dir("check_json").join("bad.toml");
    std::fs::write(
        &bad,
        "name = \"bad\"\nversion = 1\nevents = [\"GO\"]\n[[states]]\nname = \"A\"\nkind = \"active\"\n",
    )
    .unwrap();
    let out = rein(&["definitions", "check", bad.to_str().unwrap(), "--json"]);
    assert_eq!(code_of(&out), 1, "{}", stdout(&out));
    let v = json_of(&out);
    assert_eq!(v["ok"], false, "{v}");
    let problems = v["problems"].as_array().expect("problems");
    assert!(!problems.is_empty(), "{v}");
    assert!(
        problems
            .iter()
            .all(|p| p["item"].is_string() && p["reason"].is_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_list_shows_live_tokens_and_never_a_secret() {
    let (url, _store) = fresh_store("conv_tokens").await;
    let reader = token_with(&url, "dashboards", &["read"], &[]);
    let tenant = token_with(
        &url,
        "tenant-a",
        &["enqueue", "read"],
        &["--queue", "tenant-a", "--max-in-flight", "5"],
    );
    let listed = rein(&["tokens", "list", "--database-url", &url, "--json"]);
    assert_eq!(code_of(&listed), 0, "{}", stderr(&listed));
    let all = json_of(&listed);
    let all = all.as_array().expect("an array");
    assert_eq!(all.len(), 2, "{all:?}");
    let a = all
        .iter()
        .find(|t| t["subject"] == "tenant-a")
        .expect("tenant-a");
    assert_eq!(a["queues"], serde_json::json!(["tenant-a"]));
    assert_eq!(a["in_flight_max"], 5);
    assert_eq!(a["scopes"], serde_json::json!(["enqueue", "read"]));
    assert!(a["revoked_at"].is_null());

    // Revoked: gone from the default list, shown with --revoked.
    let id = all.iter().find(|t| t["subject"] == "dashboards").unwrap()["token_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let out = rein(&["tokens", "revoke", "--database-url", &url, &id]);
    assert_eq!(code_of(&out), 0, "{}", stderr(&out));
    let live = json_of(&rein(&["tokens", "list", "--database-url", &url, "--json"]));
    assert_eq!(live.as_array().map(Vec::len), Some(1), "{live}");
    let with_revoked = rein(&[
        "tokens",
        "list",
        "--database-url",
        &url,
        "--revoked",
        "--json",
    ]);
    let with_revoked = json_of(&with_revoked);
    let gone = with_revoked
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["token_id"] == id.as_str())
        .expect("the revoked token");
    assert!(gone["revoked_at"].is_string(), "{gone}");

    // The table, and neither form ever holds a secret or a hash.
    let table = rein(&["tokens", "list", "--database-url", &url, "--revoked"]);
    assert_eq!(code_of(&table), 0);
    let text = stdout(&table);
    assert!(
        text.contains("tenant-a") && text.contains("queues tenant-a"),
        "{text}"
    );
    for shown in [text, with_revoked.to_string()] {
        for secret in [&reader, &tenant] {
            assert!(!shown.contains(secret.as_str()), "a secret is shown");
        }
        assert!(!shown.contains("hash"), "a hash is shown: {shown}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_into_a_file_carry_no_colour_codes() {
    let (url, _store) = fresh_store("conv_ansi").await;
    let mut fleet = Fleet::new(&url, "conv_ansi");
    fleet.spawn_env("w1", &["worker"], &[("REIN_LOG_FORMAT", "text")]);
    let log = fleet.log_dir.join("w1.err");
    common::wait_for(
        "the worker's first log line",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || {
            let log = log.clone();
            async move {
                std::fs::read_to_string(&log)
                    .map(|t| t.contains("INFO"))
                    .unwrap_or(false)
            }
        },
    )
    .await;
    fleet.terminate("w1", Duration::from_secs(30));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        !text.contains('\u{1b}'),
        "ANSI escapes in a log file:\n{text}"
    );
    assert!(
        !text.starts_with('{'),
        "text was asked for, not JSON:\n{text}"
    );
}
