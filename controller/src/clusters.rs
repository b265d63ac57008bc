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
use keelson_api::version::KubeVersion;

use crate::error::ApiError;
use crate::registry::{CAS_ATTEMPTS, POOLS, Registry, Versioned, after_conflict, encode, new_uid, not_found, parse_resource_version};
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
        for attempt in 0..CAS_ATTEMPTS {
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
            // The API server's version stays known while the kubeconfig points at the same one.
            let mut status = access.status();
            if status.server == cluster.status.server {
                status.server_version = cluster.status.server_version.clone();
            }
            let cluster = KubernetesCluster { status, ..cluster };
            match self.store.txn(vec![Op::Put { key: key.clone(), value: encode(&cluster), precondition }]).await {
                Ok(revision) => return Ok(Versioned { object: cluster, revision }),
                Err(StoreError::Conflict { .. }) => {
                    after_conflict(attempt).await;
                    continue;
                }
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
        match self.get::<KubernetesCluster>(&key).await? {
            Some(cluster) => {
                self.check_skew(pool, &cluster.object).await?;
                Ok(Some(Op::Check { key, precondition: Precondition::Exists }))
            }
            None => Err(ApiError::invalid(
                "spec.kubernetes.cluster",
                format!("no cluster {} is registered (keelson cluster register {} --kubeconfig FILE)", k.cluster, k.cluster),
            )),
        }
    }
}

impl Registry {
    /// The version skew policy when a pool is applied: a kubelet (or kubeadm) newer than the API
    /// server is refused unless a control-plane pool of the cluster is taking the server there
    /// (the rollout then waits for it), and one more than three minors older is refused.
    async fn check_skew(&self, pool: &MachinePool, cluster: &KubernetesCluster) -> Result<(), ApiError> {
        let Some(server) = &cluster.status.server_version else { return Ok(()) };
        if is_control_plane(pool) {
            return Ok(());
        }
        let name = cluster.metadata.name_str();
        let mut newer = Vec::new();
        for (what, version) in node_components(pool) {
            let at = format!("spec.template.spec.{what}.version");
            match skew(version, server) {
                Skew::Within => {}
                Skew::TooOld => {
                    return Err(ApiError::invalid(
                        at,
                        format!("{version} is more than three minor versions older than cluster {name}'s API server ({server})"),
                    ));
                }
                Skew::Newer => newer.push((at, version)),
            }
        }
        let Some((at, version)) = newer.into_iter().next() else { return Ok(()) };
        let (pools, _) = self.list::<MachinePool>(POOLS).await?;
        let heading = control_plane_pools(pool, &pools)
            .iter()
            .flat_map(|p| node_components(p).into_iter().map(|(_, v)| v))
            .any(|v| minor_of(v) >= minor_of(version));
        if heading {
            return Ok(());
        }
        Err(ApiError::invalid(
            at,
            format!(
                "{version} would be newer than cluster {name}'s API server ({server}), and no control-plane pool of the cluster is \
                 upgrading to it: upgrade the control plane first"
            ),
        ))
    }
}

/// The versioned Kubernetes components of a pool's template that the skew policy holds to the
/// API server: the kubelet, and kubeadm (whose `upgrade node` a worker runs only once the
/// control plane is at its version).
fn node_components(pool: &MachinePool) -> Vec<(&'static str, &KubeVersion)> {
    let spec = &pool.spec.template.spec;
    let kubelet = spec.kubelet.as_ref().map(|k| ("kubelet", &k.version));
    let kubeadm = spec.kubeadm.as_ref().map(|k| ("kubeadm", &k.version));
    kubelet.into_iter().chain(kubeadm).collect()
}

/// The version skew policy for a pool of a cluster's nodes (DESIGN.md, "Kubernetes nodes"):
/// why the pool's kubelet (or kubeadm) may not roll out now, if it may not. Control-plane pools
/// upgrade the API server with their own kubelets, so only other pools are held to the server's
/// version: a kubelet is never newer than the API server, nor more than three minors older.
pub fn skew_hold(pool: &MachinePool, clusters: &[Versioned<KubernetesCluster>]) -> Option<String> {
    let k = pool.spec.kubernetes.as_ref()?;
    let components = node_components(pool);
    if components.is_empty() || is_control_plane(pool) {
        return None;
    }
    let Some(cluster) = clusters.iter().find(|c| c.object.metadata.name.as_ref() == Some(&k.cluster)) else {
        return Some(format!("cluster {} is not registered", k.cluster));
    };
    let Some(server) = &cluster.object.status.server_version else {
        return Some(format!("waiting to read the version of cluster {}'s API server (kubelet version skew policy)", k.cluster));
    };
    components.into_iter().find_map(|(what, version)| match skew(version, server) {
        Skew::Within => None,
        Skew::Newer => Some(format!(
            "{what} {version} would be newer than cluster {}'s API server ({server}): waiting for its control plane to be upgraded",
            k.cluster
        )),
        Skew::TooOld => Some(format!(
            "{what} {version} would be more than three minor versions older than cluster {}'s API server ({server})",
            k.cluster
        )),
    })
}

/// Where a kubelet's version stands against its API server's under Kubernetes' skew policy.
#[derive(Debug, PartialEq, Eq)]
enum Skew {
    Within,
    /// A newer minor than the API server's.
    Newer,
    /// More than three minors older (or an older major).
    TooOld,
}

fn minor_of(v: &KubeVersion) -> (u64, u64) {
    (v.major(), v.minor())
}

fn skew(kubelet: &KubeVersion, server: &KubeVersion) -> Skew {
    let (want, have) = (minor_of(kubelet), minor_of(server));
    if want > have {
        Skew::Newer
    } else if want.0 < have.0 || want.1 + 3 < have.1 {
        Skew::TooOld
    } else {
        Skew::Within
    }
}

pub fn is_control_plane(pool: &MachinePool) -> bool {
    pool.spec.template.spec.roles.contains(&keelson_api::machine::Role::ControlPlane)
}

/// The control-plane pools of the cluster `pool` drains, which roll out before it (the pool
/// itself when it is one: none).
pub fn control_plane_pools<'a>(pool: &MachinePool, pools: &'a [Versioned<MachinePool>]) -> Vec<&'a MachinePool> {
    let Some(k) = &pool.spec.kubernetes else { return Vec::new() };
    if is_control_plane(pool) {
        return Vec::new();
    }
    pools
        .iter()
        .map(|p| &p.object)
        .filter(|p| is_control_plane(p) && p.spec.kubernetes.as_ref().is_some_and(|q| q.cluster == k.cluster))
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pool(name: &str, role: &str, kubelet: &str) -> Versioned<MachinePool> {
        let object = serde_json::from_value(json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"pool": name}}, "kubernetes": {"cluster": "prod"},
                     "template": {"spec": {"roles": [role], "kubelet": {"version": kubelet, "source": {"package": "kubelet"}}}}}}))
        .unwrap_or_else(|e| panic!("{e}"));
        Versioned { object, revision: 1 }
    }

    fn cluster(server_version: Option<&str>) -> Versioned<KubernetesCluster> {
        let mut status = json!({"server": "https://10.0.0.1:6443"});
        if let Some(v) = server_version {
            status["serverVersion"] = json!(v);
        }
        let object =
            serde_json::from_value(json!({"apiVersion": "keelson.io/v1alpha1", "kind": "KubernetesCluster", "metadata": {"name": "prod"},
            "spec": {}, "status": status}))
            .unwrap_or_else(|e| panic!("{e}"));
        Versioned { object, revision: 1 }
    }

    #[test]
    fn a_workers_kubelet_waits_for_the_api_server_and_may_trail_it_by_three_minors() {
        let at = |kubelet: &str, server: Option<&str>| skew_hold(&pool("workers", "worker", kubelet).object, &[cluster(server)]);
        assert_eq!(at("v1.31.0", Some("v1.31.2")), None);
        assert_eq!(at("v1.31.9", Some("v1.31.2")), None, "a newer patch of the same minor is within the policy");
        assert_eq!(at("v1.28.0", Some("v1.31.2")), None);
        let newer = at("v1.32.0", Some("v1.31.2")).unwrap_or_default();
        assert!(newer.starts_with("kubelet v1.32.0 would be newer than cluster prod's API server (v1.31.2)"), "{newer}");
        let older = at("v1.27.3", Some("v1.31.2")).unwrap_or_default();
        assert!(older.contains("more than three minor versions older"), "{older}");
        let unknown = at("v1.31.0", None).unwrap_or_default();
        assert!(unknown.starts_with("waiting to read the version of cluster prod's API server"), "{unknown}");
        assert!(skew_hold(&pool("workers", "worker", "v1.31.0").object, &[]).is_some_and(|m| m.contains("not registered")));
        // A control-plane pool takes the API server along with its kubelets.
        assert_eq!(skew_hold(&pool("cp", "control-plane", "v1.32.0").object, &[cluster(Some("v1.31.2"))]), None);
    }

    #[test]
    fn a_workers_kubeadm_waits_for_the_control_plane_too() {
        let mut workers = pool("workers", "worker", "v1.31.0").object;
        let kubeadm = |v: &str| serde_json::from_value(json!({"version": v, "source": {"package": "kubeadm"}})).ok();
        workers.spec.template.spec.kubeadm = kubeadm("v1.32.0");
        let held = skew_hold(&workers, &[cluster(Some("v1.31.2"))]).unwrap_or_default();
        assert!(held.starts_with("kubeadm v1.32.0 would be newer than cluster prod's API server (v1.31.2)"), "{held}");
        workers.spec.template.spec.kubeadm = kubeadm("v1.31.2");
        assert_eq!(skew_hold(&workers, &[cluster(Some("v1.31.2"))]), None);
    }

    #[test]
    fn a_clusters_control_plane_pools_go_before_its_other_pools() {
        let pools = [pool("cp", "control-plane", "v1.31.0"), pool("workers", "worker", "v1.31.0"), pool("gpu", "worker", "v1.31.0")];
        let names = |p: &Versioned<MachinePool>| {
            control_plane_pools(&p.object, &pools).iter().map(|q| q.metadata.name_str().to_owned()).collect::<Vec<_>>()
        };
        assert_eq!(names(&pools[1]), ["cp"]);
        assert_eq!(names(&pools[2]), ["cp"]);
        assert!(names(&pools[0]).is_empty());
    }
}
