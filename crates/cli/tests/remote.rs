//! The operator commands through `REIN_URL`/`REIN_TOKEN` against a real `rein api` process,
//! next to the same commands against the database: the `--json` output must be the same
//! document, and errors the same exit codes.

use crate::common;

use std::process::Output;

use common::{Fleet, rein, rein_with, stderr, stdout};
use rein_store::{ApprovalAsk, Store};
use serde_json::{Value, json};
use uuid::Uuid;

/// A database, `rein api` serving it, and an admin token.
struct Both {
    fleet: Fleet,
    url: String,
    base: String,
    token: String,
    store: Store,
}

impl Both {
    async fn start(prefix: &str) -> Both {
        let (url, store) = common::fresh_store(prefix).await;
        let mut fleet = Fleet::new(&url, prefix);
        let base = fleet.spawn_server("api", &["api", "--listen", "127.0.0.1:0"]);
        let token = common::token(&url, "ops-bot", &["admin"]);
        Both {
            fleet,
            url,
            base,
            token,
            store,
        }
    }

    /// `rein ARGS` against the database.
    fn db(&self, args: &[&str]) -> Output {
        rein_with(args, &[("DATABASE_URL", &self.url)])
    }

    /// `rein ARGS` through the API with the admin token.
    fn api(&self, args: &[&str]) -> Output {
        self.api_as(&self.token, args)
    }

    fn api_as(&self, token: &str, args: &[&str]) -> Output {
        rein_with(args, &[("REIN_URL", &self.base), ("REIN_TOKEN", token)])
    }

    /// A new research-agent run, enqueued from the database.
    fn new_run(&self) -> String {
        let out = self.db(&["enqueue", "--definition", "research-agent", "--json"]);
        json_ok(&out, "db")["run_id"].as_str().unwrap().to_owned()
    }

    /// `rein ARGS --json` both ways; both must succeed. Returns (database, API).
    fn both_json(&self, args: &[&str]) -> (Value, Value) {
        let mut args = args.to_vec();
        args.push("--json");
        (
            json_ok(&self.db(&args), "database"),
            json_ok(&self.api(&args), "api"),
        )
    }
}

fn json_ok(out: &Output, route: &str) -> Value {
    assert_eq!(out.status.code(), Some(0), "{route}: {}", stderr(out));
    serde_json::from_str(stdout(out).trim())
        .unwrap_or_else(|e| panic!("{route}: not one JSON document ({e}): {}", stdout(out)))
}

/// The document without what moves with the clock between two reads: ages and countdowns
/// (`*_ms`), the database's `now` and heartbeats.
fn steady(v: &Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| !k.ends_with("_ms") && *k != "db_now" && *k != "heartbeat_at")
                .map(|(k, v)| (k.clone(), steady(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(steady).collect()),
        other => other.clone(),
    }
}

/// Moves a research-agent run in PLANNING to WAITING_APPROVAL and opens a request for it.
async fn open_request(store: &Store, run: Uuid) -> Uuid {
    common::as_the_engine(store, run, &["PLAN_READY", "APPROVAL_REQUIRED"]).await;
    store
        .request_approval(ApprovalAsk {
            run_id: run,
            node: "ACTING",
            tool: "refund",
            args: &json!({"order_id": "R1", "amount": 420}),
            action_hash: "h-remote",
            risk: "high",
            expires_after_ms: 3_600_000,
        })
        .await
        .unwrap()
        .approval_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operator_command_prints_the_same_json_through_the_api_as_from_the_database() {
    let mut both = Both::start("remote_same").await;
    // A worker on a queue nobody uses, so `workers` has a member to show.
    both.fleet
        .spawn("idle-worker", &["worker", "--queue", "nothing-here"]);

    // definitions: register through the API, again from the database (the same body).
    let spec = json_ok(
        &rein(&["definitions", "show", "lifecycle", "--format", "json"]),
        "show",
    );
    let mut spec = spec;
    spec["name"] = json!("lifecycle-copy");
    let file = common::tmp_dir("remote_same_defs").join("lifecycle-copy.json");
    std::fs::write(&file, spec.to_string()).unwrap();
    let file = file.to_str().unwrap();
    let by_api = json_ok(
        &both.api(&["definitions", "register", file, "--json"]),
        "api",
    );
    assert_eq!(
        by_api,
        json!({"name": "lifecycle-copy", "version": spec["version"], "created": true,
               "current_version": spec["version"]})
    );
    let by_db = json_ok(&both.db(&["definitions", "register", file, "--json"]), "db");
    assert_eq!(
        by_db["created"], false,
        "the same body again changes nothing"
    );
    let (db, api) = both.both_json(&["definitions", "list", "--registered"]);
    assert_eq!(db, api);
    assert!(
        db.as_array()
            .unwrap()
            .iter()
            .any(|d| d["name"] == "lifecycle-copy"),
        "{db}"
    );
    let show = [
        "definitions",
        "show",
        "lifecycle-copy",
        "--registered",
        "--format",
        "json",
    ];
    let (db_out, api_out) = (both.db(&show), both.api(&show));
    assert_eq!(stdout(&db_out), stdout(&api_out));
    assert_eq!(json_ok(&api_out, "api")["name"], "lifecycle-copy");

    // enqueue: the same key again is the same run; the key is the caller's, so the same key
    // on the database (the CLI's own) is another run.
    let keyed = [
        "enqueue",
        "--definition",
        "research-agent",
        "--key",
        "order-77",
        "--json",
    ];
    let first = json_ok(&both.api(&keyed), "api");
    assert_eq!(first["created"], true, "{first}");
    let again = json_ok(&both.api(&keyed), "api");
    assert_eq!(again["run_id"], first["run_id"]);
    assert_eq!(again["created"], false);
    let own = json_ok(&both.db(&keyed), "db");
    assert_ne!(own["run_id"], first["run_id"]);
    assert_eq!(own["created"], true);
    let run = first["run_id"].as_str().unwrap().to_owned();

    // send: the user's reply, applied through the API, recorded with the token's subject.
    let run_id: Uuid = run.parse().unwrap();
    common::as_the_engine(&both.store, run_id, &["NEED_CLARIFICATION"]).await;
    let sent = json_ok(&both.api(&["send", &run, "USER_REPLY", "--json"]), "api");
    assert_eq!(
        sent,
        json!({"outcome": "applied", "sequence": 2, "inbox_id": null})
    );
    let approval = open_request(&both.store, run_id).await;

    for args in [
        vec!["runs", "show", run.as_str()],
        vec!["runs", "history", run.as_str()],
        vec!["runs", "list", "--definition", "research-agent"],
        vec!["approvals", "list"],
        vec!["approvals", "list", "--all", "--run", run.as_str()],
    ] {
        let (db, api) = both.both_json(&args);
        assert_eq!(db, api, "rein {}", args.join(" "));
    }
    let history = both.both_json(&["runs", "history", &run]).0;
    assert_eq!(history[1]["worker"], "api:ops-bot", "{history}");
    assert_eq!(history[1]["sender"], "api:ops-bot", "{history}");
    assert_eq!(
        history[0]["sender"],
        Value::Null,
        "the engine's own: {history}"
    );
    // Human output is rendered from the same document, so it is the same text too.
    for args in [
        vec!["runs", "show", run.as_str()],
        vec!["runs", "history", run.as_str()],
        vec!["runs", "list", "--definition", "research-agent"],
    ] {
        let (db, api) = (both.db(&args), both.api(&args));
        assert_eq!(stdout(&db), stdout(&api), "rein {}", args.join(" "));
    }

    // why: the same diagnosis, apart from what the clock moves.
    let (db, api) = both.both_json(&["why", &run]);
    assert_eq!(steady(&db), steady(&api));
    assert_eq!(db["state"], "WAITING_APPROVAL");
    let said = stdout(&both.api(&["why", &run]));
    assert!(
        said.contains("waiting for: a person to decide approval"),
        "{said}"
    );

    // workers: the idle worker, both ways.
    common::wait_for(
        "the idle worker's heartbeat",
        std::time::Duration::from_secs(30),
        std::time::Duration::from_millis(200),
        || async {
            let out = both.api(&["workers", "--json"]);
            stdout(&out).contains("idle-worker")
        },
    )
    .await;
    let (db, api) = both.both_json(&["workers"]);
    assert_eq!(steady(&db), steady(&api));

    // approve through the API: the token's subject decides, and the run got its event.
    let approval = approval.to_string();
    let decided = json_ok(
        &both.api(&["approve", &approval, "--comment", "checked", "--json"]),
        "api",
    );
    assert_eq!(decided["status"], "granted", "{decided}");
    assert_eq!(decided["decided_by"], "ops-bot");
    assert_eq!(decided["delivery"]["outcome"], "applied", "{decided}");
    assert!(decided["delivery"]["event"].is_string(), "{decided}");
    let human = stdout(&both.db(&["runs", "show", &run]));
    assert!(
        human.contains(decided["delivery"]["state"].as_str().unwrap()),
        "{human}"
    );

    // cancel through the API, rerun both ways.
    let other = both.new_run();
    let cancelled = json_ok(
        &both.api(&["cancel", &other, "--reason", "duplicate order", "--json"]),
        "api",
    );
    assert_eq!(cancelled["outcome"], "applied", "{cancelled}");
    let (db, api) = both.both_json(&["rerun", &other]);
    assert_eq!(db["parent_run_id"], other);
    assert_eq!(api["parent_run_id"], other);
    assert_ne!(db["run_id"], api["run_id"], "each rerun is a new run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_exit_with_the_same_codes_through_the_api_as_from_the_database() {
    let both = Both::start("remote_fail").await;
    let unknown = Uuid::now_v7().to_string();
    for args in [
        vec!["runs", "show", unknown.as_str()],
        vec!["runs", "history", unknown.as_str()],
        vec!["why", unknown.as_str()],
        vec!["rerun", unknown.as_str()],
        vec!["approve", unknown.as_str(), "--as", "alice"],
        vec!["enqueue", "--definition", "no-such-definition"],
        vec!["runs", "list", "--cursor", "zz"],
    ] {
        let (db, api) = (both.db(&args), both.api(&args));
        assert_eq!(
            db.status.code(),
            Some(1),
            "db: rein {}: {}",
            args.join(" "),
            stderr(&db)
        );
        assert_eq!(
            api.status.code(),
            Some(1),
            "api: rein {}: {}",
            args.join(" "),
            stderr(&api)
        );
    }

    // A refused transition exits 2 both ways, naming the state and event.
    let run = both.new_run();
    common::as_the_engine(&both.store, run.parse().unwrap(), &["NEED_CLARIFICATION"]).await;
    let out = both.db(&["send", &run, "USER_CANCELLED"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    for out in [
        both.db(&["send", &run, "USER_REPLY"]),
        both.api(&["send", &run, "USER_REPLY"]),
    ] {
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains("USER_REPLY in state CANCELLED"), "{err}");
    }
    // So does an event only the engine writes, with its own reason.
    for out in [
        both.db(&["send", &run, "TASK_ACCEPTED"]),
        both.api(&["send", &run, "TASK_ACCEPTED"]),
    ] {
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("TASK_ACCEPTED is not accepted from an outside caller"),
            "{err}"
        );
    }

    // An invalid definition lists every problem both ways, exit 1.
    let bad = common::tmp_dir("remote_fail_defs").join("bad.toml");
    std::fs::write(
        &bad,
        "name = \"bad\"\nversion = 1\nstates = []\nevents = []\ntransitions = []\n",
    )
    .unwrap();
    let bad = bad.to_str().unwrap();
    let (db, api) = (
        both.db(&["definitions", "register", bad]),
        both.api(&["definitions", "register", bad]),
    );
    assert_eq!(db.status.code(), Some(1), "{}", stderr(&db));
    assert_eq!(api.status.code(), Some(1), "{}", stderr(&api));
    assert_eq!(stderr(&db), stderr(&api));
    assert!(stderr(&api).contains("initial"), "{}", stderr(&api));

    // Authentication: no token, a revoked-looking token, a token without the scope: exit 4.
    let reader = common::token(&both.url, "reader", &["read"]);
    for (token, args) in [
        ("", vec!["runs", "list"]),
        ("rein_not_a_real_token", vec!["runs", "list"]),
        (
            reader.as_str(),
            vec!["cancel", run.as_str(), "--reason", "x"],
        ),
    ] {
        let out = both.api_as(token, &args);
        assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    }
    let out = both.api_as(&reader, &["cancel", &run, "--reason", "x"]);
    assert!(
        stderr(&out).contains("operate"),
        "names the scope: {}",
        stderr(&out)
    );
    let out = both.api_as("", &["runs", "list"]);
    assert!(stderr(&out).contains("REIN_TOKEN"), "{}", stderr(&out));

    // Nothing listening: exit 3 with what to check. A URL that is not http(s): exit 1.
    let out = rein_with(
        &["runs", "list"],
        &[
            ("REIN_URL", "http://127.0.0.1:9"),
            ("REIN_TOKEN", &both.token),
        ],
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot reach the Rein API"),
        "{}",
        stderr(&out)
    );
    let out = rein_with(&["runs", "list"], &[("REIN_URL", "ftp://example.com")]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("http://"), "{}", stderr(&out));
}

/// `rein brief`, `rein runs verify`, `rein resolve` and `rein limits` have a second door:
/// through `REIN_URL` they print what they print from the database (and Redis), and refuse
/// with the same exit codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brief_verify_resolve_and_limits_answer_the_same_through_the_api() {
    let redis =
        common::PrivateRedis::start(common::free_port(), &common::tmp_dir("remote_doors_redis"));
    let (url, store) = common::fresh_store("remote_doors").await;
    let mut fleet = Fleet::new(&url, "remote_doors");
    let base = fleet.spawn_server(
        "api",
        &[
            "api",
            "--listen",
            "127.0.0.1:0",
            "--redis-url",
            &redis.url(),
        ],
    );
    let both = Both {
        fleet,
        url,
        base,
        token: String::new(),
        store,
    };
    let both = Both {
        token: common::token(&both.url, "ops-bot", &["admin"]),
        ..both
    };
    let run = both.new_run();

    // The brief: the same canonical JSON either way.
    let (db, api) = (
        both.db(&["brief", &run, "--json"]),
        both.api(&["brief", &run, "--json"]),
    );
    assert_eq!(db.status.code(), Some(0), "{}", stderr(&db));
    assert_eq!(api.status.code(), Some(0), "{}", stderr(&api));
    assert_eq!(stdout(&db), stdout(&api), "the brief through the API");
    assert!(stdout(&api).contains("\"task\""), "{}", stdout(&api));
    let human = both.api(&["brief", &run]);
    assert_eq!(human.status.code(), Some(0), "{}", stderr(&human));

    // Verify: the same verdict, and a mismatch exits 2 either way.
    let (db, api) = both.both_json(&["runs", "verify", &run]);
    assert_eq!(db, api);
    assert_eq!(api["ok"], json!(true), "{api}");
    sqlx::query("UPDATE rein_runs SET projection = jsonb_set(projection, '{attempt}', '99') WHERE run_id = $1")
        .bind(run.parse::<Uuid>().unwrap())
        .execute(both.store.pool())
        .await
        .expect("plant a projection that the log does not replay to");
    for out in [
        both.db(&["runs", "verify", &run]),
        both.api(&["runs", "verify", &run]),
    ] {
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains("integrity error"), "{}", stderr(&out));
    }

    // Resolve: a run with no open call is refused (2); `applied` without its result event
    // is bad input (1); a read-only token may not (4).
    let resolve = |event: Option<&str>| {
        let mut args = vec!["resolve", run.as_str(), "applied", "--as", "ops"];
        if let Some(e) = event {
            args.extend(["--event", e]);
        }
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let args = resolve(Some("TOOL_SUCCEEDED"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    for out in [both.db(&args), both.api(&args)] {
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains("no open call"), "{}", stderr(&out));
    }
    let no_event = resolve(None);
    let no_event: Vec<&str> = no_event.iter().map(String::as_str).collect();
    for out in [both.db(&no_event), both.api(&no_event)] {
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(stderr(&out).contains("--event"), "{}", stderr(&out));
    }
    let reader = common::token(&both.url, "reader", &["read"]);
    let out = both.api_as(&reader, &args);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));

    // Limits: what Redis holds, the same through the API's Redis as read directly.
    let direct = rein_with(&["limits", "--json", "--redis-url", &redis.url()], &[]);
    let through = both.api(&["limits", "--json"]);
    assert_eq!(direct.status.code(), Some(0), "{}", stderr(&direct));
    assert_eq!(through.status.code(), Some(0), "{}", stderr(&through));
    assert_eq!(stdout(&direct), stdout(&through));
    let bad = both.api(&["limits", "not a key!"]);
    assert_eq!(bad.status.code(), Some(1), "{}", stderr(&bad));
}
