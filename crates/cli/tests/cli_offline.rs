//! The offline commands, run as a user runs them: `rein definitions` and `rein replay`.

use crate::common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::{GREETER_TOML, GREETER_YAML, REIN, rein, stderr, stdout, tmp_dir};
use serde_json::Value;

const LIFECYCLE_FILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../definitions/lifecycle.toml"
);

const LIFECYCLE_TRANSITIONS: [(&str, &str, &str); 14] = [
    ("planned", "start", "running"),
    ("running", "pause_for_approval", "paused"),
    ("running", "block_on_dependency", "blocked"),
    ("running", "complete", "done"),
    ("running", "fatal_error", "failed"),
    ("running", "transient_error", "retrying"),
    ("paused", "approval_granted", "running"),
    ("paused", "approval_denied", "failed"),
    ("paused", "timeout", "failed"),
    ("blocked", "dependency_resolved", "running"),
    ("blocked", "fatal_error", "failed"),
    ("retrying", "retry", "running"),
    ("retrying", "max_retries_exceeded", "failed"),
    ("retrying", "fatal_error", "failed"),
];

fn write_tmp(name: &str, text: &str) -> String {
    let path = tmp_dir("cli-offline").join(name);
    std::fs::write(&path, text).expect("write a tmp file");
    path.to_string_lossy().into_owned()
}

#[test]
fn definitions_check_accepts_lifecycle_with_a_summary() {
    let out = rein(&["definitions", "check", LIFECYCLE_FILE]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let summary = stdout(&out);
    let version = rein_core::builtin::lifecycle().version();
    assert!(
        summary.starts_with(&format!("ok: lifecycle v{version}")),
        "{summary}"
    );
    assert!(
        summary.contains("7 states") && summary.contains("14 transitions"),
        "{summary}"
    );
}

#[test]
fn definitions_check_lists_every_problem_of_a_broken_file() {
    let file = write_tmp(
        "broken.toml",
        r#"
name = "broken"
version = 1
events = ["go", "stop"]

[[states]]
name = "a"
kind = "active"
initial = true

[[states]]
name = "b"
kind = "terminal"

[[states]]
name = "island"
kind = "active"

[[transitions]]
from = "a"
event = "go"
to = "nowhere"

[[transitions]]
from = "b"
event = "stop"
to = "a"

[[transitions]]
from = "a"
event = "jump"
to = "b"
"#,
    );
    let out = rein(&["definitions", "check", &file]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let err = stderr(&out);
    for item in ["nowhere", "jump", "island"] {
        assert!(err.contains(item), "no problem names `{item}`:\n{err}");
    }
    let listed = err.lines().filter(|l| l.starts_with("  ")).count();
    assert!(listed >= 4, "expected every problem listed:\n{err}");
}

fn checked(file: &str) -> Value {
    let out = rein(&["definitions", "check", file, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    serde_json::from_str(&stdout(&out)).expect("JSON")
}

#[test]
fn definitions_check_reads_yaml_as_the_same_definition_as_toml() {
    let toml = checked(&write_tmp("greeter.toml", GREETER_TOML));
    for name in ["greeter.yaml", "greeter.yml"] {
        let yaml = checked(&write_tmp(name, GREETER_YAML));
        assert_eq!(yaml["name"], "greeter");
        assert_eq!(yaml["transitions"], 2);
        assert_eq!(
            yaml["hash"], toml["hash"],
            "{name}: one definition, one hash"
        );
    }
    let out = rein(&[
        "definitions",
        "check",
        &write_tmp("greeter2.yaml", GREETER_YAML),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("ok: greeter v1"),
        "{}",
        stdout(&out)
    );

    // `show` reads YAML too, and prints the normalised document.
    let file = write_tmp("greeter3.yml", GREETER_YAML);
    let out = rein(&["definitions", "show", &file, "--format", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let spec: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(spec["states"][0]["name"], "GREET");
}

#[test]
fn definitions_check_names_the_line_of_malformed_yaml() {
    let broken = GREETER_YAML.replace(
        "  - {name: WAIT, kind: waiting}",
        "  - {name: WAIT, kind: waiting",
    );
    let out = rein(&["definitions", "check", &write_tmp("broken.yaml", &broken)]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(err.contains("YAML") && err.contains("line "), "{err}");
}

/// A YAML document whose anchor, a list of `items` scalars, is repeated by `levels` levels of
/// ten aliases each to the level below: `items * 10^levels` values once expanded.
fn alias_bomb(items: usize, levels: u32) -> String {
    let mut text = format!("name: bomb\nl0: &l0 [{}]\n", vec!["x"; items].join(","));
    for level in 1..=levels {
        let aliases = vec![format!("*l{}", level - 1); 10].join(",");
        text.push_str(&format!("l{level}: &l{level} [{aliases}]\n"));
    }
    text
}

/// 2 KB that YAML's aliases unfold into ten million strings is refused where the alias is
/// written, before anything is expanded: the check's peak memory stays that of any check.
#[test]
fn definitions_check_refuses_a_yaml_alias_bomb_without_expanding_it() {
    let bomb = alias_bomb(1000, 4);
    assert!(bomb.len() < 2300, "{} bytes", bomb.len());
    let file = write_tmp("bomb.yaml", &bomb);
    // The child's peak counts the pages of this test process it shared until its exec (the
    // spawn shares memory): that much is not the check's own.
    let shared_mb = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<i64>().ok())
        })
        .unwrap_or(0)
        / 1024;
    #[expect(
        clippy::zombie_processes,
        reason = "reaped by wait4 below, which also reports its peak RSS"
    )]
    let child = Command::new(REIN)
        .args(["definitions", "check", &file])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // wait4 reports this child's own peak RSS, whatever other tests spawn meanwhile.
    let (mut status, mut usage) = (0, unsafe { std::mem::zeroed::<libc::rusage>() });
    let pid = child.id() as libc::pid_t;
    assert_eq!(unsafe { libc::wait4(pid, &mut status, 0, &mut usage) }, pid);
    let peak_mb = usage.ru_maxrss / 1024;
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.unwrap(), &mut err).unwrap();
    println!(
        "rein definitions check of a {} byte alias bomb: peak RSS {peak_mb} MB ({shared_mb} MB \
         of it at most this test process's, shared until the exec)",
        bomb.len()
    );
    assert!(
        peak_mb < shared_mb + 100,
        "peak RSS {peak_mb} MB (this test process had {shared_mb} MB resident at the spawn): {err}"
    );
    assert_eq!(libc::WEXITSTATUS(status), 1, "{err}");
    assert!(
        err.contains("line 2 column 5") && err.contains("write the value out"),
        "{err}"
    );
}

#[test]
fn definitions_show_mermaid_has_every_lifecycle_transition() {
    let out = rein(&["definitions", "show", "lifecycle", "--format", "mermaid"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("stateDiagram-v2"), "{text}");
    for (from, event, to) in LIFECYCLE_TRANSITIONS {
        assert!(
            text.lines().any(|l| l.contains(from)
                && l.contains(event)
                && l.contains(to)
                && l.contains("-->")),
            "missing {from} --{event}--> {to}:\n{text}"
        );
    }
}

#[test]
fn definitions_show_json_parses() {
    let out = rein(&["definitions", "show", "lifecycle", "--format", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let spec: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(spec["name"], "lifecycle");
}

const GOOD_LOG: &str = r#"{"type": "start"}
{"type": "transient_error", "payload": {"error": {"class": "transient"}}}
{"type": "retry"}
{"type": "complete", "payload": {"result": 1}}
"#;

fn assert_replayed_to_done(out: &std::process::Output) {
    assert_eq!(out.status.code(), Some(0), "{}", stderr(out));
    let state: Value = serde_json::from_str(&stdout(out)).expect("JSON");
    assert_eq!(state["status"], "done", "{state}");
    assert_eq!(state["sequence"], 4, "{state}");
    assert_eq!(state["attempt"], 0, "{state}");
}

#[test]
fn replay_of_a_valid_log_prints_the_final_state() {
    let file = write_tmp("good.jsonl", GOOD_LOG);
    assert_replayed_to_done(&rein(&["replay", "--definition", "lifecycle", &file]));
}

#[test]
fn replay_of_a_rejected_event_exits_2_naming_its_line() {
    let file = write_tmp(
        "rejected.jsonl",
        "{\"type\": \"start\"}\n{\"type\": \"approval_granted\"}\n",
    );
    let out = rein(&["replay", "--definition", "lifecycle", &file]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));
}

#[test]
fn replay_of_an_invalid_json_line_exits_1() {
    let file = write_tmp("invalid.jsonl", "{\"type\": \"start\"}\n{not json\n");
    let out = rein(&["replay", "--definition", "lifecycle", &file]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));
}

#[test]
fn replay_reads_stdin_for_dash() {
    let mut child = Command::new(REIN)
        .args(["replay", "--definition", "lifecycle", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rein");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(GOOD_LOG.as_bytes())
        .expect("write stdin");
    assert_replayed_to_done(&child.wait_with_output().expect("wait"));
}

#[test]
fn output_to_a_closed_pipe_ends_the_command_quietly_like_any_unix_tool() {
    // `rein definitions list | head -1` once head has gone: no panic, no message, the
    // status a shell reports as 141.
    let out = common::rein_into_closed_pipe(&["definitions", "list"]);
    assert!(
        common::ended_by_sigpipe(&out),
        "{:?}: {}",
        out.status,
        stderr(&out)
    );
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
}

/// A bad `--http-allow` entry stops `rein worker` before it connects anywhere, saying what
/// to write instead.
#[test]
fn worker_refuses_a_bad_http_allow_entry_and_says_what_to_write() {
    for (entry, says) in [
        ("10.0.0.1/8", "write 10.0.0.0/8"),
        ("api.example.com:http", "is not a port"),
        ("", "an empty entry"),
    ] {
        let out = rein(&[
            "worker",
            "--database-url",
            "postgres://nobody@127.0.0.1:1/none",
            "--http-allow",
            entry,
        ]);
        assert_eq!(out.status.code(), Some(1), "{entry}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{entry}: {}", stderr(&out));
    }
}
