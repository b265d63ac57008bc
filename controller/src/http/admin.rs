//! Operator endpoints: machines, pools, tokens, events, watches and metrics.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use keelson_api::cluster::KubernetesCluster;
use keelson_api::machine::Machine;
use keelson_api::meta::Name;
use keelson_api::pool::{MachinePool, PoolRevision};
use keelson_api::token::BootstrapToken;
use keelson_api::validate::{parse_name, validate_cluster, validate_machine, validate_pool};
use keelson_api::wire::{Event, List, TokenCreated, TokenRequest, WatchEvent};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::{App, JsonBody, PeerExt, require_admin};
use crate::clusters::{CLUSTERS, redacted};
use crate::error::ApiError;
use crate::registry::{Deletion, HasMeta, MACHINES, POOLS, StoredToken, TOKENS, Versioned};
use crate::store::Entry;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    #[serde(default)]
    watch: bool,
    resource_version: Option<String>,
}

type ApiResult<T> = Result<T, ApiError>;

pub async fn metrics(State(app): State<Arc<App>>, peer: PeerExt) -> ApiResult<Response> {
    require_admin(&peer)?;
    let (machines, _) = app.registry.list::<Machine>(MACHINES).await?;
    let machines: Vec<Machine> = machines.into_iter().map(|m| m.object).collect();
    let body = app.metrics.render(&machines);
    Ok(([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], body).into_response())
}

fn path_name(name: &str) -> ApiResult<Name> {
    parse_name("metadata.name", name).map_err(ApiError::from)
}

/// The name in the path wins; a body that names another object is refused.
fn reconcile_name(path: &Name, body: &mut keelson_api::meta::ObjectMeta) -> ApiResult<()> {
    match &body.name {
        Some(n) if n != path => Err(ApiError::invalid("metadata.name", format!("{n} does not match the name in the URL, {path}"))),
        Some(_) => Ok(()),
        None => {
            body.name = Some(path.clone());
            Ok(())
        }
    }
}

// ---- machines

pub async fn list_machines(State(app): State<Arc<App>>, peer: PeerExt, Query(q): Query<ListQuery>) -> ApiResult<Response> {
    require_admin(&peer)?;
    if q.watch {
        return watch(app, MACHINES, q.resource_version.as_deref(), stamped_value::<Machine>).await;
    }
    let (items, revision) = app.registry.machines_as_seen().await?;
    Ok(Json(List { items: items.into_iter().map(Versioned::stamped).collect(), resource_version: revision.to_string() }).into_response())
}

pub async fn get_machine(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<Json<Machine>> {
    require_admin(&peer)?;
    let name = path_name(&name)?;
    Ok(Json(app.registry.machine_as_seen(name.as_str()).await?.stamped()))
}

pub async fn create_machine(State(app): State<Arc<App>>, peer: PeerExt, JsonBody(m): JsonBody<Machine>) -> ApiResult<Response> {
    require_admin(&peer)?;
    validate_machine(&m)?;
    let name = m.metadata.name_str().to_owned();
    if app.registry.get::<Machine>(&format!("{MACHINES}{name}")).await?.is_some() {
        return Err(ApiError::Conflict(format!("machine {name} already exists")));
    }
    let stored = app.registry.apply_machine(m).await?;
    Ok((StatusCode::CREATED, Json(stored.stamped())).into_response())
}

pub async fn put_machine(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    Path(name): Path<String>,
    JsonBody(mut m): JsonBody<Machine>,
) -> ApiResult<Json<Machine>> {
    require_admin(&peer)?;
    reconcile_name(&path_name(&name)?, &mut m.metadata)?;
    validate_machine(&m)?;
    Ok(Json(app.registry.apply_machine(m).await?.stamped()))
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    /// Delete at once, without the agent's reset (a machine that is gone for good).
    #[serde(default)]
    force: bool,
    /// The machine's etcd member leaves even when that costs the cluster its quorum or its
    /// last member.
    #[serde(default, rename = "forceEtcdLeave")]
    force_etcd_leave: bool,
}

/// 204 when the machine is gone; 202 with the machine when its agent resets it first.
pub async fn delete_machine(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    Path(name): Path<String>,
    Query(q): Query<DeleteQuery>,
) -> ApiResult<Response> {
    require_admin(&peer)?;
    let how = match (q.force, q.force_etcd_leave) {
        (true, true) => {
            return Err(ApiError::invalid(
                "forceEtcdLeave",
                "forceEtcdLeave: asks the agent to remove its member, while force skips the agent; choose one",
            ));
        }
        (true, false) => Deletion::Forget,
        (false, true) => Deletion::ResetForcingEtcdLeave,
        (false, false) => Deletion::Reset,
    };
    match app.registry.delete_machine(&path_name(&name)?, how).await? {
        None => Ok(StatusCode::NO_CONTENT.into_response()),
        Some(pending) => Ok((StatusCode::ACCEPTED, Json(pending.stamped())).into_response()),
    }
}

/// A machine's events; they outlive the machine, so a reset stays visible after it is gone.
pub async fn machine_events(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<Json<Vec<Event>>> {
    require_admin(&peer)?;
    let name = path_name(&name)?;
    let events = app.registry.events(name.as_str()).await?;
    if events.is_empty() {
        app.registry.machine(name.as_str()).await?;
    }
    Ok(Json(events))
}

// ---- pools

pub async fn list_pools(State(app): State<Arc<App>>, peer: PeerExt, Query(q): Query<ListQuery>) -> ApiResult<Response> {
    require_admin(&peer)?;
    if q.watch {
        return watch(app, POOLS, q.resource_version.as_deref(), stamped_value::<MachinePool>).await;
    }
    // Status is the rollout pass's record of the pool's progress.
    let (pools, revision) = app.registry.list::<MachinePool>(POOLS).await?;
    let items = pools.into_iter().map(Versioned::stamped).collect();
    Ok(Json(List { items, resource_version: revision.to_string() }).into_response())
}

pub async fn get_pool(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<Json<MachinePool>> {
    require_admin(&peer)?;
    Ok(Json(app.registry.pool(path_name(&name)?.as_str()).await?.stamped()))
}

/// The pool's kept revisions, oldest first.
pub async fn pool_revisions(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<Json<Vec<PoolRevision>>> {
    require_admin(&peer)?;
    Ok(Json(app.registry.revisions(path_name(&name)?.as_str()).await?))
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UndoRequest {
    #[serde(default)]
    pub to_revision: Option<u64>,
}

pub async fn undo_pool(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    Path(name): Path<String>,
    JsonBody(req): JsonBody<UndoRequest>,
) -> ApiResult<Json<MachinePool>> {
    require_admin(&peer)?;
    Ok(Json(app.registry.undo_pool(path_name(&name)?.as_str(), req.to_revision).await?.stamped()))
}

pub async fn pause_pool(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<Json<MachinePool>> {
    require_admin(&peer)?;
    Ok(Json(app.registry.set_paused(path_name(&name)?.as_str(), true).await?.stamped()))
}

pub async fn resume_pool(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<Json<MachinePool>> {
    require_admin(&peer)?;
    Ok(Json(app.registry.set_paused(path_name(&name)?.as_str(), false).await?.stamped()))
}

pub async fn create_pool(State(app): State<Arc<App>>, peer: PeerExt, JsonBody(p): JsonBody<MachinePool>) -> ApiResult<Response> {
    require_admin(&peer)?;
    validate_pool(&p)?;
    let name = p.metadata.name_str().to_owned();
    if app.registry.get::<MachinePool>(&format!("{POOLS}{name}")).await?.is_some() {
        return Err(ApiError::Conflict(format!("pool {name} already exists")));
    }
    Ok((StatusCode::CREATED, Json(app.registry.apply_pool(p).await?.stamped())).into_response())
}

pub async fn put_pool(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    Path(name): Path<String>,
    JsonBody(mut p): JsonBody<MachinePool>,
) -> ApiResult<Json<MachinePool>> {
    require_admin(&peer)?;
    reconcile_name(&path_name(&name)?, &mut p.metadata)?;
    validate_pool(&p)?;
    Ok(Json(app.registry.apply_pool(p).await?.stamped()))
}

pub async fn delete_pool(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<StatusCode> {
    require_admin(&peer)?;
    app.registry.delete_pool(&path_name(&name)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- Kubernetes clusters: answers never carry the kubeconfig (crate::clusters)

fn cluster_resource(v: Versioned<KubernetesCluster>) -> KubernetesCluster {
    redacted(v.stamped())
}

pub async fn list_clusters(State(app): State<Arc<App>>, peer: PeerExt) -> ApiResult<Json<List<KubernetesCluster>>> {
    require_admin(&peer)?;
    let (items, revision) = app.registry.list::<KubernetesCluster>(CLUSTERS).await?;
    Ok(Json(List { items: items.into_iter().map(cluster_resource).collect(), resource_version: revision.to_string() }))
}

pub async fn get_cluster(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<Json<KubernetesCluster>> {
    require_admin(&peer)?;
    Ok(Json(cluster_resource(app.registry.cluster(path_name(&name)?.as_str()).await?)))
}

pub async fn create_cluster(State(app): State<Arc<App>>, peer: PeerExt, JsonBody(c): JsonBody<KubernetesCluster>) -> ApiResult<Response> {
    require_admin(&peer)?;
    validate_cluster(&c)?;
    let name = c.metadata.name_str().to_owned();
    if app.registry.get::<KubernetesCluster>(&format!("{CLUSTERS}{name}")).await?.is_some() {
        return Err(ApiError::Conflict(format!("cluster {name} already exists")));
    }
    Ok((StatusCode::CREATED, Json(cluster_resource(app.registry.apply_cluster(c).await?))).into_response())
}

pub async fn put_cluster(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    Path(name): Path<String>,
    JsonBody(mut c): JsonBody<KubernetesCluster>,
) -> ApiResult<Json<KubernetesCluster>> {
    require_admin(&peer)?;
    reconcile_name(&path_name(&name)?, &mut c.metadata)?;
    Ok(Json(cluster_resource(app.registry.apply_cluster(c).await?)))
}

pub async fn delete_cluster(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<StatusCode> {
    require_admin(&peer)?;
    app.registry.delete_cluster(&path_name(&name)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- tokens

fn token_resource(v: Versioned<StoredToken>) -> BootstrapToken {
    Versioned { object: v.object.token, revision: v.revision }.stamped()
}

pub async fn list_tokens(State(app): State<Arc<App>>, peer: PeerExt) -> ApiResult<Json<List<BootstrapToken>>> {
    require_admin(&peer)?;
    let (items, revision) = app.registry.list::<StoredToken>(TOKENS).await?;
    Ok(Json(List { items: items.into_iter().map(token_resource).collect(), resource_version: revision.to_string() }))
}

pub async fn get_token(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<Json<BootstrapToken>> {
    require_admin(&peer)?;
    let name = path_name(&name)?;
    let stored = app
        .registry
        .get::<StoredToken>(&format!("{TOKENS}{name}"))
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("token {name:?} not found")))?;
    Ok(Json(token_resource(stored)))
}

pub async fn create_token(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    JsonBody(req): JsonBody<TokenRequest>,
) -> ApiResult<(StatusCode, Json<TokenCreated>)> {
    require_admin(&peer)?;
    Ok((StatusCode::CREATED, Json(app.registry.create_token(req).await?)))
}

pub async fn delete_token(State(app): State<Arc<App>>, peer: PeerExt, Path(name): Path<String>) -> ApiResult<StatusCode> {
    require_admin(&peer)?;
    let name = path_name(&name)?;
    match app
        .registry
        .store
        .txn(vec![crate::store::Op::Delete { key: format!("{TOKENS}{name}"), precondition: crate::store::Precondition::Exists }])
        .await
    {
        Ok(_) => Ok(StatusCode::NO_CONTENT),
        Err(crate::store::StoreError::Conflict { .. }) => Err(ApiError::NotFound(format!("token {name:?} not found"))),
        Err(e) => Err(e.into()),
    }
}

// ---- watch

fn stamped_value<T: DeserializeOwned + serde::Serialize + HasMeta>(e: &Entry) -> Option<serde_json::Value> {
    let object: T = serde_json::from_slice(&e.value).ok()?;
    serde_json::to_value(Versioned { object, revision: e.mod_revision }.stamped()).ok()
}

/// Streams changes under `prefix` after `resourceVersion` as newline-delimited JSON. A
/// watcher that falls behind, or asks for a compacted revision, gets an ERROR event (or 410)
/// and lists again.
async fn watch(
    app: Arc<App>,
    prefix: &'static str,
    from: Option<&str>,
    render: fn(&Entry) -> Option<serde_json::Value>,
) -> ApiResult<Response> {
    let from = match from {
        Some(s) => s.parse::<u64>().map_err(|_| ApiError::invalid("resourceVersion", format!("{s:?} is not a resourceVersion")))?,
        None => app.registry.store.revision(),
    };
    let mut watch = app.registry.store.watch(prefix, from).await?;
    let shutdown = app.shutdown.clone();
    let stream = async_stream(move |tx| async move {
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = watch.next() => next,
            };
            let event = match next {
                None => return,
                Some(Err(e)) => {
                    WatchEvent { type_: "ERROR".into(), object: serde_json::json!({"reason": "Gone", "message": e.to_string()}) }
                }
                Some(Ok(change)) => {
                    let Some(object) = render(&change.entry) else { continue };
                    let type_ = if change.deleted {
                        "DELETED"
                    } else if change.entry.create_revision == change.entry.mod_revision {
                        "ADDED"
                    } else {
                        "MODIFIED"
                    };
                    WatchEvent { type_: type_.into(), object }
                }
            };
            let is_error = event.type_ == "ERROR";
            let mut line = serde_json::to_vec(&event).unwrap_or_default();
            line.push(b'\n');
            if tx.send(Ok(line)).await.is_err() || is_error {
                return;
            }
        }
    });
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(stream)).into_response())
}

/// A stream fed by a task through a small channel; the task ends when the client goes away.
fn async_stream<F, Fut>(produce: F) -> tokio_stream::wrappers::ReceiverStream<Result<Vec<u8>, std::io::Error>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Vec<u8>, std::io::Error>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(produce(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

pub async fn list_leases(State(app): State<Arc<App>>, peer: PeerExt) -> ApiResult<Json<Vec<crate::leases::Lease>>> {
    require_admin(&peer)?;
    Ok(Json(app.registry.leases().await?))
}
