//! HTTP metrics of `rein api` (SPEC O2): each request counted and timed by method, route
//! template and status code. The route is the template the router matched
//! (`/v1/runs/{id}`), never the path a client sent, so run ids and probing clients cannot
//! multiply the series: a path no route matches counts as [`UNMATCHED`], a method outside
//! the standard ones as `other`.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use metrics::{Label, counter, describe_counter, describe_histogram, histogram};

pub const HTTP_REQUESTS: &str = "rein_http_requests_total";
pub const HTTP_REQUEST_DURATION: &str = "rein_http_request_duration_seconds";
/// The `route` of a request no route matched.
pub const UNMATCHED: &str = "unmatched";
/// Buckets of [`HTTP_REQUEST_DURATION`] in seconds: from a probe (1 ms) to a slow page or a
/// definition's compilation (10 s), the range where an API's latency objectives lie.
pub const DURATION_BUCKETS_S: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 7.5, 10.0,
];

/// The help text of the HTTP families.
pub fn describe() {
    describe_counter!(
        HTTP_REQUESTS,
        "HTTP requests answered, by method, route template and status code"
    );
    describe_histogram!(
        HTTP_REQUEST_DURATION,
        metrics::Unit::Seconds,
        "Time from a request's arrival at the router to its response, by method, route template and status code"
    );
}

fn method_label(method: &Method) -> &'static str {
    [
        (Method::GET, "GET"),
        (Method::POST, "POST"),
        (Method::PUT, "PUT"),
        (Method::DELETE, "DELETE"),
        (Method::PATCH, "PATCH"),
        (Method::HEAD, "HEAD"),
        (Method::OPTIONS, "OPTIONS"),
    ]
    .into_iter()
    .find(|(m, _)| m == method)
    .map_or("other", |(_, label)| label)
}

fn labels(method: &'static str, route: String, status: String) -> Vec<Label> {
    vec![
        Label::new("method", method),
        Label::new("route", route),
        Label::new("status", status),
    ]
}

/// Middleware: counts and times every request the router answers.
pub async fn record(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = method_label(req.method());
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| UNMATCHED.to_owned(), |p| p.as_str().to_owned());
    let response = next.run(req).await;
    let labels = labels(method, route, response.status().as_u16().to_string());
    histogram!(HTTP_REQUEST_DURATION, labels.clone()).record(started.elapsed().as_secs_f64());
    counter!(HTTP_REQUESTS, labels).increment(1);
    response
}

/// Registers at 0 what the API's document says it answers: the count of every operation
/// with each status code it documents, and the duration of each operation's successes (its
/// 2xx codes: a histogram for every error code too would be many series for little).
pub fn register(doc: &utoipa::openapi::OpenApi) {
    for (route, item) in &doc.paths.paths {
        let operations = [
            (Method::GET, &item.get),
            (Method::POST, &item.post),
            (Method::PUT, &item.put),
            (Method::DELETE, &item.delete),
            (Method::PATCH, &item.patch),
        ];
        for (method, operation) in operations {
            let Some(operation) = operation else { continue };
            let method = method_label(&method);
            let statuses: Vec<u16> = operation
                .responses
                .responses
                .keys()
                .filter_map(|code| code.parse().ok())
                .collect();
            for status in &statuses {
                counter!(
                    HTTP_REQUESTS,
                    labels(method, route.clone(), status.to_string())
                )
                .increment(0);
            }
            for ok in statuses.iter().filter(|s| (200..300).contains(*s)) {
                let _ = histogram!(
                    HTTP_REQUEST_DURATION,
                    labels(method, route.clone(), ok.to_string())
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_outside_the_standard_ones_share_one_label() {
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(method_label(&Method::DELETE), "DELETE");
        let custom = Method::from_bytes(b"PROPFIND").unwrap();
        assert_eq!(method_label(&custom), "other");
    }
}
