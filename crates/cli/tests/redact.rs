//! `rein runs redact` and `POST /v1/runs/{id}/redact`: personal data forgotten from a run's
//! log, input, projection and checkpoints on the real database, with the log still
//! append-only for everything else, the run still verifying, and the blobs only finished,
//! redacted runs referred to deleted.

use crate::common;

use common::*;
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::{Sender, Store};
use serde_json::{Value, json};
use uuid::Uuid;

const PROFILE: &str = r#"
name = "profile"
version = 1
cancel_state = "CANCELLED"
events = ["SUBMIT", "APPROVE"]
external_events = ["SUBMIT", "APPROVE"]

[[states]]
name = "NEW"
kind = "waiting"
initial = true

[[states]]
name = "REVIEW"
kind = "waiting"

[[states]]
name = "DONE"
kind = "terminal"
outcome = "succeeded"

[[states]]
name = "CANCELLED"
kind = "terminal"
outcome = "failed"

[[transitions]]
from = "NEW"
event = "SUBMIT"
to = "REVIEW"

[[transitions]]
from = "REVIEW"
event = "APPROVE"
to = "DONE"
guard = "run.data.amount > 0"
"#;

/// The deployment's redaction key in these tests (`REIN_REDACTION_KEY`).
const KEY: &str = "redaction-key-of-these-tests-0123456789abcdef";
const KEY_ENV: [(&str, &str); 1] = [("REIN_REDACTION_KEY", KEY)];

fn key() -> rein_core::redact::RedactionKey {
    rein_core::redact::RedactionKey::new(KEY).unwrap()
}

/// `rein ARGS` with the tests' redaction key.
fn rein_keyed(args: &[&str]) -> std::process::Output {
    rein_with(args, &KEY_ENV)
}

async fn send(store: &Store, run: Uuid, event: &str, payload: Value) {
    store
        .send(run, event, payload, &Sender::Engine("test".into()), 60_000)
        .await
        .unwrap_or_else(|e| panic!("{event}: {e}"));
}

/// Everything stored about `run` as text: its row, events and checkpoints.
async fn stored_text(store: &Store, run: Uuid) -> String {
    let (row, events, checkpoints): (String, String, String) = sqlx::query_as(
        "SELECT (SELECT row_to_json(r)::text FROM rein_runs r WHERE run_id = $1),
                (SELECT coalesce(json_agg(e)::text, '') FROM rein_events_all e WHERE run_id = $1),
                (SELECT coalesce(json_agg(c)::text, '') FROM rein_checkpoints c WHERE run_id = $1)",
    )
    .bind(run)
    .fetch_one(store.pool())
    .await
    .unwrap();
    format!("{row}{events}{checkpoints}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_keys_are_forgotten_everywhere_and_the_run_still_verifies() {
    let (url, store) = fresh_store("redact").await;
    let def = Definition::parse(PROFILE, Format::Toml, &GuardRegistry::new()).unwrap();
    store.register_definition(&def).await.unwrap();
    let run = enqueue_many(
        &store,
        "profile",
        json!({"email": "ada@example.org", "amount": 5}),
        "default",
        1,
    )
    .await[0];
    send(
        &store,
        run,
        "SUBMIT",
        json!({"data": {"email": "ada.l@example.org", "phone": "+44 20 7946 0000"}}),
    )
    .await;
    send(&store, run, "APPROVE", json!({})).await;
    let before = stored_text(&store, run).await;
    assert!(before.contains("ada@example.org") && before.contains("+44 20 7946 0000"));

    // A key the definition's guard reads cannot go: the replay would decide differently.
    let out = rein_keyed(&[
        "runs",
        "redact",
        &run.to_string(),
        "--fields",
        "amount",
        "--reason",
        "asked",
        "--database-url",
        &url,
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("reads `amount`"), "{}", stderr(&out));
    assert_eq!(
        stored_text(&store, run).await,
        before,
        "a refusal writes nothing"
    );

    let out = rein_keyed(&[
        "runs",
        "redact",
        &run.to_string(),
        "--fields",
        "email,phone",
        "--reason",
        "erasure request 4711",
        "--as",
        "dpo",
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let done: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(done["events"], 1, "{done}");
    let after = stored_text(&store, run).await;
    for value in ["ada@example.org", "ada.l@example.org", "+44 20 7946 0000"] {
        assert!(!after.contains(value), "{value} is still stored");
    }
    assert!(after.contains("$redacted"));
    let marker = rein_core::redact::marker(&key(), &json!("ada.l@example.org"));
    let row = store.run(run).await.unwrap();
    assert_eq!(
        row.projection.data["email"], marker,
        "the projection holds the keyed hash"
    );
    // Not the plain sha256 a reader could compute from a guess of the value.
    for value in ["ada@example.org", "ada.l@example.org", "+44 20 7946 0000"] {
        let plain =
            rein_core::hash::sha256_hex(rein_core::hash::canonical_json(&json!(value)).as_bytes());
        assert!(
            !after.contains(&plain),
            "the unkeyed hash of {value} is stored"
        );
    }
    let (keyed,): (bool,) = sqlx::query_as("SELECT keyed FROM rein_redactions WHERE run_id = $1")
        .bind(run)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(keyed, "the redaction is recorded as keyed");
    assert_eq!(
        store.verify_run(run).await.unwrap(),
        None,
        "the redacted run verifies"
    );
    let (by, reason): (String, String) =
        sqlx::query_as("SELECT redacted_by, reason FROM rein_redactions WHERE run_id = $1")
            .bind(run)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(
        (by.as_str(), reason.as_str()),
        ("dpo", "erasure request 4711")
    );
    // Again: nothing left to replace.
    let out = rein_keyed(&[
        "runs",
        "redact",
        &run.to_string(),
        "--fields",
        "email",
        "--reason",
        "again",
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        serde_json::from_str::<Value>(&stdout(&out)).unwrap()["events"],
        0
    );

    // The log is append-only for everything else, even for its owner.
    let refused = sqlx::query("UPDATE rein_events SET payload = '{}' WHERE run_id = $1")
        .bind(run)
        .execute(store.pool())
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("append-only"), "{refused}");
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL rein.redacting = 'on'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let refused = sqlx::query("UPDATE rein_events SET type = 'X' WHERE run_id = $1")
        .bind(run)
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("append-only"), "{refused}");
}

/// Stores `value` as a blob that `runs` refer to; its hash.
async fn blob_of(admin: &Store, value: Value, runs: &[Uuid]) -> String {
    let content = rein_core::hash::canonical_json(&value);
    let sha = rein_core::hash::sha256_hex(content.as_bytes());
    sqlx::query("INSERT INTO rein_blobs (sha256, size_bytes, content) VALUES ($1, $2, $3)")
        .bind(&sha)
        .bind(content.len() as i64)
        .bind(content.as_bytes())
        .execute(admin.pool())
        .await
        .expect("store a blob");
    for run in runs {
        sqlx::query("INSERT INTO rein_blob_refs (sha256, run_id) VALUES ($1, $2)")
            .bind(&sha)
            .bind(run)
            .execute(admin.pool())
            .await
            .expect("refer to it");
    }
    sha
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_user_redacts_a_run_and_forgets_the_blobs_only_finished_redacted_runs_refer_to() {
    let (url, admin) = fresh_store("redact_api").await;
    let def = Definition::parse(PROFILE, Format::Toml, &GuardRegistry::new()).unwrap();
    admin.register_definition(&def).await.unwrap();
    let mut logins = common::Logins::new(&url);
    let api_url = logins.create(&admin, "api", "rein_api_access").await;
    let token = common::token(&url, "dpo", &["read", "operate"]);
    let reader = common::token(&url, "viewer", &["read"]);
    let mut api_fleet = Fleet::new(&api_url, "redact-api");
    let address = api_fleet.spawn_server_env("api", &["api", "--listen", "127.0.0.1:0"], &KEY_ENV);
    let client = reqwest::Client::new();

    // A and B finish; C waits for its event.
    let finished = enqueue_many(&admin, "profile", json!({"amount": 3}), "default", 2).await;
    let (a, b) = (finished[0], finished[1]);
    let c = enqueue_many(
        &admin,
        "profile",
        json!({"amount": 3, "email": "c@example.org"}),
        "default",
        1,
    )
    .await[0];
    for (run, email) in [(a, "ada@example.org"), (b, "bob@example.org")] {
        send(&admin, run, "SUBMIT", json!({"data": {"email": email}})).await;
        send(&admin, run, "APPROVE", json!({})).await;
    }
    let shared = blob_of(&admin, json!({"prompt": "shared by A and B"}), &[a, b]).await;
    let only_a = blob_of(&admin, json!({"prompt": "Ada's own"}), &[a]).await;
    let with_c = blob_of(&admin, json!({"prompt": "A and the unfinished C"}), &[a, c]).await;

    let redact = |run: Uuid, body: Value, bearer: &str| {
        client
            .post(format!("{address}/v1/runs/{run}/redact"))
            .bearer_auth(bearer)
            .json(&body)
            .send()
    };
    let body = json!({"fields": ["email"], "reason": "erasure request 4711"});
    // The read scope does not redact; a malformed body is refused for its shape, a key the
    // guard reads for the run's definition.
    let r = redact(a, body.clone(), &reader).await.unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::FORBIDDEN);
    let r = redact(a, json!({"fields": [], "reason": "x"}), &token)
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY);
    let r = redact(a, json!({"fields": ["email"], "reason": "a\u{0}b"}), &token)
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY);
    let refused: Value = r.json().await.unwrap();
    assert_eq!(refused["error"]["details"]["field"], "reason", "{refused}");
    let r = redact(a, json!({"fields": ["amount"], "reason": "x"}), &token)
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::CONFLICT);
    assert!(r.text().await.unwrap().contains("reads `amount`"));

    let r = redact(a, body.clone(), &token).await.unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::OK);
    let done: Value = r.json().await.unwrap();
    assert_eq!(done["events"], 1, "{done}");
    assert_eq!(done["finished"], true, "{done}");
    assert_eq!(done["blobs_deleted"], json!([only_a]), "{done}");
    assert_eq!(done["hashes"][0]["field"], "email", "{done}");
    assert_eq!(admin.verify_run(a).await.unwrap(), None, "A still verifies");
    let (by,): (String,) =
        sqlx::query_as("SELECT redacted_by FROM rein_redactions WHERE run_id = $1")
            .bind(a)
            .fetch_one(admin.pool())
            .await
            .unwrap();
    assert_eq!(by, "operator:dpo");

    let blob = |sha: String| {
        client
            .get(format!("{address}/v1/blobs/{sha}"))
            .bearer_auth(&reader)
            .send()
    };
    let r = blob(only_a.clone()).await.unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::NOT_FOUND);
    assert!(r.text().await.unwrap().contains("was forgotten"));
    for kept in [&shared, &with_c] {
        assert_eq!(
            blob(kept.clone()).await.unwrap().status(),
            reqwest::StatusCode::OK,
            "{kept}"
        );
    }

    // C has not finished: its data goes, its blobs stay for it to read.
    let r = redact(c, body.clone(), &token).await.unwrap();
    let done: Value = r.json().await.unwrap();
    assert_eq!(done["finished"], false, "{done}");
    assert_eq!(done["blobs_deleted"], json!([]), "{done}");
    // B is redacted too: now only finished, redacted runs refer to the shared blob.
    let done: Value = redact(b, body.clone(), &token)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(done["blobs_deleted"], json!([shared]), "{done}");

    // The API's user reaches the log only through the function, and the function takes
    // nothing but markers in place of the named keys: a payload changed otherwise is refused
    // and writes nothing.
    let api = Store::connect_without_migrating(&api_url, 1).await.unwrap();
    let denied = sqlx::query("UPDATE rein_events SET payload = '{}' WHERE run_id = $1")
        .bind(a)
        .execute(api.pool())
        .await
        .unwrap_err();
    assert_eq!(
        denied.as_database_error().and_then(|d| d.code()).as_deref(),
        Some("42501"),
        "{denied}"
    );
    let row = admin.run(a).await.unwrap();
    let mut projection = serde_json::to_value(&row.projection).unwrap();
    projection["data"]["amount"] = json!(1_000_000);
    let forged = sqlx::query(
        "SELECT * FROM rein_apply_redaction($1, $2, ARRAY['email'], $3, $4, '[]', '[]', '[]', 'x', 'x')",
    )
    .bind(a)
    .bind(row.last_sequence as i64)
    .bind(admin.run_input(a).await.unwrap())
    .bind(&projection)
    .execute(api.pool())
    .await
    .unwrap_err();
    assert!(
        forged.to_string().contains("is not a redaction"),
        "{forged}"
    );
    assert_eq!(admin.run(a).await.unwrap().projection.data["amount"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redaction_without_a_key_is_refused_saying_what_to_set_and_writes_nothing() {
    let (url, store) = fresh_store("redact_nokey").await;
    let def = Definition::parse(PROFILE, Format::Toml, &GuardRegistry::new()).unwrap();
    store.register_definition(&def).await.unwrap();
    let run = enqueue_many(
        &store,
        "profile",
        json!({"email": "ada@example.org", "amount": 5}),
        "default",
        1,
    )
    .await[0];
    let before = stored_text(&store, run).await;
    let args = [
        "runs",
        "redact",
        &run.to_string(),
        "--fields",
        "email",
        "--reason",
        "asked",
        "--database-url",
        &url,
    ];
    let out = rein_with(&args, &[]);
    assert!(!out.status.success());
    let said = stderr(&out);
    assert!(
        said.contains("REIN_REDACTION_KEY") && said.contains("openssl rand -hex 32"),
        "{said}"
    );
    // A key too short to keep the markers from being guessed is refused as well.
    let out = rein_with(&args, &[("REIN_REDACTION_KEY", "hunter2")]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("too short"), "{}", stderr(&out));

    // The API started without a key answers 503 with the same advice.
    let mut fleet = Fleet::new(&url, "redact-nokey");
    let address = fleet.spawn_server("api", &["api", "--listen", "127.0.0.1:0"]);
    let token = common::token(&url, "dpo", &["operate"]);
    let r = reqwest::Client::new()
        .post(format!("{address}/v1/runs/{run}/redact"))
        .bearer_auth(&token)
        .json(&json!({"fields": ["email"], "reason": "asked"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("REIN_REDACTION_KEY"),
        "{body}"
    );
    assert_eq!(
        stored_text(&store, run).await,
        before,
        "nothing was redacted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markers_an_unkeyed_redaction_left_are_listed_and_replaced_by_keyed_ones() {
    let (url, store) = fresh_store("redact_rekey").await;
    let def = Definition::parse(PROFILE, Format::Toml, &GuardRegistry::new()).unwrap();
    store.register_definition(&def).await.unwrap();
    let run = enqueue_many(
        &store,
        "profile",
        json!({"phone": "+44 20 7946 0000", "amount": 5}),
        "default",
        1,
    )
    .await[0];
    // What a release before keyed markers wrote: the plain sha256 of the value, through the
    // function it called.
    let plain = rein_core::hash::sha256_hex(
        rein_core::hash::canonical_json(&json!("+44 20 7946 0000")).as_bytes(),
    );
    let old = json!({"$redacted": {"sha256": plain}});
    let row = store.run(run).await.unwrap();
    let mut input = store.run_input(run).await.unwrap();
    input["phone"] = old.clone();
    let mut projection = serde_json::to_value(&row.projection).unwrap();
    projection["data"]["phone"] = old.clone();
    let (outcome,): (String,) = sqlx::query_as(
        "SELECT outcome FROM rein_apply_redaction($1, $2, ARRAY['phone'], $3, $4, '[]', '[]', '[]', 'dpo', 'old release')",
    )
    .bind(run)
    .bind(row.last_sequence as i64)
    .bind(&input)
    .bind(&projection)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(outcome, "redacted");
    assert!(stored_text(&store, run).await.contains(&plain));

    let listed = |args: &[&str]| {
        let out = rein(args);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_str::<Value>(&stdout(&out)).unwrap()
    };
    let list = [
        "runs",
        "unkeyed-redactions",
        "--json",
        "--database-url",
        &url,
    ];
    let unkeyed = listed(&list);
    assert_eq!(unkeyed.as_array().unwrap().len(), 1, "{unkeyed}");
    assert_eq!(unkeyed[0]["run_id"], json!(run), "{unkeyed}");
    assert_eq!(unkeyed[0]["field"], "phone", "{unkeyed}");

    // Redacting the key again, now with the key, replaces the old marker by a keyed one.
    let out = rein_keyed(&[
        "runs",
        "redact",
        &run.to_string(),
        "--fields",
        "phone",
        "--reason",
        "re-key the old markers",
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        !stored_text(&store, run).await.contains(&plain),
        "the unkeyed hash is gone"
    );
    let row = store.run(run).await.unwrap();
    assert_eq!(
        row.projection.data["phone"],
        rein_core::redact::rekeyed(&key(), &old)
    );
    assert_eq!(
        store.verify_run(run).await.unwrap(),
        None,
        "it still verifies"
    );
    assert_eq!(listed(&list), json!([]), "nothing unkeyed is left");
}

const COLLECTOR: &str = r#"
name = "collector"
version = 1
cancel_state = "CANCELLED"
events = ["FETCHED", "CLOSE"]
external_events = ["CLOSE"]

[[states]]
name = "FETCH"
kind = "active"
initial = true
action = "fetch"

[[states]]
name = "OPEN"
kind = "waiting"

[[states]]
name = "DONE"
kind = "terminal"
outcome = "succeeded"

[[states]]
name = "CANCELLED"
kind = "terminal"
outcome = "failed"

[[transitions]]
from = "FETCH"
event = "FETCHED"
to = "OPEN"

[[transitions]]
from = "OPEN"
event = "CLOSE"
to = "DONE"
"#;

/// A page of `what`: well over the worker's inline threshold in these tests.
fn page(what: &str) -> Value {
    let lines: Vec<String> = (0..200).map(|i| format!("{what} line {i}")).collect();
    json!({ "page": what, "lines": lines })
}

/// `fetch` returns a page every run fetches (`shared`) and one of its own run (`own`).
struct Fetch;

impl rein_worker::NodeHandler for Fetch {
    fn side_effect(&self, _ctx: &rein_worker::ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: rein_worker::ActionContext) -> rein_worker::BoxFuture<rein_worker::Outcome> {
        Box::pin(async move {
            rein_worker::Outcome::event(
                "FETCHED",
                json!({
                    "shared": page("the shared page"),
                    "own": page(&format!("the page of run {}", ctx.run_id)),
                }),
            )
        })
    }
}

/// The blob references the commits of `run` recorded.
async fn refs_of(store: &Store, run: Uuid) -> Vec<String> {
    sqlx::query_scalar("SELECT sha256 FROM rein_blob_refs WHERE run_id = $1 ORDER BY sha256")
        .bind(run)
        .fetch_all(store.pool())
        .await
        .unwrap()
}

/// The reference in field `field` of `run`'s FETCHED event.
async fn fetched_ref(store: &Store, run: Uuid, field: &str) -> rein_core::blob::BlobRef {
    let events = store.history(run).await.unwrap();
    let fetched = events
        .iter()
        .find(|e| e.kind == "FETCHED")
        .expect("FETCHED");
    rein_core::blob::reference_of(&fetched.payload[field])
        .unwrap_or_else(|| panic!("{field} is stored as a blob: {}", fetched.payload))
}

/// Two runs of COLLECTOR fetched by a worker whose commits stored their pages as blobs,
/// both now OPEN: `(url, store, first, second)`.
async fn two_fetched_runs(prefix: &str) -> (String, Store, Uuid, Uuid) {
    let (url, store) = fresh_store(prefix).await;
    let def = Definition::parse(COLLECTOR, Format::Toml, &GuardRegistry::new()).unwrap();
    store.register_definition(&def).await.unwrap();
    let runs = enqueue_many(
        &store,
        "collector",
        json!({"email": "ada@example.org"}),
        "default",
        2,
    )
    .await;
    let (finished, live) = (runs[0], runs[1]);

    let mut registry = rein_worker::Registry::new();
    registry.register("fetch", Fetch);
    let mut config = rein_worker::WorkerConfig::new("redact-w1");
    config.poll_interval_ms = 20;
    config.payload_inline_bytes = 1024;
    let worker = rein_worker::Worker::new(store.clone(), config, registry);
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await }
    });
    for run in [finished, live] {
        let store = store.clone();
        wait_for(
            "the run fetched",
            std::time::Duration::from_secs(30),
            std::time::Duration::from_millis(20),
            move || {
                let store = store.clone();
                async move { store.run(run).await.is_ok_and(|r| r.state == "OPEN") }
            },
        )
        .await;
    }
    stop.cancel();
    task.await.unwrap().unwrap();
    (url, store, finished, live)
}

/// The blobs a worker's commits stored (and recorded as referred to) are forgotten when
/// the finished run is redacted, except the one a live run's commit refers to as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redacting_a_finished_run_forgets_the_blobs_its_commits_stored_but_not_a_live_runs() {
    let (_url, store, finished, live) = two_fetched_runs("redact_committed_blobs").await;
    send(&store, finished, "CLOSE", json!({})).await;
    assert_eq!(store.run(finished).await.unwrap().state, "DONE");

    // The commits stored the pages and recorded which run refers to which.
    let shared = fetched_ref(&store, finished, "shared").await;
    assert_eq!(shared, fetched_ref(&store, live, "shared").await);
    let own = fetched_ref(&store, finished, "own").await;
    let live_own = fetched_ref(&store, live, "own").await;
    let mut expected = vec![shared.sha256.clone(), own.sha256.clone()];
    expected.sort();
    assert_eq!(refs_of(&store, finished).await, expected);
    let mut expected = vec![shared.sha256.clone(), live_own.sha256.clone()];
    expected.sort();
    assert_eq!(refs_of(&store, live).await, expected);

    let done = store
        .redact_run(
            finished,
            &["email".to_owned()],
            &key(),
            "operator:dpo",
            "erasure request 4712",
        )
        .await
        .unwrap();
    assert!(done.finished);
    assert_eq!(done.blobs_deleted, vec![own.sha256.clone()]);
    let stored: Vec<String> = sqlx::query_scalar("SELECT sha256 FROM rein_blobs")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert!(!stored.contains(&own.sha256), "the run's own page is gone");
    assert!(stored.contains(&shared.sha256), "the shared page is kept");
    assert!(
        stored.contains(&live_own.sha256),
        "the live run's page is kept"
    );
    assert_eq!(
        store.read_blob_of(live, &shared).await.unwrap(),
        Some(page("the shared page")),
        "the live run still reads the page it shares"
    );
    assert!(
        store.read_blob(&own).await.is_err(),
        "the own page reads nothing"
    );
    assert_eq!(
        store.verify_run(finished).await.unwrap(),
        None,
        "it still verifies"
    );
}

/// A fork made while its source was open reads the source's pages through references of its
/// own, so redacting the finished source keeps what the live fork still needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redacting_a_finished_source_keeps_the_blobs_its_live_fork_reads() {
    let (url, store, source, _other) = two_fetched_runs("redact_forked_blobs").await;
    let open_at = store.run(source).await.unwrap().last_sequence;
    let out = rein(&[
        "fork",
        &source.to_string(),
        "--at",
        &open_at.to_string(),
        "--json",
        "--database-url",
        &url,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let forked: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let fork: Uuid = forked["run_id"].as_str().unwrap().parse().unwrap();
    send(&store, source, "CLOSE", json!({})).await;
    let own = fetched_ref(&store, source, "own").await;
    let done = store
        .redact_run(
            source,
            &["email".to_owned()],
            &key(),
            "operator:dpo",
            "erasure request 4713",
        )
        .await
        .unwrap();
    assert!(done.finished);
    assert_eq!(
        done.blobs_deleted,
        Vec::<String>::new(),
        "the live fork needs them"
    );
    assert_eq!(
        store.read_blob_of(fork, &own).await.unwrap(),
        Some(page(&format!("the page of run {source}"))),
        "the fork still reads the page it was forked with"
    );
}
