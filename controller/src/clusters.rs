//! Kubernetes clusters whose nodes are keelson machines: their kubeconfigs, which only the
//! controller holds (DESIGN.md, "Kubernetes nodes"), and the pools linked to them.
//!
//! A cluster is stored as given, kubeconfig included, under `/clusters/<name>`: whoever can
//! read the controller's store can read it, as they can read its CA key. Every answer leaves
//! the kubeconfig out (`redacted`), and nothing is ever sent to an agent.
//!
//! A pool links to a cluster with `spec.kubernetes.cluster`: the pool's write checks that the
//! cluster exists, and a cluster with linked pools is not deleted. (A pool linked while its
//! cluster is being deleted can still end up linked to none; what uses the link says so.)

use keelson_api::cluster::KubernetesCluster;
use keelson_api::machine::Machine;
use keelson_api::meta::{self, Name};
use keelson_api::pool::MachinePool;
use keelson_api::validate::validate_cluster;

use crate::error::ApiError;
use crate::registry::{CAS_ATTEMPTS, POOLS, Registry, Versioned, encode, new_uid, not_found, parse_resource_version};
use crate::store::{Op, Precondition, StoreError};

pub const CLUSTERS: &str = "/clusters/";

/// A cluster as answered: without its kubeconfig.
pub fn redacted(mut cluster: KubernetesCluster) -> KubernetesCluster {
    cluster.spec.kubeconfig.clear();
    cluster
}

/// The name of a machine's Kubernetes node: the annotation when set, else the hostname its
/// agent reported (lowercased, as the kubelet registers it). `None` before the first report.
pub fn node_name(machine: &Machine) -> Option<String> {
    if let Some(name) = machine.metadata.annotations.get(keelson_api::meta::annotation::NODE_NAME) {
        return Some(name.clone());
    }
    let hostname = machine.status.facts.as_ref()?.hostname.as_deref()?.trim();
    (!hostname.is_empty()).then(|| hostname.to_lowercase())
}

impl Registry {
    /// Creates or updates a cluster, after reading its kubeconfig. `metadata.resourceVersion`,
    /// when given, makes the write conditional.
    pub async fn apply_cluster(&self, input: KubernetesCluster) -> Result<Versioned<KubernetesCluster>, ApiError> {
        let access = validate_cluster(&input)?;
        let name = input.metadata.name_str().to_owned();
        let expected = parse_resource_version(input.metadata.resource_version.as_deref())?;
        let key = format!("{CLUSTERS}{name}");
        for _ in 0..CAS_ATTEMPTS {
            let current: Option<Versioned<KubernetesCluster>> = self.get(&key).await?;
            if let Some(rv) = expected
                && current.as_ref().map(|c| c.revision) != Some(rv)
            {
                return Err(ApiError::Conflict(format!("cluster {name} changed since resourceVersion {rv}: read it again")));
            }
            let (cluster, precondition) = match current {
                Some(cur) => {
                    let mut c = cur.object;
                    if c.spec != input.spec {
                        c.metadata.generation += 1;
                        c.spec = input.spec.clone();
                    }
                    c.metadata.labels = input.metadata.labels.clone();
                    c.metadata.annotations = input.metadata.annotations.clone();
                    (c, Precondition::Revision(cur.revision))
                }
                None => {
                    let mut c = input.clone();
                    c.metadata.generation = 1;
                    c.metadata.resource_version = None;
                    c.metadata.uid = Some(new_uid());
                    c.metadata.creation_timestamp = Some(meta::now());
                    (c, Precondition::Absent)
                }
            };
            let cluster = KubernetesCluster { status: access.status(), ..cluster };
            match self.store.txn(vec![Op::Put { key: key.clone(), value: encode(&cluster), precondition }]).await {
                Ok(revision) => return Ok(Versioned { object: cluster, revision }),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("cluster {name} is changing too often to update; try again")))
    }

    pub async fn cluster(&self, name: &str) -> Result<Versioned<KubernetesCluster>, ApiError> {
        self.get(&format!("{CLUSTERS}{name}")).await?.ok_or_else(|| not_found("cluster", name))
    }

    /// Deletes a cluster no pool is linked to.
    pub async fn delete_cluster(&self, name: &Name) -> Result<(), ApiError> {
        let cluster = self.cluster(name.as_str()).await?;
        let (pools, _) = self.list::<MachinePool>(POOLS).await?;
        let linked: Vec<&str> = pools
            .iter()
            .filter(|p| p.object.spec.kubernetes.as_ref().is_some_and(|k| &k.cluster == name))
            .map(|p| p.object.metadata.name_str())
            .collect();
        if !linked.is_empty() {
            return Err(ApiError::Conflict(format!(
                "cluster {name} is linked to pool {}: unlink them (spec.kubernetes) first",
                linked.join(", ")
            )));
        }
        let key = format!("{CLUSTERS}{name}");
        match self.store.txn(vec![Op::Delete { key, precondition: Precondition::Revision(cluster.revision) }]).await {
            Ok(_) => Ok(()),
            Err(StoreError::Conflict { .. }) => Err(ApiError::Conflict(format!("cluster {name} changed while being deleted; try again"))),
            Err(e) => Err(e.into()),
        }
    }

    /// The check a pool linked to `cluster` adds to its write: the cluster exists.
    pub(crate) async fn cluster_link(&self, pool: &MachinePool) -> Result<Option<Op>, ApiError> {
        let Some(k) = &pool.spec.kubernetes else { return Ok(None) };
        let key = format!("{CLUSTERS}{}", k.cluster);
        match self.store.get(&key).await? {
            Some(_) => Ok(Some(Op::Check { key, precondition: Precondition::Exists })),
            None => Err(ApiError::invalid(
                "spec.kubernetes.cluster",
                format!("no cluster {} is registered (keelson cluster register {} --kubeconfig FILE)", k.cluster, k.cluster),
            )),
        }
    }
}
