//! Machine endpoints: enrollment, the spec long-poll, status, events and certificate rotation.
//! A machine identity reaches only its own machine.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use keelson_api::machine::Machine;
use keelson_api::meta::{Name, annotation};
use keelson_api::wire::{AgentEvents, AgentSpec, AgentStatus, EnrollRequest, EnrollResponse, ResetDone};
use serde::Deserialize;

use super::{App, JsonBody, PeerExt, require_machine};
use crate::error::ApiError;

type ApiResult<T> = Result<T, ApiError>;

/// Events an agent may send in one request.
const MAX_EVENTS_PER_REQUEST: usize = 100;
const MAX_EVENT_MESSAGE_BYTES: usize = 8 * 1024;

pub async fn enroll(State(app): State<Arc<App>>, JsonBody(req): JsonBody<EnrollRequest>) -> ApiResult<Json<EnrollResponse>> {
    Ok(Json(app.registry.enroll(req).await?))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SpecQuery {
    #[serde(default)]
    after: u64,
    timeout_seconds: Option<u64>,
}

/// Answers at once when the machine's generation is newer than `after`; otherwise waits until
/// it changes or the timeout passes (then `changed: false`).
pub async fn spec(State(app): State<Arc<App>>, peer: PeerExt, Query(q): Query<SpecQuery>) -> ApiResult<Json<AgentSpec>> {
    let (name, _) = require_machine(&app, &peer).await?;
    let wait = q.timeout_seconds.map_or(app.config.long_poll_default, Duration::from_secs).min(app.config.long_poll_max);
    let deadline = tokio::time::Instant::now() + wait;
    let mut generations = app.waiters.subscribe(name.as_str());
    let mut timed_out = false;
    loop {
        // Read afresh after every wake, the timeout's too: a fleet's worth of waiting
        // long-polls holds no decoded machines (about 2 KiB each), and a change that lands
        // with the timeout is still answered as one.
        {
            let machine = app.registry.machine(name.as_str()).await?.object;
            let changed = machine.metadata.generation > q.after;
            if changed || timed_out {
                return Ok(Json(agent_spec(name, machine, changed)));
            }
        }
        timed_out = tokio::select! {
            changed = generations.changed() => changed.is_err(),
            _ = tokio::time::sleep_until(deadline) => true,
            _ = app.shutdown.cancelled() => true,
        };
    }
}

fn agent_spec(name: Name, machine: Machine, changed: bool) -> AgentSpec {
    let deleting = machine.metadata.deletion_timestamp.is_some();
    let force_etcd_leave = deleting && machine.metadata.annotations.get(annotation::FORCE_ETCD_LEAVE).is_some_and(|v| v == "true");
    AgentSpec { name, generation: machine.metadata.generation, changed, spec: machine.spec, deleting, force_etcd_leave }
}

/// The agent has reset its machine after a deletion: the controller forgets the machine and
/// revokes its identity (its events stay).
pub async fn reset_done(State(app): State<Arc<App>>, peer: PeerExt, JsonBody(req): JsonBody<ResetDone>) -> ApiResult<StatusCode> {
    let (name, _) = require_machine(&app, &peer).await?;
    if req.summary.len() > 8192 {
        return Err(ApiError::invalid("summary", "must be at most 8 KiB"));
    }
    app.registry.complete_reset(&name, &req.summary).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn status(State(app): State<Arc<App>>, peer: PeerExt, JsonBody(report): JsonBody<AgentStatus>) -> ApiResult<StatusCode> {
    let (name, _) = require_machine(&app, &peer).await?;
    app.registry.record_status(&name, report).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn events(State(app): State<Arc<App>>, peer: PeerExt, JsonBody(mut body): JsonBody<AgentEvents>) -> ApiResult<StatusCode> {
    let (name, _) = require_machine(&app, &peer).await?;
    if body.events.len() > MAX_EVENTS_PER_REQUEST {
        return Err(ApiError::invalid("events", format!("at most {MAX_EVENTS_PER_REQUEST} events per request")));
    }
    for (i, e) in body.events.iter_mut().enumerate() {
        if !matches!(e.type_.as_str(), "Normal" | "Warning") {
            return Err(ApiError::invalid(format!("events[{i}].type"), format!("{:?} is not Normal or Warning", e.type_)));
        }
        if e.message.len() > MAX_EVENT_MESSAGE_BYTES {
            let mut cut = MAX_EVENT_MESSAGE_BYTES;
            while !e.message.is_char_boundary(cut) {
                cut -= 1;
            }
            e.message.truncate(cut);
            e.message.push_str("… (truncated)");
        }
        // The machine speaks for itself only as the agent.
        e.source = "agent".into();
    }
    app.registry.append_events(name.as_str(), body.events).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RotateRequest {
    csr: String,
}

pub async fn rotate_certificate(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    JsonBody(req): JsonBody<RotateRequest>,
) -> ApiResult<Json<EnrollResponse>> {
    let (name, serial) = require_machine(&app, &peer).await?;
    Ok(Json(app.registry.rotate_certificate(&name, &serial, &req.csr).await?))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseRequest {
    reason: String,
    ttl_seconds: u64,
}

/// 201 with the lease when the budget allows; 429 with the reason to wait otherwise.
pub async fn acquire_disruption(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    JsonBody(req): JsonBody<LeaseRequest>,
) -> ApiResult<axum::response::Response> {
    use axum::response::IntoResponse;
    let (name, _) = require_machine(&app, &peer).await?;
    if req.reason.is_empty() || req.reason.len() > 256 {
        return Err(ApiError::invalid("reason", "must be 1 to 256 characters"));
    }
    match app.registry.acquire_lease(&name, &req.reason, req.ttl_seconds).await? {
        crate::leases::Decision::Granted(lease) => Ok((StatusCode::CREATED, Json(lease)).into_response()),
        crate::leases::Decision::Wait { message } => Ok((
            StatusCode::TOO_MANY_REQUESTS,
            Json(keelson_api::wire::ErrorBody { reason: "DisruptionBudget".into(), message, field: None }),
        )
            .into_response()),
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewRequest {
    ttl_seconds: u64,
}

pub async fn renew_disruption(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    axum::extract::Path(id): axum::extract::Path<String>,
    JsonBody(req): JsonBody<RenewRequest>,
) -> ApiResult<Json<crate::leases::Lease>> {
    let (name, _) = require_machine(&app, &peer).await?;
    let lease = app.registry.update_lease(&name, &id, Some(req.ttl_seconds)).await?;
    lease.map(Json).ok_or_else(|| ApiError::Internal("renewal returned no lease".into()))
}

pub async fn release_disruption(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> ApiResult<StatusCode> {
    let (name, _) = require_machine(&app, &peer).await?;
    app.registry.update_lease(&name, &id, None).await?;
    Ok(StatusCode::NO_CONTENT)
}
