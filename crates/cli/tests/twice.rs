//! Messages that arrive twice or at once (SPEC C6, H1–H3, I3): an approval decided at the
//! same moment through two `rein api` processes takes exactly one decision, the other is
//! refused saying it was decided; an outside event sent twice with the same key through two
//! API processes at once is applied once, and the key with another body is a conflict.

use crate::common;

use common::{Api, code, json_of};
use reqwest::StatusCode;
use serde_json::{Value, json};

const APPROVALS: usize = 8;

/// Decision events in the run's log.
async fn decisions(api: &Api, run: uuid::Uuid) -> Vec<String> {
    api.store
        .history(run)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .filter(|k| k == "APPROVED" || k == "REJECTED")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_decided_at_once_through_two_apis_takes_one_decision() {
    let mut api = Api::start("twice_decide", &[]).await;
    let other = api
        .fleet
        .spawn_server("api-b", &["api", "--listen", "127.0.0.1:0"]);
    let ana = api.token("ana", &["approve", "read"]);
    let bo = api.token("bo", &["approve", "read"]);
    let mut asked = Vec::new();
    for i in 0..APPROVALS {
        let run = common::acting_run(&api.store).await;
        let approval = common::ask_for_approval(&api.store, run, 200 + i as u32).await;
        asked.push((run, approval));
    }
    let http = reqwest::Client::new();
    let mut outcomes = std::collections::BTreeMap::<(u16, u16), usize>::new();
    for (i, (run, approval)) in asked.iter().enumerate() {
        // Half the pairs grant on both sides, half grant on one and deny on the other.
        let (a_verb, b_verb) = if i % 2 == 0 {
            ("grant", "grant")
        } else {
            ("grant", "deny")
        };
        let a = http
            .post(format!("{}/v1/approvals/{approval}/{a_verb}", api.base))
            .bearer_auth(&ana)
            .json(&json!({"comment": "a"}))
            .send();
        let b = http
            .post(format!("{other}/v1/approvals/{approval}/{b_verb}"))
            .bearer_auth(&bo)
            .json(&json!({"comment": "b"}))
            .send();
        let (a, b) = tokio::join!(a, b);
        let (sa, va) = json_of(a.unwrap()).await;
        let (sb, vb) = json_of(b.unwrap()).await;
        *outcomes.entry((sa.as_u16(), sb.as_u16())).or_default() += 1;
        let won: Vec<&Value> = [(&sa, &va), (&sb, &vb)]
            .into_iter()
            .filter(|(s, _)| s.is_success())
            .map(|(_, v)| v)
            .collect();
        assert_eq!(won.len(), 1, "exactly one decision: {sa} {va} / {sb} {vb}");
        let (refused_status, refused) = if sa.is_success() {
            (sb, &vb)
        } else {
            (sa, &va)
        };
        assert_eq!(
            refused_status,
            StatusCode::CONFLICT,
            "the other is refused: {refused}"
        );
        assert!(
            !code(refused).is_empty() && refused["error"]["message"].is_string(),
            "{refused}"
        );
        // The run's log holds that one decision, and the request says who made it.
        let logged = decisions(&api, *run).await;
        assert_eq!(logged.len(), 1, "{run}: {logged:?}");
        let winner = won[0];
        let row = api
            .store
            .approvals(true, Some(*run), 10)
            .await
            .unwrap()
            .into_iter()
            .find(|a| a.approval_id == *approval)
            .unwrap();
        assert_eq!(json!(row.decided_by), winner["decided_by"], "{winner}");
        let granted = winner["status"] == "granted";
        assert_eq!(logged[0] == "APPROVED", granted, "{logged:?} / {winner}");
    }
    eprintln!("twice: (status via A, status via B) -> pairs: {outcomes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_sent_twice_with_one_key_through_two_apis_is_applied_once() {
    let mut api = Api::start("twice_send", &[]).await;
    let other = api
        .fleet
        .spawn_server("api-b", &["api", "--listen", "127.0.0.1:0"]);
    let token = api.token("desk", &["operate", "read"]);
    let def = api
        .store
        .load_definition("research-agent", None)
        .await
        .unwrap();
    let http = reqwest::Client::new();
    for i in 0..6 {
        let run = api
            .store
            .enqueue(rein_store::EnqueueRequest::new(def.clone(), json!({})))
            .await
            .unwrap()
            .run_id;
        common::as_the_engine(&api.store, run, &["NEED_CLARIFICATION"]).await;
        let key = format!("reply-{i}");
        let send = |base: &str| {
            http.post(format!("{base}/v1/runs/{run}/events"))
                .bearer_auth(&token)
                .header("idempotency-key", &key)
                .json(&json!({"type": "USER_REPLY", "payload": {"text": "yes"}}))
                .send()
        };
        let (a, b) = tokio::join!(send(&api.base), send(&other));
        let (sa, va) = json_of(a.unwrap()).await;
        let (sb, vb) = json_of(b.unwrap()).await;
        assert!(sa.is_success() && sb.is_success(), "{sa} {va} / {sb} {vb}");
        assert_eq!(va["event_id"], vb["event_id"], "one event: {va} / {vb}");
        let replies = api
            .store
            .history(run)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "USER_REPLY")
            .count();
        assert_eq!(replies, 1, "{run}");
        // The key with another body is refused.
        let (s, v) = json_of(
            http.post(format!("{other}/v1/runs/{run}/events"))
                .bearer_auth(&token)
                .header("idempotency-key", &key)
                .json(&json!({"type": "USER_REPLY", "payload": {"text": "no"}}))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert_eq!(code(&v), "conflict", "{v}");
    }
}
