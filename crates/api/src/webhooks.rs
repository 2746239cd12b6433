//! Routes for webhooks: the registered ones (never their secrets) and their deliveries, for
//! operators. Webhooks are added and removed with `rein webhooks` against the database.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Query, State};
use chrono::{DateTime, Utc};
use rein_ops::ErrorBody;
use rein_ops::schema;
use rein_store::Scope;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::extract::query;
use crate::{ApiError, App, Caller};

/// A registered webhook, without its secret.
#[derive(Serialize, ToSchema)]
pub struct WebhookView {
    pub webhook_id: Uuid,
    /// Where deliveries are POSTed.
    pub url: String,
    /// The kinds delivered; empty: every kind.
    #[schema(value_type = Vec<DeliveryKind>)]
    pub kinds: Vec<String>,
    /// Only runs of this definition; null: every definition.
    pub definition: Option<String>,
    /// Only runs on this queue; null: every queue.
    pub queue: Option<String>,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
}

impl From<rein_store::Webhook> for WebhookView {
    fn from(w: rein_store::Webhook) -> WebhookView {
        WebhookView {
            webhook_id: w.webhook_id,
            url: w.url,
            kinds: w.kinds,
            definition: w.definition,
            queue: w.queue,
            created_at: w.created_at,
            created_by: w.created_by,
        }
    }
}

/// What a delivery announces.
#[derive(Serialize, ToSchema)]
// Documents the kinds in the OpenAPI document; the rows carry the store's names.
#[allow(dead_code)]
pub enum DeliveryKind {
    #[serde(rename = "approval.requested")]
    ApprovalRequested,
    #[serde(rename = "approval.reminder")]
    ApprovalReminder,
    #[serde(rename = "approval.expired")]
    ApprovalExpired,
    #[serde(rename = "approval.decided")]
    ApprovalDecided,
    #[serde(rename = "run.finished")]
    RunFinished,
    #[serde(rename = "run.failed")]
    RunFailed,
}

/// Where a delivery stands.
#[derive(Serialize, Deserialize, ToSchema, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Not yet accepted; another attempt is due at `next_attempt_at`.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// The attempts are used up (or the webhook was removed).
    Failed,
}

impl DeliveryStatus {
    fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
        }
    }
}

/// One delivery of a webhook: the id the receiver deduplicates by, and its attempts so far.
#[derive(Serialize, ToSchema)]
pub struct DeliveryView {
    pub delivery_id: Uuid,
    pub webhook_id: Uuid,
    /// The webhook's URL.
    pub url: String,
    #[schema(value_type = DeliveryKind)]
    pub kind: String,
    pub run_id: Uuid,
    #[schema(value_type = DeliveryStatus)]
    pub status: String,
    pub attempts: i32,
    /// The receiver's last HTTP status; null when it never answered.
    pub last_status_code: Option<i32>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub next_attempt_at: DateTime<Utc>,
}

impl From<rein_store::WebhookDelivery> for DeliveryView {
    fn from(d: rein_store::WebhookDelivery) -> DeliveryView {
        DeliveryView {
            delivery_id: d.delivery_id,
            webhook_id: d.webhook_id,
            url: d.url,
            kind: d.kind,
            run_id: d.run_id,
            status: d.status,
            attempts: d.attempts,
            last_status_code: d.last_status_code,
            last_error: d.last_error,
            created_at: d.created_at,
            delivered_at: d.delivered_at,
            next_attempt_at: d.next_attempt_at,
        }
    }
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeliveriesQuery {
    /// Only deliveries in this status.
    status: Option<DeliveryStatus>,
    /// At most this many, newest first (default 50).
    #[param(value_type = Option<schema::PageLimit>, inline)]
    limit: Option<i64>,
}

/// The live webhooks (added with `rein webhooks add`), oldest first. Secrets are never shown.
#[utoipa::path(get, path = "/v1/webhooks", tag = "fleet",
    responses((status = 200, description = "The webhooks", body = [WebhookView]),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope", body = ErrorBody)))]
pub async fn list_webhooks(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Vec<WebhookView>>, ApiError> {
    caller.require(Scope::Operate)?;
    let hooks = rein_ops::service::webhooks(&app.store).await?;
    Ok(Json(hooks.into_iter().map(WebhookView::from).collect()))
}

/// Webhook deliveries, newest first, with their webhook's URL, attempts and the receiver's
/// last answer.
#[utoipa::path(get, path = "/v1/webhooks/deliveries", tag = "fleet", params(DeliveriesQuery),
    responses((status = 200, description = "The deliveries", body = [DeliveryView]),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope", body = ErrorBody),
              (status = 422, description = "Invalid query", body = ErrorBody)))]
pub async fn list_deliveries(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    q: Result<Query<DeliveriesQuery>, QueryRejection>,
) -> Result<Json<Vec<DeliveryView>>, ApiError> {
    caller.require(Scope::Operate)?;
    let q = query(q)?;
    let rows = rein_ops::service::webhook_deliveries(
        &app.store,
        q.status.map(DeliveryStatus::as_str),
        q.limit,
    )
    .await?;
    Ok(Json(rows.into_iter().map(DeliveryView::from).collect()))
}
