//! Least-privilege database roles (SPEC Z1): after `rein migrate` as the owner, a worker and a
//! scheduler logged in as a member of `rein_runtime` drive runs to the end, and `rein api`
//! logged in as a member of `rein_api_access` enqueues, lists and approves; each is refused
//! what it does not need (deleting events, reading tokens, DDL).

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{Fleet, Logins, REIN, rein, stderr, wait_for};
use rein_store::Store;
use reqwest::StatusCode;
use serde_json::{Value, json};

const POLL: Duration = Duration::from_millis(25);
const INSUFFICIENT_PRIVILEGE: &str = "42501";
/// The migration that grants the groups their privileges (idempotent by design).
const ROLES_MIGRATION: i64 = 20261201000001;

/// The SQLSTATE a statement run as `url` fails with (None when it succeeds).
async fn refusal(url: &str, sql: &str) -> Option<String> {
    let store = Store::connect_without_migrating(url, 1)
        .await
        .expect("connect");
    let result = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(store.pool())
        .await;
    result.err().map(|e| {
        e.as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned())
            .unwrap_or_else(|| format!("not a database error: {e}"))
    })
}

/// `rein migrate` as the owner (the test server's superuser); a store on the database as it.
async fn migrated_by_the_owner(url: &str) -> Store {
    let migrated = rein(&["migrate", "--database-url", url]);
    assert_eq!(migrated.status.code(), Some(0), "{}", stderr(&migrated));
    Store::connect_without_migrating(url, 2)
        .await
        .expect("connect")
}

fn refund_script(amount: u32) -> Value {
    json!({ "agent": { "script": [
        { "decision": "call_tool", "tool": "refund", "args": { "order_id": "R1", "amount": amount } },
        { "decision": "FINISH" }
    ] } })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_and_api_users_run_the_fleet_and_are_refused_what_they_need_not_do() {
    let url = common::fresh_database("roles_fleet");
    let admin = migrated_by_the_owner(&url).await;
    let mut logins = Logins::new(&url);
    let runtime_url = logins.create(&admin, "rt", "rein_runtime").await;
    let api_url = logins.create(&admin, "api", "rein_api_access").await;
    let token = common::token(&url, "roles-test", &["read", "enqueue", "approve"]);

    let mut runtime = Fleet::new(&runtime_url, "roles-runtime");
    runtime.spawn_worker("w1", "3000");
    runtime.spawn("s1", &["scheduler", "--tick-ms", "50"]);
    let mut api_fleet = Fleet::new(&api_url, "roles-api");
    let address = api_fleet.spawn_server("api", &["api", "--listen", "127.0.0.1:0"]);
    let client = reqwest::Client::new();
    let post = |path: &str, body: Value| {
        client
            .post(format!("{address}{path}"))
            .bearer_auth(&token)
            .json(&body)
            .send()
    };

    // Through the API: plain runs, one that retries (fired by the scheduler), and a refund
    // that waits for an approval.
    let mut inputs = vec![
        ("lifecycle", json!({ "sim": { "work_ms": 5 } })),
        ("lifecycle", json!({ "sim": { "work_ms": 5 } })),
        (
            "research-agent",
            json!({ "sim": { "work_ms": 5, "transient_failures": 1 } }),
        ),
    ];
    inputs.push(("refund-agent", refund_script(150)));
    for (definition, input) in &inputs {
        let r = post(
            "/v1/runs",
            json!({ "definition": definition, "input": input }),
        )
        .await
        .expect("enqueue");
        assert_eq!(
            r.status(),
            StatusCode::CREATED,
            "{}",
            r.text().await.unwrap()
        );
    }
    let approvals_url = format!("{address}/v1/approvals");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let approval = loop {
        let listed: Value = client
            .get(&approvals_url)
            .bearer_auth(&token)
            .send()
            .await
            .expect("list approvals")
            .json()
            .await
            .expect("json");
        if let Some(id) = listed[0]["approval_id"].as_str() {
            break id.to_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no approval request: {listed}"
        );
        tokio::time::sleep(POLL).await;
    };
    let granted = post(
        &format!("/v1/approvals/{approval}/grant"),
        json!({ "comment": "fine" }),
    )
    .await
    .expect("grant");
    assert_eq!(granted.status(), StatusCode::OK);

    wait_for(
        "every run terminal",
        Duration::from_secs(60),
        POLL,
        || async {
            admin
                .run_totals()
                .await
                .is_ok_and(|(n, t)| n == 4 && t == 4)
        },
    )
    .await;
    let listed = client
        .get(format!("{address}/v1/runs?status=terminal"))
        .bearer_auth(&token)
        .send()
        .await
        .expect("list runs");
    assert_eq!(listed.status(), StatusCode::OK);
    let listed: Value = listed.json().await.expect("json");
    assert_eq!(listed.as_array().map(Vec::len), Some(4), "{listed}");
    let audit = admin.audit().await.expect("audit");
    assert_eq!(audit.violations(), 0, "{audit:?}");
    let states: Vec<String> = listed
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| r["state"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(
        !states.iter().any(|s| s == "failed" || s == "FAILED"),
        "every run succeeded: {states:?}"
    );

    for (who, user_url, sql) in [
        ("runtime", &runtime_url, "DELETE FROM rein_events"),
        ("runtime", &runtime_url, "TRUNCATE rein_events"),
        ("runtime", &runtime_url, "SELECT * FROM rein_tokens"),
        ("runtime", &runtime_url, "CREATE TABLE rein_t_ddl (x int)"),
        ("runtime", &runtime_url, "DROP TABLE rein_runs"),
        ("api", &api_url, "DELETE FROM rein_events"),
        ("api", &api_url, "UPDATE rein_tokens SET revoked_at = now()"),
        ("api", &api_url, "ALTER TABLE rein_runs ADD COLUMN x int"),
    ] {
        let code = refusal(user_url, sql).await;
        assert!(
            code.as_deref() == Some(INSUFFICIENT_PRIVILEGE),
            "the {who} user must be refused `{sql}`, got {code:?}"
        );
    }
    // The owner could (the refusals above are about privileges, not the statements).
    assert_eq!(
        refusal(&url, "SELECT count(*) FROM rein_tokens").await,
        None
    );

    // A table a later migration forgot to grant shows up here.
    let ungranted: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')
           -- A partition is read through its table, whose grants are checked instead.
           AND NOT c.relispartition
           AND NOT has_table_privilege('rein_runtime', c.oid, 'SELECT')
           AND NOT has_table_privilege('rein_api_access', c.oid, 'SELECT')
         ORDER BY 1",
    )
    .fetch_all(admin.pool())
    .await
    .expect("privileges");
    assert!(
        ungranted.is_empty(),
        "tables granted to neither group: {ungranted:?}"
    );
}

/// Both groups run the commit statement (workers and schedulers commit steps; the API
/// commits what it sends to a run without a lease, and forks), and PostgreSQL checks the
/// privileges of every table a statement writes, even where it writes no row: each group
/// holds every privilege the statement needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_groups_may_run_every_write_of_the_commit_statement() {
    let url = common::fresh_database("roles_commit");
    let admin = migrated_by_the_owner(&url).await;
    let sql = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../store/queries/commit.sql"),
    )
    .expect("the commit statement");
    let mut needed: Vec<(&str, String)> = Vec::new();
    for (verb, privilege) in [
        ("INSERT INTO ", "INSERT"),
        ("UPDATE ", "UPDATE"),
        ("DELETE FROM ", "DELETE"),
    ] {
        for (at, _) in sql.match_indices(verb) {
            let table: String = sql[at + verb.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if table.starts_with("rein_") && !needed.contains(&(privilege, table.clone())) {
                needed.push((privilege, table));
            }
        }
    }
    assert!(
        needed
            .iter()
            .any(|(p, t)| *p == "INSERT" && t == "rein_events"),
        "the statement's writes were read: {needed:?}"
    );
    let mut missing = Vec::new();
    for group in ["rein_runtime", "rein_api_access"] {
        for (privilege, table) in &needed {
            // UPDATE may be granted on the columns the statement sets (the inbox's scan).
            let held: bool = sqlx::query_scalar(
                "SELECT CASE WHEN $3 = 'DELETE' THEN has_table_privilege($1, $2, $3)
                             ELSE has_any_column_privilege($1, $2, $3) END",
            )
            .bind(group)
            .bind(table)
            .bind(privilege)
            .fetch_one(admin.pool())
            .await
            .expect("privilege");
            if !held {
                missing.push(format!("{group}: {privilege} on {table}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the commit statement would be refused: {missing:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_user_on_an_older_schema_is_told_to_run_migrate_as_the_owner() {
    let url = common::fresh_database("roles_behind");
    let admin = migrated_by_the_owner(&url).await;
    let mut logins = Logins::new(&url);
    let runtime_url = logins.create(&admin, "rtold", "rein_runtime").await;
    // Make the schema one migration behind this binary: forget the roles migration, which
    // may be applied again.
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
        .bind(ROLES_MIGRATION)
        .execute(admin.pool())
        .await
        .expect("forget the newest migration");

    for role in ["worker", "scheduler"] {
        let out = Command::new(REIN)
            .args([role, "--database-url", &runtime_url, "--id", "behind"])
            .env_remove("DATABASE_URL")
            .output()
            .expect("run rein");
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(3), "{role}: {err}");
        assert!(
            err.contains("run `rein migrate` as the schema owner"),
            "{role} says what to do: {err}"
        );
    }
    // The owner brings it up to date, and the same user then starts.
    let migrated = rein(&["migrate", "--database-url", &url]);
    assert_eq!(migrated.status.code(), Some(0), "{}", stderr(&migrated));
    let mut fleet = Fleet::new(&runtime_url, "roles-behind");
    fleet.spawn("s1", &["scheduler", "--tick-ms", "50"]);
    wait_for(
        "the scheduler to register",
        Duration::from_secs(20),
        POLL,
        || async {
            admin
                .members()
                .await
                .is_ok_and(|m| m.iter().any(|m| m.worker_id == "s1"))
        },
    )
    .await;
}
