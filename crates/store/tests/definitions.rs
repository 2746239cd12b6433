//! Definition versions (SPEC V1, Z4): who published each, the current-version pointer that
//! runs enqueued without a version follow, the migration that introduced it, and compiled
//! definitions kept per process while the stored row's hash stands.

use crate::common;

use common::store;
use rein_core::{Definition, Format, GuardRegistry, builtin};
use rein_store::{ApprovalAsk, EnqueueRequest, MIGRATOR, Publication, Sender, Store, StoreError};
use serde_json::json;
use uuid::Uuid;

/// The built-in `name` declaring `version`, with `edit` applied to its text.
fn variant(name: &str, version: u32, edit: impl Fn(String) -> String) -> Definition {
    let text = edit(builtin::source_at_version(name, version).expect("a built-in"));
    Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("a valid variant")
}

/// `chain4` renamed to `name` at `version`.
fn own(name: &str, version: u32) -> Definition {
    variant("chain4", version, |t| {
        t.replacen("name = \"chain4\"", &format!("name = \"{name}\""), 1)
    })
}

fn by(who: &str, make_current: bool) -> Publication<'_> {
    Publication {
        by: who,
        make_current,
    }
}

/// The version a run enqueued without naming one starts with.
async fn enqueued_version(store: &Store, name: &str) -> u32 {
    let def = store.load_definition(name, None).await.expect("current");
    let run = store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .expect("enqueue")
        .run_id;
    store.run(run).await.expect("run").version
}

/// The version a load without one gets.
async fn current_of(store: &Store, name: &str) -> u32 {
    store
        .load_definition(name, None)
        .await
        .expect("current")
        .version()
}

/// The reproduction: a new version of refund-agent whose refunds need no approval. Stored,
/// it is not what the next ordinary enqueue runs; only moving the pointer makes it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_version_is_not_what_runs_until_it_is_made_current() {
    let store = store("defs_current").await;
    let shipped = builtin::refund_agent();
    let no_approval = variant("refund-agent", shipped.version() + 1, |t| {
        t.replace("approval = \"args.amount > 100\"", "approval = \"never\"")
    });
    assert!(no_approval.spec().states.iter().any(|s| {
        s.tools
            .iter()
            .any(|t| t.approval.as_deref() == Some("never"))
    }));
    let published = store
        .publish_definition(&no_approval, by("mallory", false))
        .await
        .unwrap();
    assert!(published.created);
    assert_eq!(published.current_version, shipped.version());
    assert_eq!(
        enqueued_version(&store, "refund-agent").await,
        shipped.version()
    );

    let moved = store
        .set_current_definition("refund-agent", no_approval.version(), "platform-admin")
        .await
        .unwrap();
    assert_eq!(
        (moved.previous, moved.version),
        (Some(shipped.version()), no_approval.version())
    );
    assert_eq!(
        enqueued_version(&store, "refund-agent").await,
        no_approval.version()
    );

    let rows = store.list_definitions().await.unwrap();
    let row = |v: u32| {
        rows.iter()
            .find(|r| r.name == "refund-agent" && r.version == v)
            .unwrap_or_else(|| panic!("refund-agent v{v} is listed: {rows:?}"))
    };
    assert_eq!(
        row(shipped.version()).registered_by.as_deref(),
        Some("rein")
    );
    assert!(!row(shipped.version()).current);
    assert_eq!(
        row(no_approval.version()).registered_by.as_deref(),
        Some("mallory")
    );
    assert!(row(no_approval.version()).current);
    // Exactly one current version per name.
    for name in ["lifecycle", "research-agent", "refund-agent", "chain4"] {
        let current = rows.iter().filter(|r| r.name == name && r.current).count();
        assert_eq!(current, 1, "{name}: {rows:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_names_first_version_is_current_and_later_ones_only_when_asked() {
    let store = store("defs_first").await;
    // (version, who, make_current) and then (created, current version, what runs).
    for ((version, who, make_current), want) in [
        ((1, "alice", false), (true, 1)),
        ((2, "alice", false), (true, 1)),
        // The same body again with make_current moves the pointer and stores nothing.
        ((2, "bob", true), (false, 2)),
    ] {
        let published = store
            .publish_definition(&own("triage", version), by(who, make_current))
            .await
            .unwrap();
        assert_eq!((published.created, published.current_version), want);
        assert_eq!(enqueued_version(&store, "triage").await, want.1);
    }
    let row = store.definition_row("triage", None).await.unwrap();
    assert_eq!((row.version, row.current), (2, true));
    // The first registration is who published it; moving the pointer does not change that.
    assert_eq!(row.registered_by.as_deref(), Some("alice"));

    // An explicit version still loads whatever is current.
    assert_eq!(
        store
            .load_definition("triage", Some(1))
            .await
            .unwrap()
            .version(),
        1
    );
    assert!(matches!(
        store.set_current_definition("triage", 9, "alice").await,
        Err(StoreError::UnknownDefinition {
            version: Some(9),
            ..
        })
    ));
    assert!(matches!(
        store.set_current_definition("nobody", 1, "alice").await,
        Err(StoreError::UnknownDefinition { .. })
    ));
    assert!(matches!(
        store
            .publish_definition(&own("triage", 3), by("eve\u{1b}[2J", false))
            .await,
        Err(StoreError::InvalidField { .. })
    ));
    assert_eq!(enqueued_version(&store, "triage").await, 2);
}

/// A database migrated before the pointer existed: each name's highest version becomes
/// current (what enqueues got until then), and `rein migrate` then points each built-in
/// name at the version its binary ships, unless a person has pinned it since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_keeps_what_ran_and_built_ins_follow_the_binary_unless_pinned() {
    let url = rein_devdb::test_database("defs_backfill", env!("CARGO_TARGET_TMPDIR"))
        .expect("a test database");
    let store = Store::connect_without_migrating(&url, 4).await.unwrap();
    let before = MIGRATOR
        .iter()
        .map(|m| m.version)
        .filter(|v| *v < 20261203000200)
        .max()
        .unwrap();
    MIGRATOR.run_to(before, store.pool()).await.unwrap();
    let shipped = builtin::refund_agent();
    let newer = variant("refund-agent", shipped.version() + 1, |t| t);
    for def in [own("triage", 1), own("triage", 3), shipped.clone(), newer] {
        sqlx::query(
            "INSERT INTO rein_definitions (name, version, hash, body) VALUES ($1, $2, $3, $4)",
        )
        .bind(def.name())
        .bind(def.version() as i32)
        .bind(def.hash())
        .bind(serde_json::to_value(def.spec()).unwrap())
        .execute(store.pool())
        .await
        .unwrap();
    }

    store.migrate().await.unwrap();
    assert_eq!(enqueued_version(&store, "triage").await, 3);
    assert_eq!(
        enqueued_version(&store, "refund-agent").await,
        shipped.version()
    );
    let old = store.definition_row("triage", Some(1)).await.unwrap();
    assert_eq!(old.registered_by, None, "nobody was recorded then");

    // Pinned by a person, a built-in name keeps its version across migrations.
    store
        .set_current_definition("refund-agent", shipped.version() + 1, "platform-admin")
        .await
        .unwrap();
    store.migrate().await.unwrap();
    assert_eq!(
        enqueued_version(&store, "refund-agent").await,
        shipped.version() + 1
    );
    // Pinned back to the shipped version by a person, it stays there too.
    store
        .set_current_definition("refund-agent", shipped.version(), "platform-admin")
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let row = store.definition_row("refund-agent", None).await.unwrap();
    assert_eq!(row.version, shipped.version());
}

/// Loading a definition compiles it once per process; the stored row's hash, read with
/// every load, decides whether the compiled copy still stands for the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_is_compiled_once_while_its_stored_hash_stands() {
    let writer = store("defs_cache").await;
    writer
        .publish_definition(&own("cached", 1), by("alice", false))
        .await
        .unwrap();
    // Another process: nothing compiled yet.
    let reader = Store::from_pool(writer.pool().clone());
    assert_eq!(reader.definitions_compiled(), 0);
    for _ in 0..5 {
        assert_eq!(current_of(&reader, "cached").await, 1);
        reader.load_definition("cached", Some(1)).await.unwrap();
    }
    assert_eq!(reader.definitions_compiled(), 1);
    // Every other way a process loads a definition shares the copy: a send to a run.
    let run = reader
        .enqueue(EnqueueRequest::new(
            reader.load_definition("cached", None).await.unwrap(),
            json!({}),
        ))
        .await
        .unwrap()
        .run_id;
    reader
        .send(
            run,
            "CANCEL",
            json!({"reason": "test"}),
            &Sender::outside("ops"),
            60_000,
        )
        .await
        .unwrap();
    assert_eq!(reader.definitions_compiled(), 1);

    // The row changed under the process (a hand edit with a correct hash): compiled again,
    // and what loads is the new body.
    let edited = variant("chain4", 1, |t| {
        t.replacen("name = \"chain4\"", "name = \"cached\"", 1)
            .replace("measures the engine", "measures the cache")
    });
    sqlx::query("UPDATE rein_definitions SET body = $1, hash = $2 WHERE name = 'cached'")
        .bind(serde_json::to_value(edited.spec()).unwrap())
        .bind(edited.hash())
        .execute(writer.pool())
        .await
        .unwrap();
    let loaded = reader.load_definition("cached", Some(1)).await.unwrap();
    assert_eq!(loaded.hash(), edited.hash());
    assert!(loaded.spec().description.contains("the cache"));
    reader.load_definition("cached", None).await.unwrap();
    assert_eq!(reader.definitions_compiled(), 2);

    // A new version is a new entry; the pointer decides which one an unversioned load gets.
    writer
        .publish_definition(&own("cached", 2), by("alice", true))
        .await
        .unwrap();
    assert_eq!(current_of(&reader, "cached").await, 2);
    assert_eq!(reader.definitions_compiled(), 3);
}

/// A research-agent variant whose runs' enqueuer may not grant their approvals, or the
/// built-in itself (`separated` false).
fn research(separated: bool) -> Definition {
    if !separated {
        return builtin::research_agent();
    }
    variant("research-agent", 1, |t| {
        t.replacen(
            "name = \"research-agent\"",
            "name = \"research-separated\"",
            1,
        ) + "\n[policy]\napprover_may_not_be_enqueuer = true\n"
    })
}

/// A run of `def` enqueued by `enqueuer`, parked in WAITING_APPROVAL with an open request.
async fn waiting_for(store: &Store, def: &Definition, enqueuer: &str) -> (Uuid, Uuid) {
    let mut request = EnqueueRequest::new(def.clone(), json!({}));
    request.enqueued_by = Some(enqueuer.to_owned());
    let run = store.enqueue(request).await.unwrap().run_id;
    assert_eq!(
        store.run(run).await.unwrap().enqueued_by.as_deref(),
        Some(enqueuer)
    );
    for event in ["TASK_ACCEPTED", "PLAN_READY", "APPROVAL_REQUIRED"] {
        store
            .send(run, event, json!({}), &Sender::Engine("w".into()), 60_000)
            .await
            .unwrap();
    }
    let approval = store
        .request_approval(ApprovalAsk {
            run_id: run,
            node: "ACTING",
            tool: "refund",
            args: &json!({"order_id": "A1", "amount": 150}),
            action_hash: "h-sod",
            risk: "high",
            expires_after_ms: 3_600_000,
        })
        .await
        .unwrap()
        .approval_id;
    (run, approval)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_enqueuer_may_not_grant_where_the_definition_separates_the_duties() {
    let store = store("defs_sod").await;
    let separated = research(true);
    assert!(separated.approver_may_not_be_enqueuer());
    store.register_definition(&separated).await.unwrap();

    let (run, approval) = waiting_for(&store, &separated, "alice").await;
    match store.decide_approval(approval, true, "alice", None).await {
        Err(StoreError::ApproverIsEnqueuer {
            run_id, approver, ..
        }) => assert_eq!((run_id, approver.as_str()), (run, "alice")),
        other => panic!("alice grants her own run: {other:?}"),
    }
    assert_eq!(store.approval(approval).await.unwrap().status, "pending");
    // Nor by sending the approval event herself, through the API or on the database.
    for sender in [
        Sender::outside_approver("api:alice", "alice"),
        Sender::outside_approver("alice", "alice"),
    ] {
        assert!(
            matches!(
                store
                    .send(run, "APPROVED", json!({}), &sender, 60_000)
                    .await,
                Err(StoreError::ApproverIsEnqueuer { .. })
            ),
            "{sender:?}"
        );
    }
    assert_eq!(store.run(run).await.unwrap().state, "WAITING_APPROVAL");
    let decided = store
        .decide_approval(approval, true, "bob", Some("checked"))
        .await
        .unwrap();
    assert_eq!(decided.decided_by.as_deref(), Some("bob"));

    // Denying her own run stays allowed.
    let (_, approval) = waiting_for(&store, &separated, "alice").await;
    let denied = store
        .decide_approval(approval, false, "alice", None)
        .await
        .unwrap();
    assert_eq!(denied.status, "denied");

    // The built-in declares no policy: the enqueuer may grant there.
    let (_, approval) = waiting_for(&store, &research(false), "alice").await;
    store
        .decide_approval(approval, true, "alice", None)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_rule_separates_the_duties_for_every_definition() {
    let plain = store("defs_sod_deploy").await;
    let strict = plain.clone().with_approver_separation(true);
    let (run, approval) = waiting_for(&strict, &research(false), "alice").await;
    assert!(matches!(
        strict.decide_approval(approval, true, "alice", None).await,
        Err(StoreError::ApproverIsEnqueuer { ref rule, .. }) if rule.contains("deployment")
    ));
    strict
        .decide_approval(approval, true, "bob", None)
        .await
        .unwrap();
    assert_eq!(strict.run(run).await.unwrap().state, "ACTING");
    // Running it again is enqueuing it: the new run is the rerunner's.
    strict
        .send(run, "CANCEL", json!({}), &Sender::outside("ops"), 60_000)
        .await
        .unwrap();
    let again = strict.rerun(run, Some("bob")).await.unwrap();
    assert_eq!(
        strict.run(again).await.unwrap().enqueued_by.as_deref(),
        Some("bob")
    );
    // A run that recorded no enqueuer (created before Rein recorded it) is not refused.
    let (_, approval) = waiting_for(&strict, &research(false), "carol").await;
    sqlx::query("UPDATE rein_runs SET enqueued_by = NULL")
        .execute(strict.pool())
        .await
        .unwrap();
    strict
        .decide_approval(approval, true, "carol", None)
        .await
        .unwrap();
}

/// Fans out into one branch of `triage`, naming no version.
const GATHER: &str = r#"
name = "gather"
version = 1
cancel_state = "CANCELLED"
events = ["GO", "JOINED", "JOIN_FAILED"]

[[states]]
name = "PLAN"
kind = "active"
initial = true

[[states]]
name = "GATHER"
kind = "waiting"
[states.fan_out]
joined_event = "JOINED"
failed_event = "JOIN_FAILED"
join = { policy = "all" }
branches = [{ name = "only", definition = "triage", succeed_on = ["done"] }]

[[states]]
name = "DONE"
kind = "terminal"

[[states]]
name = "FAILED"
kind = "terminal"

[[states]]
name = "CANCELLED"
kind = "terminal"

[[transitions]]
from = "PLAN"
event = "GO"
to = "GATHER"

[[transitions]]
from = "GATHER"
event = "JOINED"
to = "DONE"

[[transitions]]
from = "GATHER"
event = "JOIN_FAILED"
to = "FAILED"
"#;

/// A branch that names no version starts with its definition's current version, not the
/// highest, and records its parent's enqueuer as its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_without_a_version_follows_the_current_pointer_and_its_parents_enqueuer() {
    let store = store("defs_branch").await;
    for version in [1, 2] {
        store
            .publish_definition(&own("triage", version), by("alice", false))
            .await
            .unwrap();
    }
    let gather = Definition::parse(GATHER, Format::Toml, &GuardRegistry::new()).unwrap();
    store.register_definition(&gather).await.unwrap();
    let mut request = EnqueueRequest::new(gather, json!({}));
    request.enqueued_by = Some("alice".to_owned());
    let parent = store.enqueue(request).await.unwrap().run_id;
    store
        .send(parent, "GO", json!({}), &Sender::Engine("w".into()), 60_000)
        .await
        .unwrap();
    let children = store.list_runs(None, Some("triage"), 10).await.unwrap();
    let [child] = &children[..] else {
        panic!("one branch started: {children:?}");
    };
    assert_eq!(child.parent_run_id, Some(parent));
    assert_eq!(child.version, 1, "the current version, not the highest");
    assert_eq!(child.enqueued_by.as_deref(), Some("alice"));
}
