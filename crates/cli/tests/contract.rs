//! Expand and contract (SPEC V1, rolling upgrades): `rein migrate` applies only the steps that
//! keep older releases working; `rein migrate --contract` applies the steps that take away
//! what only older releases used, and refuses while a live member or a connected process of
//! an older release could still use it. A binary starts on a schema a newer release expanded,
//! and refuses one a newer release contracted.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{Fleet, REIN, await_all_terminal, enqueue_many, rein, stderr, stdout};
use rein_store::{CONTRACT_MIGRATOR, Store};
use serde_json::{Value, json};
use sqlx::{ConnectOptions, Connection};

/// The contract step this release ships: the protocol column loses the default that only
/// releases before it relied on.
async fn protocol_default(store: &Store) -> Option<String> {
    sqlx::query_scalar(
        "SELECT column_default FROM information_schema.columns
         WHERE table_name = 'rein_runs' AND column_name = 'protocol'",
    )
    .fetch_one(store.pool())
    .await
    .expect("the protocol column")
}

async fn contract_applied(store: &Store) -> bool {
    let newest = CONTRACT_MIGRATOR.iter().map(|m| m.version).max().unwrap();
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM _sqlx_migrations WHERE version = $1)")
        .bind(newest)
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// A connection named the way processes of releases before schema names connect.
async fn old_release_connection(url: &str) -> sqlx::PgConnection {
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    options
        .application_name("rein-4000001")
        .connect()
        .await
        .expect("a connection as an older release names it")
}

fn contract_json(url: &str, dry_run: bool) -> (Option<i32>, Value) {
    let mut args = vec!["migrate", "--database-url", url, "--contract", "--json"];
    if dry_run {
        args.push("--dry-run");
    }
    let out = rein(&args);
    let plan = serde_json::from_str(&stdout(&out))
        .unwrap_or_else(|e| panic!("a JSON plan ({e}): {} {}", stdout(&out), stderr(&out)));
    (out.status.code(), plan)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_step_waits_for_every_older_process_then_runs() {
    let url = common::fresh_database("contract_waits");
    let migrated = rein(&["migrate", "--database-url", &url]);
    assert_eq!(migrated.status.code(), Some(0), "{}", stderr(&migrated));
    let store = Store::connect_without_migrating(&url, 4).await.unwrap();
    // `rein migrate` expands only: what older releases rely on stays.
    assert!(!contract_applied(&store).await);
    assert_eq!(protocol_default(&store).await.as_deref(), Some("1"));
    // A worker of this release starts on the expanded, not yet contracted, schema, and
    // reports the newest migration it embeds.
    let mut fleet = Fleet::new(&url, "contract-waits");
    fleet.spawn_worker("w-new", "2000");
    common::wait_for(
        "the new worker to register",
        Duration::from_secs(20),
        Duration::from_millis(25),
        || async {
            store.members().await.is_ok_and(|m| {
                m.iter().any(|m| {
                    m.worker_id == "w-new"
                        && m.info["schema"].as_i64() == Some(rein_store::schema_version())
                })
            })
        },
    )
    .await;
    let workers = rein(&["workers", "--database-url", &url]);
    assert!(
        stdout(&workers).contains(&rein_store::schema_version().to_string()),
        "rein workers shows the schema column: {}",
        stdout(&workers)
    );

    // An older release is still about: a process connected under the old name, and a member
    // whose heartbeats say nothing of a schema.
    let old_conn = old_release_connection(&url).await;
    sqlx::query(
        "INSERT INTO rein_workers (worker_id, role, info) VALUES ('w-old', 'worker', '{}')",
    )
    .execute(store.pool())
    .await
    .unwrap();

    let (code, plan) = contract_json(&url, true);
    assert_eq!(code, Some(2), "{plan}");
    assert_eq!(plan["applied"], false);
    assert_eq!(
        plan["pending"].as_array().unwrap().len(),
        CONTRACT_MIGRATOR.iter().count()
    );
    let blockers: Vec<(&str, &str)> = plan["blockers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["worker_id"].as_str().unwrap(),
                b["seen_by"].as_str().unwrap(),
            )
        })
        .collect();
    assert!(blockers.contains(&("w-old", "heartbeat")), "{plan}");
    assert!(blockers.contains(&("rein-4000001", "connection")), "{plan}");
    assert!(
        !blockers.iter().any(|(id, _)| *id == "w-new"),
        "this release's worker is not in the way: {plan}"
    );

    // Not a dry run: the same refusal, nothing contracted, and the text names what to do.
    let refused = rein(&["migrate", "--database-url", &url, "--contract"]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    let text = stdout(&refused);
    assert!(
        text.contains("not contracted") && text.contains("w-old"),
        "{text}"
    );
    assert!(text.contains("upgrade or stop them"), "{text}");
    assert!(!contract_applied(&store).await);

    // The older process goes; the member row alone still blocks until it leaves too.
    old_conn.close().await.unwrap();
    let (code, plan) = contract_json(&url, true);
    assert_eq!(code, Some(2), "{plan}");
    assert_eq!(plan["blockers"].as_array().unwrap().len(), 1, "{plan}");
    sqlx::query("DELETE FROM rein_workers WHERE worker_id = 'w-old'")
        .execute(store.pool())
        .await
        .unwrap();

    // Nothing in the way: the dry run says what it would do and does not do it.
    let (code, plan) = contract_json(&url, true);
    assert_eq!(code, Some(0), "{plan}");
    assert_eq!(plan["applied"], false);
    assert!(!contract_applied(&store).await);
    let done = rein(&["migrate", "--database-url", &url, "--contract"]);
    assert_eq!(done.status.code(), Some(0), "{}", stderr(&done));
    assert!(stdout(&done).contains("contracted: "), "{}", stdout(&done));
    assert!(contract_applied(&store).await);
    assert_eq!(protocol_default(&store).await, None);

    // What the step took away is what only older releases relied on: a run created without
    // naming its protocol is refused now, while this release's runs (fan-out children
    // included) go on and finish under the worker that was running all along.
    let unnamed = sqlx::query(
        "INSERT INTO rein_runs (run_id, definition, version, state, status, projection, input)
         SELECT gen_random_uuid(), name, version, 'X', 'runnable', '{}', '{}'
         FROM rein_definitions LIMIT 1",
    )
    .execute(store.pool())
    .await;
    assert!(unnamed.is_err(), "a run without a protocol is refused");
    let runs = enqueue_many(&store, "lifecycle", json!({}), "default", 5).await;
    let root = common::enqueue_timed_fork(&store).await;
    fleet.spawn(
        "sched",
        &["scheduler", "--tick-ms", "50", "--fan-out-depth-max", "1"],
    );
    await_all_terminal(&store, Duration::from_secs(60)).await;
    let children: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_runs WHERE root_run_id = $1")
        .bind(root)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(children, 2, "the fan-out's children were created");
    for run in runs.iter().chain([&root]) {
        let verify = rein(&["runs", "verify", &run.to_string(), "--database-url", &url]);
        assert_eq!(verify.status.code(), Some(0), "{}", stdout(&verify));
    }
    // Again: nothing left to contract.
    let again = rein(&["migrate", "--database-url", &url, "--contract"]);
    assert_eq!(again.status.code(), Some(0));
    assert!(
        stdout(&again).contains("nothing to contract"),
        "{}",
        stdout(&again)
    );
    drop(fleet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_starts_on_a_schema_a_newer_release_expanded_but_not_one_it_contracted() {
    let url = common::fresh_database("contract_newer");
    let store = Store::connect(&url, 4).await.unwrap();
    let plant = |version: i64, description: &'static str| {
        let store = store.clone();
        async move {
            sqlx::query(
                "INSERT INTO _sqlx_migrations
                     (version, description, success, checksum, execution_time)
                 VALUES ($1, $2, true, '\\x00', 0)",
            )
            .bind(version)
            .bind(description)
            .execute(store.pool())
            .await
            .unwrap();
        }
    };
    let started = |id: &str| {
        // `rein workers` checks the schema like every command that reads it; a worker then
        // really starts and registers.
        let out = Command::new(REIN)
            .args(["workers", "--database-url", &url])
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        (out.status.code(), format!("{id}: {}", stderr(&out)))
    };
    // A newer release's expand step: this binary keeps working.
    plant(29_990_101_000_000, "future column").await;
    let (code, said) = started("expanded");
    assert_eq!(code, Some(0), "{said}");
    let mut fleet = Fleet::new(&url, "contract-newer");
    fleet.spawn_worker("w-expanded", "2000");
    common::wait_for(
        "the worker to start on an expanded schema",
        Duration::from_secs(20),
        Duration::from_millis(25),
        || async {
            store
                .members()
                .await
                .is_ok_and(|m| m.iter().any(|m| m.worker_id == "w-expanded"))
        },
    )
    .await;
    drop(fleet);

    // A newer release's contract step: this binary may use what it removed, so it refuses
    // to start and says what to do.
    plant(29_990_102_000_000, "contract future column").await;
    let worker = Command::new(REIN)
        .args(["worker", "--database-url", &url, "--id", "w-contracted"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(worker.status.code(), Some(3), "{}", stderr(&worker));
    assert!(
        stderr(&worker).contains("upgrade rein"),
        "{}",
        stderr(&worker)
    );
}
