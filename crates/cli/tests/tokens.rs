//! What a token may reach (SPEC Z4), through the real `rein api` on real PostgreSQL: tokens
//! bound to queues and a priority ceiling, quotas on runs in flight and on the enqueue rate,
//! subjects and senders that cannot drive a terminal, and a token the command line never
//! shows.

mod common;

use common::{rein, stderr, stdout};
use rein_store::{EnqueueRequest, Store};
use serde_json::json;
use uuid::Uuid;

/// A research-agent run in `queue`, made on the database.
async fn run_in(store: &Store, queue: &str) -> Uuid {
    let def = store.load_definition("research-agent", None).await.unwrap();
    let mut request = EnqueueRequest::new(def, json!({}));
    request.queue = queue.to_owned();
    store.enqueue(request).await.unwrap().run_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_with_control_characters_is_refused_at_creation() {
    let (url, store) = common::fresh_store("tok_subject").await;
    for subject in [
        "alice\nINFO forged log line",
        "bob\u{1b}[2J",
        "eve\u{202e}gpj.exe",
    ] {
        let out = rein(&[
            "tokens",
            "create",
            "--database-url",
            &url,
            "--scope",
            "read",
            "--subject",
            subject,
        ]);
        assert_eq!(out.status.code(), Some(1), "{subject:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("control character"),
            "{subject:?}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "no secret is printed");
        assert!(
            store
                .create_token(subject, &["read".to_owned()])
                .await
                .is_err(),
            "{subject:?}"
        );
    }
    // Printable subjects, accents and all, are fine.
    common::token(&url, "Zoë Ünal (payments)", &["read"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_would_drive_the_terminal_is_refused_and_old_ones_print_escaped() {
    let (url, store) = common::fresh_store("tok_sender").await;
    let run = run_in(&store, "default").await;
    let out = rein(&[
        "send",
        "--database-url",
        &url,
        &run.to_string(),
        "CANCEL",
        "--as",
        "ops\u{1b}]0;pwned\u{7}",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("control character"),
        "{}",
        stderr(&out)
    );
    assert_eq!(store.run(run).await.unwrap().last_sequence, 0);

    // An event stored before senders were checked still shows, escaped, on one line.
    sqlx::query(
        "INSERT INTO rein_events (run_id, sequence, event_id, type, payload, schema_version,
                                  fencing_token, worker, sender)
         VALUES ($1, 1, $2, 'CANCEL', '{}', 1, 0, 'api', $3)",
    )
    .bind(run)
    .bind(Uuid::now_v7())
    .bind("api:bob\u{1b}[2J\n    2  FORGED")
    .execute(store.pool())
    .await
    .unwrap();
    let out = rein(&["runs", "history", "--database-url", &url, &run.to_string()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(!text.contains('\u{1b}'), "{text:?}");
    assert_eq!(text.lines().count(), 2, "a header and one event: {text:?}");
    assert!(text.contains("api:bob\\u{1b}[2J\\u{a}"), "{text:?}");
}
