//! etcd certificates: a member's agent gets its member certificate for the cluster its spec
//! names; an operator gets a client certificate (for kube-apiserver, etcdctl) for a cluster
//! that some machine or pool declares. Both send CSRs; keys never reach the controller.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use keelson_api::machine::Machine;
use keelson_api::meta::Name;
use keelson_api::pool::MachinePool;
use keelson_api::validate::parse_name;
use keelson_api::wire::{EtcdCertificate, EtcdCertificateRequest};

use super::{App, JsonBody, PeerExt, require_admin, require_machine};
use crate::error::ApiError;
use crate::pki::{Issued, PkiError};
use crate::registry::{MACHINES, POOLS};

type ApiResult<T> = Result<T, ApiError>;

const MAX_COMMON_NAME_BYTES: usize = 64;

fn pki_error(e: PkiError) -> ApiError {
    match e {
        PkiError::BadCsr(m) => ApiError::invalid("csr", m),
        other => ApiError::Internal(other.to_string()),
    }
}

fn answer(cluster: Name, ca: String, issued: Issued) -> Json<EtcdCertificate> {
    Json(EtcdCertificate { cluster, certificate: issued.cert_pem, ca, not_after: issued.not_after })
}

/// `POST /v1/agent/etcd/certificate`: the member certificate of the calling machine, for the
/// cluster in its spec, naming its addresses as last reported.
pub async fn member_certificate(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    JsonBody(req): JsonBody<EtcdCertificateRequest>,
) -> ApiResult<Json<EtcdCertificate>> {
    let (name, _) = require_machine(&app, &peer).await?;
    if req.common_name.is_some() {
        return Err(ApiError::invalid("commonName", "a member certificate is named after its machine"));
    }
    let machine = app.registry.machine(name.as_str()).await?.object;
    let Some(etcd) = machine.spec.etcd else {
        return Err(ApiError::Forbidden(format!("machine {name} has no spec.etcd: it is not an etcd member")));
    };
    let addresses = machine.status.facts.map(|f| f.addresses).unwrap_or_default();
    let issued = app.etcd_pki.issue_member(&etcd.cluster, &name, &req.csr, &addresses).map_err(pki_error)?;
    let ca = app.etcd_pki.authority(&etcd.cluster).map_err(pki_error)?.cert_pem.clone();
    tracing::info!(machine = %name, cluster = %etcd.cluster, serial = %issued.serial, "issued an etcd member certificate");
    Ok(answer(etcd.cluster, ca, issued))
}

/// `POST /v1/etcd/{cluster}/client-certificates` (admin): a client certificate for a cluster
/// that a machine or a pool template declares.
pub async fn client_certificate(
    State(app): State<Arc<App>>,
    peer: PeerExt,
    Path(cluster): Path<String>,
    JsonBody(req): JsonBody<EtcdCertificateRequest>,
) -> ApiResult<Json<EtcdCertificate>> {
    require_admin(&peer)?;
    let cluster = parse_name("cluster", &cluster)?;
    let who = req.common_name.as_deref().unwrap_or_default();
    if who.is_empty() || who.len() > MAX_COMMON_NAME_BYTES || !who.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:@".contains(c)) {
        return Err(ApiError::invalid(
            "commonName",
            format!("must be 1 to {MAX_COMMON_NAME_BYTES} characters of letters, digits and -_.:@"),
        ));
    }
    if !cluster_declared(&app, &cluster).await? {
        return Err(ApiError::NotFound(format!("no machine or pool declares etcd cluster {cluster}")));
    }
    let issued = app.etcd_pki.issue_client(&cluster, who, &req.csr).map_err(pki_error)?;
    let ca = app.etcd_pki.authority(&cluster).map_err(pki_error)?.cert_pem.clone();
    tracing::info!(%cluster, client = who, serial = %issued.serial, "issued an etcd client certificate");
    Ok(answer(cluster, ca, issued))
}

async fn cluster_declared(app: &App, cluster: &Name) -> ApiResult<bool> {
    let (machines, _) = app.registry.list::<Machine>(MACHINES).await?;
    if machines.iter().any(|m| m.object.spec.etcd.as_ref().is_some_and(|e| &e.cluster == cluster)) {
        return Ok(true);
    }
    let (pools, _) = app.registry.list::<MachinePool>(POOLS).await?;
    Ok(pools.iter().any(|p| p.object.spec.template.spec.etcd.as_ref().is_some_and(|e| &e.cluster == cluster)))
}
