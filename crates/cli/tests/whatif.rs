//! `rein replay RUN --definition …` and `rein replay --all` against real PostgreSQL: runs of
//! an order definition are recorded by committing their events, then replayed on a version
//! that lowers the amount approved without review from 100 to 50. By hand: a run of amount
//! A diverges exactly when 50 < A <= 100, at sequence 1 (CHECKED), where v1 went to APPROVED
//! and v2 would go to REVIEW; every other run ends the same.

use crate::common;

use std::collections::BTreeSet;

use common::{Fleet, fresh_store, rein, stderr, stdout};
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::{EnqueueRequest, SendOutcome, Sender, Store};
use serde_json::{Value, json};
use uuid::Uuid;

/// The order definition, version `version`: CHECKED approves an amount up to `limit`, else
/// sends it to REVIEW; with `review = false` a reviewed order cannot be REVIEWED (it is not
/// an event), only shipped or cancelled.
fn order(version: u32, limit: u32, review: bool) -> String {
    let (events, review_exit) = if review {
        (
            r#"["CHECKED", "REVIEWED", "SHIPPED"]"#,
            "event = \"REVIEWED\"\nto = \"APPROVED\"",
        )
    } else {
        (
            r#"["CHECKED", "SHIPPED"]"#,
            "event = \"SHIPPED\"\nto = \"SHIPPED_OK\"",
        )
    };
    format!(
        r#"
name = "order-check"
version = {version}
events = {events}
cancel_state = "CANCELLED"

[[states]]
name = "CHECKING"
kind = "waiting"
initial = true

[[states]]
name = "REVIEW"
kind = "waiting"

[[states]]
name = "APPROVED"
kind = "waiting"

[[states]]
name = "SHIPPED_OK"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "CHECKING"
event = "CHECKED"
to = "APPROVED"
priority = 10
guard = "run.data.amount <= {limit}"

[[transitions]]
from = "CHECKING"
event = "CHECKED"
to = "REVIEW"
priority = 1

[[transitions]]
from = "REVIEW"
{review_exit}

[[transitions]]
from = "APPROVED"
event = "SHIPPED"
to = "SHIPPED_OK"
"#
    )
}

fn parsed(text: &str) -> Definition {
    Definition::parse(text, Format::Toml, &GuardRegistry::new()).expect("a valid definition")
}

/// Writes `text` to a file of its own; its path.
fn file(name: &str, text: &str) -> String {
    let path = common::tmp_dir("whatif").join(name);
    std::fs::write(&path, text).expect("write the definition file");
    path.to_string_lossy().into_owned()
}

/// Records one finished run of `def` with `amount`: CHECKED, REVIEWED when over 100, SHIPPED.
async fn record(store: &Store, def: &Definition, amount: u32) -> Uuid {
    let run = store
        .enqueue(EnqueueRequest::new(
            def.clone(),
            json!({ "amount": amount }),
        ))
        .await
        .expect("enqueue")
        .run_id;
    let mut events = vec!["CHECKED"];
    if amount > 100 {
        events.push("REVIEWED");
    }
    events.push("SHIPPED");
    for kind in events {
        let sent = store
            .send(run, kind, json!({}), &Sender::Engine("test".into()), 60_000)
            .await
            .unwrap_or_else(|e| panic!("send {kind}: {e}"));
        assert!(
            matches!(sent, SendOutcome::Applied { .. }),
            "{kind}: {sent:?}"
        );
    }
    run
}

/// `rein ARGS --json` on the database at `url`: exit 0 and one JSON object.
fn json_of(url: &str, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--json", "--database-url", url]);
    let out = rein(&all);
    assert_eq!(
        out.status.code(),
        Some(0),
        "rein {args:?}: {}",
        stderr(&out)
    );
    serde_json::from_str(&stdout(&out))
        .unwrap_or_else(|e| panic!("rein {args:?} prints JSON ({e}): {}", stdout(&out)))
}

/// A database with v1 and v2 registered (v1 current) and a store on it.
async fn with_versions(prefix: &str) -> (String, Store, Definition) {
    let (url, store) = fresh_store(prefix).await;
    let v1 = parsed(&order(1, 100, true));
    store.register_definition(&v1).await.expect("register v1");
    store
        .register_definition(&parsed(&order(2, 50, true)))
        .await
        .expect("register v2");
    (url, store, v1)
}

#[tokio::test]
async fn a_stored_run_replayed_on_a_lower_threshold_diverges_at_its_check() {
    let (url, store, v1) = with_versions("whatif_one").await;
    let diverging = record(&store, &v1, 80).await;
    let same = record(&store, &v1, 10).await;
    let v2 = file("order-v2.toml", &order(2, 50, true));

    let r = json_of(
        &url,
        &["replay", &diverging.to_string(), "--definition", &v2],
    );
    assert_eq!(r["run_id"], json!(diverging));
    assert_eq!(r["verdict"], "diverged");
    assert_eq!(r["recorded_definition"]["version"], 1);
    assert_eq!(r["definition"]["version"], 2);
    assert_eq!(
        (r["events"].as_u64(), r["compared"].as_u64()),
        (Some(2), Some(1))
    );
    let d = &r["divergence"];
    assert_eq!(d["sequence"], 1);
    assert_eq!(d["event"], "CHECKED");
    assert_eq!(d["kind"], "guard");
    assert_eq!(d["state_before"], "CHECKING");
    assert_eq!(d["recorded"]["state"], "APPROVED");
    assert_eq!(d["would"]["state"], "REVIEW");
    assert_eq!(
        d["candidates"][0]["guards"][0]["name"],
        "run.data.amount <= 50"
    );
    assert_eq!(d["candidates"][0]["guards"][0]["value"], "false");
    assert_eq!(d["candidates"][1]["chosen"], true);
    assert_eq!(
        r["recorded"]["state"], "SHIPPED_OK",
        "the recorded run's end"
    );

    let out = rein(&[
        "replay",
        &diverging.to_string(),
        "--definition",
        &v2,
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("diverged at sequence 1 (CHECKED) in state CHECKING: guard"),
        "{text}"
    );
    assert!(text.contains("CHECKING + CHECKED -> APPROVED"), "{text}");
    assert!(text.contains("CHECKING + CHECKED -> REVIEW"), "{text}");
    assert!(text.contains("`run.data.amount <= 50` is false"), "{text}");

    // Registered by name and version, the same definition says the same.
    let by_name = json_of(
        &url,
        &[
            "replay",
            &diverging.to_string(),
            "--definition",
            "order-check@2",
        ],
    );
    assert_eq!(by_name["divergence"], r["divergence"]);

    let s = json_of(&url, &["replay", &same.to_string(), "--definition", &v2]);
    assert_eq!(s["verdict"], "same");
    assert!(s["divergence"].is_null());
    assert_eq!(s["replayed"]["state"], "SHIPPED_OK");
    assert_eq!(s["replayed"]["status"], "terminal");
    let out = rein(&[
        "replay",
        &same.to_string(),
        "--definition",
        &v2,
        "--database-url",
        &url,
    ]);
    assert!(stdout(&out).contains("same outcome"), "{}", stdout(&out));
}

#[tokio::test]
async fn a_definition_without_the_recorded_event_refuses_it_with_the_reason() {
    let (url, store, v1) = with_versions("whatif_refused").await;
    let reviewed = record(&store, &v1, 150).await;
    let v3 = file("order-v3.toml", &order(3, 100, false));
    let r = json_of(
        &url,
        &["replay", &reviewed.to_string(), "--definition", &v3],
    );
    assert_eq!(r["verdict"], "refused");
    let d = &r["divergence"];
    assert_eq!(
        (d["sequence"].as_u64(), d["event"].as_str()),
        (Some(2), Some("REVIEWED"))
    );
    assert_eq!(d["kind"], "rejected");
    assert_eq!(d["state_before"], "REVIEW");
    assert!(d["would"].is_null());
    assert_eq!(d["rejection"]["reason"]["code"], "unknown_event");
    assert_eq!(d["recorded"]["state"], "APPROVED");
}

#[tokio::test]
async fn replay_refuses_what_it_cannot_do_and_says_what_to_do() {
    let (url, _store, _v1) = with_versions("whatif_inputs").await;
    let unknown = Uuid::now_v7().to_string();
    let out = rein(&[
        "replay",
        &unknown,
        "--definition",
        "order-check@2",
        "--database-url",
        &url,
    ]);
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr(&out).contains("not found"), "{}", stderr(&out));
    let out = rein(&[
        "replay",
        &unknown,
        "--definition",
        "order-check@x",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("NAME@VERSION"), "{}", stderr(&out));
    let out = rein(&[
        "replay",
        "--all",
        "--definition",
        "order-check@2",
        "--limit",
        "100001",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("100000"), "{}", stderr(&out));
}

#[tokio::test]
async fn replay_all_counts_the_runs_that_diverge_exactly_as_computed_by_hand() {
    let (url, store, v1) = with_versions("whatif_all").await;
    // Amounts 10, 20, ..., 300: ten recorded before `cut`, twenty after.
    let mut amounts = std::collections::HashMap::new();
    for i in 1..=10u32 {
        amounts.insert(record(&store, &v1, i * 10).await, i * 10);
    }
    let cut: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    for i in 11..=30u32 {
        amounts.insert(record(&store, &v1, i * 10).await, i * 10);
    }
    let diverging: BTreeSet<String> = amounts
        .iter()
        .filter(|(_, a)| **a > 50 && **a <= 100)
        .map(|(id, _)| id.to_string())
        .collect();
    assert_eq!(diverging.len(), 5, "60, 70, 80, 90 and 100");

    let all = json_of(&url, &["replay", "--all", "--definition", "order-check@2"]);
    assert_eq!(all["compared"], 30);
    assert_eq!(all["truncated"], false);
    assert_eq!(
        all["counts"],
        json!({"same": 25, "diverged": 5, "refused": 0, "unreplayable": 0})
    );
    assert_eq!(all["by_kind"], json!({"guard": 5}));
    let runs = all["runs"].as_array().expect("every run");
    assert_eq!(runs.len(), 30);
    let reported: BTreeSet<String> = runs
        .iter()
        .filter(|r| r["verdict"] == "diverged")
        .map(|r| r["run_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(reported, diverging);
    for r in runs.iter().filter(|r| r["verdict"] == "diverged") {
        assert_eq!(r["divergence"]["sequence"], 1);
        assert_eq!(r["divergence"]["would"]["state"], "REVIEW");
    }
    assert_eq!(all["examples"].as_array().map(Vec::len), Some(5));

    // The oldest seven: amounts 10 to 70, of which 60 and 70 diverge.
    let seven = json_of(
        &url,
        &[
            "replay",
            "--all",
            "--definition",
            "order-check@2",
            "--source",
            "order-check@1",
            "--limit",
            "7",
        ],
    );
    assert_eq!(seven["compared"], 7);
    assert_eq!(seven["truncated"], true);
    assert_eq!(seven["counts"]["diverged"], 2);
    assert_eq!(seven["counts"]["same"], 5);

    // The window: before the cut, amounts 10 to 100 (five diverge); after it, none.
    let cut = cut.to_rfc3339();
    let before = json_of(
        &url,
        &[
            "replay",
            "--all",
            "--definition",
            "order-check@2",
            "--until",
            &cut,
        ],
    );
    assert_eq!(before["compared"], 10);
    assert_eq!(before["counts"]["diverged"], 5);
    let after = json_of(
        &url,
        &[
            "replay",
            "--all",
            "--definition",
            "order-check@2",
            "--since",
            &cut,
        ],
    );
    assert_eq!(after["compared"], 20);
    assert_eq!(after["counts"]["same"], 20);

    // For a person: the summary and the examples.
    let out = rein(&[
        "replay",
        "--all",
        "--definition",
        "order-check@2",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("30 runs replayed on order-check v2: 25 same, 5 diverge, 0 refused"),
        "{text}"
    );
    for id in &diverging {
        assert!(text.contains(id.as_str()), "{id} is an example: {text}");
    }
}

/// The check a team runs before deploying: a thousand recorded runs, two candidate versions,
/// and the verdicts computed by hand. Amounts 1..=1000: v2 (approves up to 50 unreviewed)
/// diverges exactly for 51..=100; v3 (no review step at all) refuses every run over 100 at
/// its REVIEWED and agrees with the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_recorded_runs_are_judged_exactly_as_computed_by_hand() {
    let (url, store, v1) = with_versions("whatif_thousand").await;
    let mut amount_of = std::collections::HashMap::new();
    for amount in 1..=1000u32 {
        amount_of.insert(record(&store, &v1, amount).await.to_string(), amount);
    }
    let v3 = file("order-v3-thousand.toml", &order(3, 100, false));
    for (candidate, same, diverged, refused) in
        [("order-check@2", 950, 50, 0), (v3.as_str(), 100, 0, 900)]
    {
        let all = json_of(&url, &["replay", "--all", "--definition", candidate]);
        assert_eq!(all["compared"], 1000, "{candidate}");
        assert_eq!(
            all["counts"],
            json!({"same": same, "diverged": diverged, "refused": refused, "unreplayable": 0}),
            "{candidate}"
        );
        for r in all["runs"].as_array().expect("every run") {
            let amount = amount_of[r["run_id"].as_str().unwrap()];
            let expected = match candidate {
                "order-check@2" if (51..=100).contains(&amount) => "diverged",
                "order-check@2" => "same",
                _ if amount > 100 => "refused",
                _ => "same",
            };
            assert_eq!(r["verdict"], expected, "{candidate}, amount {amount}: {r}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_answers_a_what_if_as_the_cli_does_and_reads_no_file() {
    let (url, store, v1) = with_versions("whatif_api").await;
    let diverging = record(&store, &v1, 80).await;
    let token = common::token(&url, "analyst", &["read"]);
    let mut fleet = Fleet::new(&url, "whatif-api");
    let address = fleet.spawn_server("api", &["api", "--listen", "127.0.0.1:0"]);
    let client = reqwest::Client::new();
    let whatif = |query: &'static str| {
        client
            .get(format!("{address}/v1/runs/{diverging}/whatif{query}"))
            .bearer_auth(&token)
            .send()
    };
    let cli = json_of(
        &url,
        &[
            "replay",
            &diverging.to_string(),
            "--definition",
            "order-check@2",
        ],
    );
    let r = whatif("?definition=order-check@2").await.unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::OK);
    assert_eq!(r.json::<Value>().await.unwrap(), cli);
    // Without a definition: the current version of the run's name (v1, its own): the same.
    let own: Value = whatif("").await.unwrap().json().await.unwrap();
    assert_eq!(own["verdict"], "same", "{own}");
    // A name that is a file where the server runs is still only a name.
    let r = whatif("?definition=Cargo.toml").await.unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::NOT_FOUND);
    for bad in [
        "?definition=",
        "?definition=order-check@0",
        "?definition=../x",
    ] {
        let r = whatif(bad).await.unwrap();
        assert_eq!(
            r.status(),
            reqwest::StatusCode::UNPROCESSABLE_ENTITY,
            "{bad}"
        );
    }
}

/// A definition whose PING keeps a run in A, guarded by `scans` scans of a list in the run's
/// data (some 180,000 steps each at the data size a registration is checked at; five stay
/// within a decision's limit).
fn looping(version: u32, scans: usize) -> Definition {
    let guard: Vec<String> = (0..scans)
        .map(|i| format!("!run.data.items.exists(i, i == 'x{i}')"))
        .collect();
    let guard = if guard.is_empty() {
        String::new()
    } else {
        format!("guard = \"{}\"", guard.join(" && "))
    };
    parsed(&format!(
        r#"
name = "looping"
version = {version}
events = ["PING"]
cancel_state = "DONE"

[[states]]
name = "A"
kind = "waiting"
initial = true

[[states]]
name = "DONE"
kind = "terminal"

[[transitions]]
from = "A"
event = "PING"
to = "A"
{guard}
"#
    ))
}

/// A run of `def` (with an empty list of items) that got `pings` PINGs.
async fn pinged(store: &Store, def: &Definition, pings: u64) -> Uuid {
    store.register_definition(def).await.expect("register");
    let run = store
        .enqueue(EnqueueRequest::new(def.clone(), json!({ "items": [] })))
        .await
        .expect("enqueue")
        .run_id;
    for _ in 0..pings {
        let sent = store
            .send(
                run,
                "PING",
                json!({}),
                &Sender::Engine("test".into()),
                60_000,
            )
            .await
            .expect("send PING");
        assert!(matches!(sent, SendOutcome::Applied { .. }), "{sent:?}");
    }
    run
}

/// The API served in this process on a loopback port, on the replay threads `replays`.
async fn api_in_process(
    store: &Store,
    replays: std::sync::Arc<rein_api::replays::Replays>,
) -> (String, tokio_util::sync::CancellationToken) {
    let app = rein_api::router_with_replays(
        store.clone(),
        false,
        rein_api::Limits::default(),
        None,
        rein_api::console::Console::Off,
        Default::default(),
        replays,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(rein_api::serve_in_process(listener, app, stop.clone()));
    (base, stop)
}

/// A read token's secret.
async fn reader(store: &Store, subject: &str) -> String {
    store
        .create_token(subject, &["read".to_owned()])
        .await
        .expect("create a token")
        .1
}

/// Waits (a minute at most) until `done` holds.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..6_000 {
        if done() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{what} did not happen within a minute");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_what_if_over_the_replay_budget_is_refused_before_anything_is_replayed() {
    use rein_core::replay_cost::{REPLAY_COST_MAX, replay_cost};
    let (_url, store) = fresh_store("whatif_budget").await;
    let costly = looping(1, 5);
    // The fewest events whose what-if passes the budget.
    let pings = REPLAY_COST_MAX / replay_cost(1, &[&costly, &costly], 2) + 1;
    let run = pinged(&store, &costly, pings).await;
    let replays = rein_api::replays::Replays::new(2, 1);
    let (base, _stop) = api_in_process(&store, replays.clone()).await;
    let token = reader(&store, "analyst").await;
    let client = reqwest::Client::new();
    let r = client
        .get(format!("{base}/v1/runs/{run}/whatif"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "validation_failed", "{v}");
    let details = &v["error"]["details"];
    assert_eq!(details["limit"], REPLAY_COST_MAX, "{v}");
    assert!(details["cost"].as_u64().unwrap() > REPLAY_COST_MAX, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    for says in [
        details["cost"].to_string(),
        REPLAY_COST_MAX.to_string(),
        "rein replay".to_owned(),
    ] {
        assert!(message.contains(&says), "{says}: {message}");
    }
    assert_eq!(replays.stats().started, 0, "nothing was replayed");
    // Verifying the same log replays it once, without explaining: within the budget.
    let r = client
        .get(format!("{base}/v1/runs/{run}/verify"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::OK);
    assert_eq!(r.json::<Value>().await.unwrap()["ok"], true);
    assert_eq!(replays.stats().started, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_past_a_tokens_cap_get_429_past_the_servers_503_and_healthz_answers_meanwhile() {
    let (_url, store) = fresh_store("whatif_caps").await;
    let run = pinged(&store, &looping(1, 0), 3).await;
    let replays = rein_api::replays::Replays::new(2, 1);
    let (base, _stop) = api_in_process(&store, replays.clone()).await;
    let (a, b, c) = (
        reader(&store, "a").await,
        reader(&store, "b").await,
        reader(&store, "c").await,
    );
    let client = reqwest::Client::new();
    let whatif = |token: &str| {
        client
            .get(format!("{base}/v1/runs/{run}/whatif"))
            .bearer_auth(token)
            .send()
    };
    // Replays wait at their start: every slot they take stays taken.
    let hold = replays.hold();
    let first = tokio::spawn(whatif(&a));
    until("a's replay takes its slot", || replays.stats().running == 1).await;
    let refused = |r: reqwest::Response, status, code: &'static str| async move {
        assert_eq!(r.status(), status);
        assert_eq!(r.headers()["retry-after"], "2");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], code, "{v}");
    };
    let tokens_cap = reqwest::StatusCode::TOO_MANY_REQUESTS;
    refused(whatif(&a).await.unwrap(), tokens_cap, "too_many_requests").await;
    let verify = client
        .get(format!("{base}/v1/runs/{run}/verify"))
        .bearer_auth(&a)
        .send();
    refused(verify.await.unwrap(), tokens_cap, "too_many_requests").await;
    let second = tokio::spawn(whatif(&b));
    until("b's replay takes its slot", || replays.stats().running == 2).await;
    let servers_cap = reqwest::StatusCode::SERVICE_UNAVAILABLE;
    refused(whatif(&c).await.unwrap(), servers_cap, "unavailable").await;
    // Both replay threads are taken; the threads serving requests are not.
    for _ in 0..3 {
        let r = client.get(format!("{base}/healthz")).send().await.unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::OK);
    }
    drop(hold);
    for answered in [first, second] {
        let r = answered.await.unwrap().unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        assert_eq!(r.json::<Value>().await.unwrap()["verdict"], "same");
    }
    assert_eq!(replays.stats().cancelled, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_client_goes_away_stops_early() {
    let (_url, store) = fresh_store("whatif_cancel").await;
    let pings = 200;
    let run = pinged(&store, &looping(1, 0), pings).await;
    let replays = rein_api::replays::Replays::new(2, 1);
    let (base, _stop) = api_in_process(&store, replays.clone()).await;
    let token = reader(&store, "a").await;
    let hold = replays.hold();
    let mut client = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .unwrap();
    let request = format!(
        "GET /v1/runs/{run}/whatif HTTP/1.1\r\nHost: rein\r\nAuthorization: Bearer {token}\r\n\r\n"
    );
    tokio::io::AsyncWriteExt::write_all(&mut client, request.as_bytes())
        .await
        .unwrap();
    // Handed to the (held) replay threads, so the request now waits on its answer: a slot
    // alone is taken before the log is read, when there is no replay to stop yet.
    until("the replay is handed to its thread", || {
        replays.stats().queued == 1
    })
    .await;
    // The client goes away; the server notices and tells the replay to stop.
    drop(client);
    until("the request is abandoned", || {
        replays.stats().abandoned == 1
    })
    .await;
    drop(hold);
    until("the replay ends", || replays.stats().running == 0).await;
    let stats = replays.stats();
    assert_eq!((stats.started, stats.cancelled), (1, 1), "{stats:?}");
    assert!(
        stats.events < rein_core::replay_cost::CANCEL_CHECK_EVERY && stats.events < pings,
        "{stats:?}: the replay went on after it was told to stop"
    );
}

/// An operate token's secret: it may fork.
async fn operator(store: &Store, subject: &str) -> String {
    store
        .create_token(subject, &["operate".to_owned()])
        .await
        .expect("create a token")
        .1
}

/// Runs in the database.
async fn runs_in(store: &Store) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM rein_runs")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// `POST /v1/runs/{run}/fork` at `at` as `token`.
fn fork_request(
    client: &reqwest::Client,
    base: &str,
    run: Uuid,
    at: u64,
    token: &str,
) -> impl std::future::Future<Output = reqwest::Result<reqwest::Response>> + use<> {
    client
        .post(format!("{base}/v1/runs/{run}/fork"))
        .bearer_auth(token)
        .json(&json!({ "at": at }))
        .send()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_over_the_replay_budget_is_refused_before_anything_is_replayed_or_created() {
    use rein_core::replay_cost::{REPLAY_COST_MAX, replay_cost};
    let (_url, store) = fresh_store("whatif_fork_budget").await;
    let costly = looping(1, 5);
    // The fewest events whose replay (once, as a fork's) passes the budget.
    let pings = REPLAY_COST_MAX / replay_cost(1, &[&costly], 1) + 1;
    let run = pinged(&store, &costly, pings).await;
    let replays = rein_api::replays::Replays::new(2, 1);
    let (base, _stop) = api_in_process(&store, replays.clone()).await;
    let token = operator(&store, "ops").await;
    let client = reqwest::Client::new();
    let r = fork_request(&client, &base, run, pings, &token)
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "validation_failed", "{v}");
    let details = &v["error"]["details"];
    assert_eq!(details["limit"], REPLAY_COST_MAX, "{v}");
    assert_eq!(details["events"], pings, "{v}");
    assert!(details["cost"].as_u64().unwrap() > REPLAY_COST_MAX, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    for says in [
        details["cost"].to_string(),
        REPLAY_COST_MAX.to_string(),
        format!("rein fork {run} --at {pings}"),
    ] {
        assert!(message.contains(&says), "{says}: {message}");
    }
    let stats = replays.stats();
    assert_eq!(
        (stats.queued, stats.started),
        (0, 0),
        "nothing was replayed"
    );
    assert_eq!(runs_in(&store).await, 1, "no fork was created");
    // One event less is within the budget: replayed on the replay threads, and forked.
    let r = fork_request(&client, &base, run, pings - 1, &token)
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::CREATED);
    let fork: Value = r.json().await.unwrap();
    assert_eq!(fork["forked_from"], json!(run), "{fork}");
    assert_eq!(fork["at_sequence"], pings - 1, "{fork}");
    assert_eq!(fork["state"], "A", "{fork}");
    let stats = replays.stats();
    assert_eq!(
        (stats.started, stats.events),
        (1, pings - 1),
        "the fork's replay ran on the replay threads: {stats:?}"
    );
    assert_eq!(runs_in(&store).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_past_a_tokens_replay_cap_get_429_and_past_the_servers_503_with_retry_after() {
    let (_url, store) = fresh_store("whatif_fork_caps").await;
    let run = pinged(&store, &looping(1, 0), 3).await;
    let replays = rein_api::replays::Replays::new(2, 1);
    let (base, _stop) = api_in_process(&store, replays.clone()).await;
    let (a, b, c) = (
        operator(&store, "a").await,
        operator(&store, "b").await,
        operator(&store, "c").await,
    );
    let client = reqwest::Client::new();
    let fork = |token: &str| fork_request(&client, &base, run, 2, token);
    // Replays wait at their start: every slot they take stays taken.
    let hold = replays.hold();
    let first = tokio::spawn(fork(&a));
    until("a's fork takes its slot", || replays.stats().running == 1).await;
    let refused = |r: reqwest::Response, status, code: &'static str| async move {
        assert_eq!(r.status(), status);
        assert_eq!(r.headers()["retry-after"], "2");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], code, "{v}");
    };
    let tokens_cap = reqwest::StatusCode::TOO_MANY_REQUESTS;
    refused(fork(&a).await.unwrap(), tokens_cap, "too_many_requests").await;
    let second = tokio::spawn(fork(&b));
    until("b's fork takes its slot", || replays.stats().running == 2).await;
    let servers_cap = reqwest::StatusCode::SERVICE_UNAVAILABLE;
    refused(fork(&c).await.unwrap(), servers_cap, "unavailable").await;
    assert_eq!(runs_in(&store).await, 1, "no fork was created yet");
    drop(hold);
    for answered in [first, second] {
        let r = answered.await.unwrap().unwrap();
        assert_eq!(r.status(), reqwest::StatusCode::CREATED);
        assert_eq!(r.json::<Value>().await.unwrap()["at_sequence"], 2);
    }
    assert_eq!(runs_in(&store).await, 3);
    assert_eq!(replays.stats().started, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_whose_client_goes_away_stops_its_replay_and_creates_nothing() {
    let (_url, store) = fresh_store("whatif_fork_cancel").await;
    let pings = 200;
    let run = pinged(&store, &looping(1, 0), pings).await;
    let replays = rein_api::replays::Replays::new(2, 1);
    let (base, _stop) = api_in_process(&store, replays.clone()).await;
    let token = operator(&store, "a").await;
    let hold = replays.hold();
    let mut client = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .unwrap();
    let body = json!({ "at": pings }).to_string();
    let request = format!(
        "POST /v1/runs/{run}/fork HTTP/1.1\r\nHost: rein\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut client, request.as_bytes())
        .await
        .unwrap();
    until("the replay is handed to its thread", || {
        replays.stats().queued == 1
    })
    .await;
    drop(client);
    until("the request is abandoned", || {
        replays.stats().abandoned == 1
    })
    .await;
    drop(hold);
    until("the replay ends", || replays.stats().running == 0).await;
    let stats = replays.stats();
    assert_eq!((stats.started, stats.cancelled), (1, 1), "{stats:?}");
    assert!(
        stats.events < rein_core::replay_cost::CANCEL_CHECK_EVERY && stats.events < pings,
        "{stats:?}: the replay went on after it was told to stop"
    );
    assert_eq!(runs_in(&store).await, 1, "no fork was created");
}
