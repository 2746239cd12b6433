//! The web console: static files the API serves at `/` (its page) and `/console/...` (its
//! scripts and styles), embedded in the binary, or read from a directory on every request
//! with `rein api --console-dir` while they are being changed. The files hold no data: the
//! page asks `/v1` for everything with the token its user signs in with, so they are served
//! without one. Every answer carries a Content-Security-Policy that allows only this
//! origin's scripts, styles and connections.

use std::path::{Component, Path, PathBuf};

use axum::extract::{Path as UrlPath, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use rust_embed::RustEmbed;

/// The console's files, as they were when the binary was built.
#[derive(RustEmbed)]
#[folder = "console/"]
struct Embedded;

/// Where the console's files come from.
#[derive(Clone, Debug, Default)]
pub enum Console {
    /// The copies built into the binary.
    #[default]
    Embedded,
    /// A directory read on every request: edits show on reload, without a build.
    Dir(PathBuf),
    /// No console: `/` and `/console/...` answer 404.
    Off,
}

/// The paths under which the console is served; none needs a token.
pub const PAGE_PATH: &str = "/";
pub const ASSET_PREFIX: &str = "/console/";

/// What a page of this origin may load and where it may connect: only here, no inline
/// script or style, never inside another site's frame.
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// Whether `path` is one of the console's: served without a token.
pub fn is_console_path(path: &str) -> bool {
    path == PAGE_PATH || path.starts_with(ASSET_PREFIX)
}

pub(crate) async fn page(State(console): State<Console>) -> Response {
    serve(&console, "index.html").await
}

pub(crate) async fn asset(
    State(console): State<Console>,
    UrlPath(path): UrlPath<String>,
) -> Response {
    serve(&console, &path).await
}

async fn serve(console: &Console, path: &str) -> Response {
    let Some(relative) = safe_relative(path) else {
        return not_found();
    };
    let bytes = match console {
        Console::Off => None,
        Console::Embedded => Embedded::get(path).map(|f| f.data.into_owned()),
        Console::Dir(dir) => tokio::fs::read(dir.join(&relative)).await.ok(),
    };
    match bytes {
        Some(bytes) => {
            let mut response = (StatusCode::OK, bytes).into_response();
            let headers = response.headers_mut();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type(path)));
            // Small files that change with the binary: always asked again, never stale.
            headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            for (name, value) in [
                ("content-security-policy", CONTENT_SECURITY_POLICY),
                ("x-content-type-options", "nosniff"),
                ("referrer-policy", "no-referrer"),
                ("x-frame-options", "DENY"),
            ] {
                headers.insert(
                    HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                );
            }
            response
        }
        None => not_found(),
    }
}

fn not_found() -> Response {
    crate::ApiError::from(rein_ops::Error::not_found(
        "no such console file".to_owned(),
    ))
    .into_response()
}

/// `path` as a path below the console's directory: only plain names, so `..`, an absolute
/// path or an empty name never leave it.
fn safe_relative(path: &str) -> Option<PathBuf> {
    if path.is_empty() || path.len() > 256 || path.contains('\\') {
        return None;
    }
    let relative = Path::new(path);
    relative
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
        .then(|| relative.to_path_buf())
}

fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, ext)| ext) {
        Some("html") => "text/html; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("ico") => "image/x-icon",
        Some("json") => "application/json",
        Some("txt") => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// Every file of the embedded console, by its path below `console/`.
pub fn embedded_files() -> Vec<String> {
    Embedded::iter().map(|name| name.into_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_below_the_directory_are_served() {
        for good in ["index.html", "app.js", "views/runs.js"] {
            assert!(safe_relative(good).is_some(), "{good}");
        }
        for bad in [
            "",
            "../Cargo.toml",
            "/etc/passwd",
            "a/../../b",
            "./x",
            "a\\..\\b",
        ] {
            assert!(safe_relative(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn the_page_is_embedded() {
        assert!(embedded_files().iter().any(|f| f == "index.html"));
    }
}
