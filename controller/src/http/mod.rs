//! The controller's HTTPS API: routing, authentication of the peer, request bodies and
//! metrics. Handlers live in `admin` (operators) and `agent` (machines).

mod admin;
mod agent;
mod etcd;
pub mod server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post, put};
use axum::{Extension, Router};
use keelson_api::meta::Name;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::pki::Peer;
use crate::registry::Registry;
use crate::waiters::SpecWaiters;

/// Request bodies larger than this are refused with 413.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// How long a spec long-poll waits when the agent does not say.
    pub long_poll_default: Duration,
    /// The longest wait an agent may ask for.
    pub long_poll_max: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig { long_poll_default: Duration::from_secs(60), long_poll_max: Duration::from_secs(300) }
    }
}

#[derive(Debug)]
pub struct App {
    pub registry: Registry,
    pub waiters: Arc<SpecWaiters>,
    pub metrics: Metrics,
    pub config: ApiConfig,
    /// The etcd clusters' certificate authorities.
    pub etcd_pki: crate::etcd_pki::EtcdAuthorities,
    /// Cancelled at shutdown, so that long-polls and watches end promptly.
    pub shutdown: CancellationToken,
}

pub fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/metrics", get(admin::metrics))
        .route("/v1/enroll", post(agent::enroll))
        .route("/v1/agent/spec", get(agent::spec))
        .route("/v1/agent/status", put(agent::status))
        .route("/v1/agent/events", post(agent::events))
        .route("/v1/agent/certificate", post(agent::rotate_certificate))
        .route("/v1/agent/reset", post(agent::reset_done))
        .route("/v1/agent/etcd/certificate", post(etcd::member_certificate))
        .route("/v1/agent/etcd/cluster", get(etcd::cluster_info))
        .route("/v1/etcd/{cluster}/client-certificates", post(etcd::client_certificate))
        .route("/v1/agent/disruptions", post(agent::acquire_disruption))
        .route("/v1/agent/disruptions/{id}", put(agent::renew_disruption).delete(agent::release_disruption))
        .route("/v1/leases", get(admin::list_leases))
        .route("/v1/machines", get(admin::list_machines).post(admin::create_machine))
        .route("/v1/machines/{name}", get(admin::get_machine).put(admin::put_machine).delete(admin::delete_machine))
        .route("/v1/machines/{name}/events", get(admin::machine_events))
        .route("/v1/pools", get(admin::list_pools).post(admin::create_pool))
        .route("/v1/pools/{name}", get(admin::get_pool).put(admin::put_pool).delete(admin::delete_pool))
        .route("/v1/pools/{name}/revisions", get(admin::pool_revisions))
        .route("/v1/pools/{name}/rollout/undo", post(admin::undo_pool))
        .route("/v1/pools/{name}/rollout/pause", post(admin::pause_pool))
        .route("/v1/pools/{name}/rollout/resume", post(admin::resume_pool))
        .route("/v1/clusters", get(admin::list_clusters).post(admin::create_cluster))
        .route("/v1/clusters/{name}", get(admin::get_cluster).put(admin::put_cluster).delete(admin::delete_cluster))
        .route("/v1/tokens", get(admin::list_tokens).post(admin::create_token))
        .route("/v1/tokens/{name}", get(admin::get_token).delete(admin::delete_token))
        .route_layer(axum::middleware::from_fn_with_state(app.clone(), track));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(api)
        .fallback(|| async { ApiError::NotFound("no such API path".into()) })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

async fn track(State(app): State<Arc<App>>, path: Option<MatchedPath>, req: Request, next: Next) -> Response {
    let route = path.map(|p| p.as_str().to_owned()).unwrap_or_else(|| "unmatched".into());
    let method = req.method().as_str().to_owned();
    let started = Instant::now();
    let response = next.run(req).await;
    app.metrics.observe_request(&route, &method, response.status().as_u16(), started.elapsed());
    response
}

/// A JSON request body, decoded with errors that name the field, within the size limit.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::TooLarge(format!("request body is larger than {MAX_BODY_BYTES} bytes"))
            } else {
                ApiError::invalid("", format!("could not read the request body: {e}"))
            }
        })?;
        keelson_api::decode::from_json(&bytes).map(JsonBody).map_err(ApiError::from)
    }
}

/// The authenticated operator, or 401/403.
pub fn require_admin(peer: &Peer) -> Result<(), ApiError> {
    match peer {
        Peer::Admin { .. } => Ok(()),
        Peer::Anonymous => Err(ApiError::Unauthorized("a client certificate is required".into())),
        Peer::Machine { name, .. } => Err(ApiError::Forbidden(format!("machine {name} may not use the admin API"))),
        Peer::Unrecognised { subject } => Err(ApiError::Forbidden(format!("certificate {subject} has no keelson role"))),
    }
}

/// The authenticated machine, whose certificate must be its current one.
pub async fn require_machine(app: &App, peer: &Peer) -> Result<(Name, String), ApiError> {
    match peer {
        Peer::Machine { name, serial } => {
            if app.registry.identity_is_current(name, serial).await? {
                Ok((name.clone(), serial.clone()))
            } else {
                Err(ApiError::Forbidden(format!("certificate {serial} no longer identifies machine {name} (re-enrolled or deleted)")))
            }
        }
        Peer::Anonymous => Err(ApiError::Unauthorized("a machine client certificate is required".into())),
        Peer::Admin { .. } => Err(ApiError::Forbidden("this endpoint is for machines' agents".into())),
        Peer::Unrecognised { subject } => Err(ApiError::Forbidden(format!("certificate {subject} has no keelson role"))),
    }
}

pub type PeerExt = Extension<Peer>;
