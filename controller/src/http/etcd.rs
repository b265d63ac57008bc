//! etcd clusters: a member's agent gets its member certificate for the cluster its spec names,
//! and learns whether it starts the cluster or where the members are to join through; an
//! operator gets a client certificate (for kube-apiserver, etcdctl) for a cluster that some
//! machine or pool declares. Certificates come from CSRs; keys never reach the controller.
//!
//! Exactly one machine ever starts a cluster: the first to ask while no member is reported
//! takes a claim (`/etcd-clusters/<cluster>`, created atomically) and keeps it; everyone else
//! joins through the members the cluster's machines report.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use keelson_api::machine::Machine;
use keelson_api::meta::Name;
use keelson_api::pool::MachinePool;
use keelson_api::validate::parse_name;
use keelson_api::wire::{EtcdCertificate, EtcdCertificateRequest, EtcdClusterInfo};
use serde::{Deserialize, Serialize};

use super::{App, JsonBody, PeerExt, require_admin, require_machine};
use crate::error::ApiError;
use crate::pki::{Authority, Issued, PkiError};
use crate::registry::{ETCD_CLUSTERS, MACHINES, POOLS, encode};
use crate::shared_ca::{self, SharedCaError};
use crate::store::{Op, Precondition, StoreError};

type ApiResult<T> = Result<T, ApiError>;

const MAX_COMMON_NAME_BYTES: usize = 64;
const MAX_MEMBER_ADDRESSES: usize = 16;

fn pki_error(e: PkiError) -> ApiError {
    match e {
        PkiError::BadCsr(m) => ApiError::invalid("csr", m),
        other => ApiError::Internal(other.to_string()),
    }
}

/// The CA of `cluster`, made sure to be the one every replica uses (crate::shared_ca).
async fn cluster_authority(app: &App, cluster: &Name) -> ApiResult<Arc<Authority>> {
    let key = format!("{}{cluster}", shared_ca::ETCD_CAS);
    let dir = app.etcd_pki.dir(cluster);
    let copy_it =
        || format!("copy {} from a replica that has issued certificates for it (docs/controller.md, \"Several replicas\")", dir.display());
    let had = shared_ca::present(&dir);
    if !had && shared_ca::recorded(&*app.registry.store, &key).await?.is_some() {
        return Err(ApiError::Unavailable(format!(
            "another controller replica made the CA of etcd cluster {cluster} and this one has no copy: {}",
            copy_it()
        )));
    }
    let authority = app.etcd_pki.authority(cluster).map_err(pki_error)?;
    match shared_ca::pin(&*app.registry.store, &key, &authority.cert_pem).await {
        Ok(()) => Ok(authority),
        Err(SharedCaError::Store(e)) => Err(e.into()),
        Err(SharedCaError::Mismatch { .. }) => {
            if !had {
                // Made just now, while another replica's was on its way to this one's view.
                app.etcd_pki.discard(cluster);
            }
            Err(ApiError::Unavailable(format!(
                "this replica's CA of etcd cluster {cluster} is not the one the other replicas use: {}",
                copy_it()
            )))
        }
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
    if req.addresses.len() > MAX_MEMBER_ADDRESSES {
        return Err(ApiError::invalid("addresses", format!("at most {MAX_MEMBER_ADDRESSES}")));
    }
    if let Some(bad) = req.addresses.iter().find(|a| a.parse::<std::net::IpAddr>().is_err()) {
        return Err(ApiError::invalid("addresses", format!("{bad:?} is not an IP address")));
    }
    // The member is already inside its cluster's trust: the addresses it advertises are its
    // own to name, with those it reported.
    let mut addresses = machine.status.facts.map(|f| f.addresses).unwrap_or_default();
    addresses.extend(req.addresses.iter().filter(|a| a.parse::<std::net::IpAddr>().is_ok()).cloned());
    let ca = cluster_authority(&app, &etcd.cluster).await?.cert_pem.clone();
    let issued = app.etcd_pki.issue_member(&etcd.cluster, &name, &req.csr, &addresses).map_err(pki_error)?;
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
    let ca = cluster_authority(&app, &cluster).await?.cert_pem.clone();
    let issued = app.etcd_pki.issue_client(&cluster, who, &req.csr).map_err(pki_error)?;
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

/// Who started an etcd cluster.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClusterClaim {
    initializer: Name,
}

/// `GET /v1/agent/etcd/cluster`: whether the calling machine starts its cluster, or the client
/// URLs of the voting members the cluster's other machines report.
pub async fn cluster_info(State(app): State<Arc<App>>, peer: PeerExt) -> ApiResult<Json<EtcdClusterInfo>> {
    let (name, _) = require_machine(&app, &peer).await?;
    let machine = app.registry.machine(name.as_str()).await?.object;
    let Some(etcd) = machine.spec.etcd else {
        return Err(ApiError::Forbidden(format!("machine {name} has no spec.etcd: it is not an etcd member")));
    };
    let cluster = etcd.cluster;
    let (machines, _) = app.registry.list::<Machine>(MACHINES).await?;
    let client_urls: Vec<String> = machines
        .iter()
        .map(|m| &m.object)
        .filter(|m| m.metadata.name.as_ref() != Some(&name))
        .filter(|m| m.spec.etcd.as_ref().is_some_and(|e| e.cluster == cluster))
        .filter_map(|m| m.status.etcd.as_ref().filter(|e| e.cluster == cluster && !e.learner).map(|e| e.client_url.clone()))
        .collect();
    let key = format!("{ETCD_CLUSTERS}{cluster}");
    let claim = app.registry.get::<ClusterClaim>(&key).await?.map(|c| c.object.initializer);
    let initializer = match claim {
        Some(holder) => holder,
        None if client_urls.is_empty() => {
            let mine = ClusterClaim { initializer: name.clone() };
            let put = Op::Put { key: key.clone(), value: encode(&mine), precondition: Precondition::Absent };
            match app.registry.store.txn(vec![put]).await {
                Ok(_) => {
                    tracing::info!(%cluster, machine = %name, "this machine starts the etcd cluster");
                    name.clone()
                }
                Err(StoreError::Conflict { .. }) => match app.registry.get::<ClusterClaim>(&key).await? {
                    Some(c) => c.object.initializer,
                    None => return Err(ApiError::Unavailable("the etcd cluster claim changed; ask again".into())),
                },
                Err(e) => return Err(e.into()),
            }
        }
        // Members exist from before claims were kept: nobody starts the cluster again.
        None => return Ok(Json(EtcdClusterInfo { cluster, initialize: false, initializer: None, client_urls })),
    };
    let initialize = initializer == name && client_urls.is_empty();
    Ok(Json(EtcdClusterInfo { cluster, initialize, initializer: Some(initializer), client_urls }))
}
