//! Fuzzed API requests (SPEC Z2): bodies and query parameters of any shape sent to a real
//! `rein api` on real PostgreSQL are answered, and never with a 5xx: a request the API cannot
//! use is refused with a 4xx and the JSON error body. `PROPTEST_CASES=5000 cargo test
//! --workspace --test fuzz_api` sends more.

use crate::common;

use common::{Api, PrivateRedis, free_port};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use rein_store::EnqueueRequest;
use serde_json::{Value, json};

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (-1e9f64..1e9).prop_map(|f| json!(f)),
        "\\PC{0,16}".prop_map(Value::String),
        Just(json!("a\u{0}b")),
        Just(json!("x".repeat(300))),
        prop_oneof![
            Just("lifecycle"),
            Just("chain4"),
            Just("CANCEL"),
            Just("USER_REPLY"),
            Just("default")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("definition".to_owned()),
                    Just("input".to_owned()),
                    Just("queue".to_owned()),
                    Just("priority".to_owned()),
                    Just("version".to_owned()),
                    Just("type".to_owned()),
                    Just("payload".to_owned()),
                    Just("comment".to_owned()),
                    Just("outcome".to_owned()),
                    Just("result".to_owned()),
                    "[a-z]{1,8}",
                ],
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Query strings over the parameters the routes read, with values of any shape.
fn query() -> impl Strategy<Value = Vec<(String, String)>> {
    let name = prop_oneof![
        Just("status"),
        Just("state"),
        Just("queue"),
        Just("definition"),
        Just("limit"),
        Just("cursor"),
        Just("id_prefix"),
        Just("parent"),
        Just("created_after"),
        Just("data"),
        Just("envelope"),
        Just("after"),
        Just("all"),
        Just("run"),
        Just("keys"),
        Just("version"),
        Just("zzz"),
    ]
    .prop_map(str::to_owned);
    let value = prop_oneof![
        "\\PC{0,12}",
        any::<i64>().prop_map(|n| n.to_string()),
        Just("true".to_owned()),
        Just("terminal".to_owned()),
        Just("0193a5f2".to_owned()),
        Just("2026-01-01T00:00:00Z".to_owned()),
        Just(uuid::Uuid::nil().to_string()),
    ];
    prop::collection::vec((name, value), 0..4)
}

#[derive(Debug, Clone)]
enum Request {
    Get(&'static str, Vec<(String, String)>),
    PostJson(&'static str, Value),
    PostText(&'static str, String, &'static str),
}

fn request() -> impl Strategy<Value = Request> {
    let get_path = prop_oneof![
        Just("/v1/runs"),
        Just("/v1/runs/{run}"),
        Just("/v1/runs/{run}/events"),
        Just("/v1/runs/{run}/why"),
        Just("/v1/runs/{run}/brief"),
        Just("/v1/approvals"),
        Just("/v1/definitions"),
        Just("/v1/definitions/lifecycle"),
        Just("/v1/webhooks/deliveries"),
        Just("/v1/limits"),
        Just("/v1/me"),
    ];
    let post_path = prop_oneof![
        Just("/v1/runs"),
        Just("/v1/runs/{run}/events"),
        Just("/v1/runs/{run}/rerun"),
        Just("/v1/runs/{run}/resolve"),
        Just("/v1/approvals/{approval}/grant"),
        Just("/v1/approvals/{approval}/deny"),
        Just("/v1/definitions/lifecycle/current"),
    ];
    prop_oneof![
        (get_path, query()).prop_map(|(p, q)| Request::Get(p, q)),
        (post_path.clone(), json_value()).prop_map(|(p, b)| Request::PostJson(p, b)),
        (
            prop_oneof![Just("/v1/definitions"), post_path],
            "\\PC{0,200}",
            prop_oneof![
                Just("application/json"),
                Just("application/toml"),
                Just("text/plain")
            ],
        )
            .prop_map(|(p, t, c)| Request::PostText(p, t, c)),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_of_any_shape_is_answered_with_a_5xx() {
    // With Redis, so the fleet-wide limits route answers too.
    let redis = PrivateRedis::start(free_port(), &common::tmp_dir("fuzz_api_redis"));
    let api = Api::start("fuzz_api", &["--redis-url", &redis.url()]).await;
    let token = api.token("fuzz", &["admin"]);
    let def = api.store.load_definition("lifecycle", None).await.unwrap();
    let run = api
        .store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .unwrap()
        .run_id
        .to_string();
    let approval = uuid::Uuid::now_v7().to_string();
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    let mut runner = TestRunner::new(Config {
        cases,
        ..Config::default()
    });
    let strategy = request();
    let mut answered = std::collections::BTreeMap::<u16, u32>::new();
    for _ in 0..cases {
        let case = strategy.new_tree(&mut runner).unwrap().current();
        let fill = |p: &str| p.replace("{run}", &run).replace("{approval}", &approval);
        let built = match &case {
            Request::Get(path, q) => api.get(&fill(path), Some(&token)).query(q),
            Request::PostJson(path, body) => api.post(&fill(path), &token).json(body),
            Request::PostText(path, text, kind) => api
                .post(&fill(path), &token)
                .header("content-type", *kind)
                .body(text.clone()),
        };
        let response = built.send().await.expect("the API answers");
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        *answered.entry(status.as_u16()).or_default() += 1;
        assert!(
            !status.is_server_error(),
            "{case:?} was answered {status}: {body}"
        );
        if status.is_client_error() {
            let error: Value = serde_json::from_str(&body)
                .unwrap_or_else(|e| panic!("{case:?}: {status} without a JSON body ({e}): {body}"));
            assert!(error["error"]["code"].is_string(), "{case:?}: {body}");
        }
    }
    println!("answers by status: {answered:?}");
    // The requests reach past the first check: some succeed, most are refused.
    assert!(answered.keys().any(|s| *s < 300), "{answered:?}");
    assert!(
        answered.keys().any(|s| (400..500).contains(s)),
        "{answered:?}"
    );
}
