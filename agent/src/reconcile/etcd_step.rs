//! The etcd step of a pass: this machine's member installed, configured, and joined or
//! restarted with the cluster's safety checks (see `crate::etcd::member`). A new binary that
//! does not come back healthy and caught up is replaced by the previous one.

use std::time::Duration;

use keelson_api::machine::MachineSpec;
use keelson_api::meta::Name;

use super::{Reconciler, StepError, transient};
use crate::drivers::{artifact, etcd as host, files, systemd};
use crate::etcd::client::{EtcdClient, EtcdTls};
use crate::etcd::member::{LocalMember, MemberError};
use crate::etcd::{membership, pki};
use crate::plan::Pin;

const CATCH_UP_WAIT: Duration = Duration::from_secs(180);

fn member_err(e: MemberError) -> StepError {
    match e {
        MemberError::Permanent(m) => StepError::Permanent(m),
        MemberError::Transient(m) => StepError::Transient(m),
    }
}

/// The TLS files already on the machine, when there are any.
fn tls_on_disk() -> Option<EtcdTls> {
    let dir = std::path::Path::new(host::PKI_DIR);
    EtcdTls::from_files(&dir.join(pki::CA_FILE), &dir.join(pki::CERT_FILE), &dir.join(pki::KEY_FILE)).ok()
}

impl Reconciler {
    fn local_member<'a>(&'a self, cluster: &'a Name) -> Result<LocalMember<'a>, StepError> {
        let address = self.etcd_address.ok_or_else(|| {
            StepError::Permanent("this machine has no address to advertise to etcd peers: set etcd_advertise_address".into())
        })?;
        Ok(LocalMember { name: &self.name, cluster, address, state_dir: &self.state_dir, controller: &self.controller })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn etcd_step(
        &self,
        cluster: &str,
        version: &str,
        package: Option<&str>,
        artifact_sha: Option<&str>,
        unit: Option<&str>,
        env: Option<&str>,
        join: bool,
    ) -> Result<(), StepError> {
        let cluster: Name = cluster.parse().map_err(|e| StepError::Permanent(format!("spec.etcd.cluster: {e}")))?;
        let member = self.local_member(&cluster)?;
        let tls = member.ensure_tls().await.map_err(member_err)?;
        let local_url = host::local_client_url();
        let local = EtcdClient::new(vec![local_url.clone()], Some(&tls)).map_err(transient)?;

        let mut snapshot = None;
        if !join && systemd::is_active(host::UNIT_NAME).await {
            let (path, size) = member.prepare_restart(&local).await.map_err(member_err)?;
            self.report.event("Normal", "EtcdSnapshot", format!("{} ({size} bytes), taken before the member changes", path.display()));
            snapshot = Some(format!("{} ({size} bytes)", path.display()));
        }

        if let Some(p) = package {
            // Before the package is there, so that its own unit never starts a stray member.
            systemd::mask(host::PACKAGE_UNIT).await.map_err(transient)?;
            let pm = Self::packages()?;
            pm.update().await?;
            let (chosen, offered) = pm.newest_of_release(p, version).await?;
            let Some(chosen) = chosen else {
                let offered = if offered.is_empty() { "none".to_owned() } else { offered.join(", ") };
                return Err(StepError::Permanent(format!("apt: no version of {p} for etcd {version} (the repositories offer: {offered})")));
            };
            pm.install(&[Pin { name: p.to_owned(), version: chosen }]).await?;
            pm.hold(&[p.to_owned()]).await?;
        }
        let installed = match artifact_sha {
            Some(sha) => {
                let cached = artifact::cached(&self.state_dir, sha);
                if !cached.exists() {
                    return Err(transient(format!("artifact {sha} is not in the cache (fetch it first)")));
                }
                Some(host::install_tarball(&cached, std::path::Path::new(host::TARBALL_BIN_DIR)).map_err(|e| match e {
                    crate::drivers::containerd::TarballError::Invalid { .. } => StepError::Permanent(e.to_string()),
                    other => transient(other),
                })?)
            }
            None => None,
        };
        // A rollback puts the unit back too: a tarball's unit names its own binary.
        let previous_unit = unit.and_then(|_| std::fs::read_to_string(host::UNIT).ok());
        if let Some(u) = unit {
            files::write(host::UNIT, u, 0o644, None).map_err(transient)?;
        }
        if let Some(e) = env {
            files::write(host::ENV_FILE, e, 0o644, None).map_err(transient)?;
        }
        systemd::daemon_reload_enable(host::UNIT_NAME).await.map_err(transient)?;

        let result = if join {
            member.join(&tls).await
        } else {
            async {
                systemd::restart(host::UNIT_NAME).await.map_err(|e| MemberError::Transient(e.to_string()))?;
                let status = membership::wait_caught_up(&local, &local_url, CATCH_UP_WAIT).await?;
                if status.version.trim_start_matches('v') != version {
                    return Err(MemberError::Permanent(format!("the member serves etcd {}, not {version}", status.version)));
                }
                Ok(())
            }
            .await
        };
        match (result, installed) {
            (Ok(()), _) => {
                let status = member.status(&tls, snapshot).await;
                self.report.update(|s| s.etcd = status);
                Ok(())
            }
            (Err(e), Some(stamps)) => {
                let restored = crate::drivers::containerd::restore_binaries(&stamps).map_err(|e| e.to_string()).and_then(|()| {
                    match &previous_unit {
                        Some(u) => files::write(host::UNIT, u, 0o644, None).map_err(|e| e.to_string()),
                        None => Ok(()),
                    }
                });
                if restored.is_ok() && previous_unit.is_some() {
                    let _ = systemd::daemon_reload().await;
                }
                let what = match restored {
                    Ok(()) => match systemd::restart(host::UNIT_NAME).await {
                        Ok(()) => "put the previous binaries back".to_owned(),
                        Err(e) => format!("put the previous binaries back but could not restart the member: {e}"),
                    },
                    Err(e) => format!("putting the previous binaries back failed: {e}"),
                };
                Err(StepError::Permanent(format!("etcd {version} did not come back healthy and caught up ({e}); {what}")))
            }
            (Err(e), None) => Err(member_err(e)),
        }
    }

    /// Re-reads the member's state for the status (after a pass and at each drift check).
    pub async fn refresh_etcd(&self, spec: &MachineSpec) {
        let Some(e) = &spec.etcd else {
            self.report.update_quietly(|s| s.etcd = None);
            return;
        };
        if !host::has_member_data(std::path::Path::new("/")) {
            return;
        }
        let (Some(tls), Ok(member)) = (tls_on_disk(), self.local_member(&e.cluster)) else { return };
        let last_snapshot = self.report.snapshot().etcd.and_then(|s| s.last_snapshot);
        if let Some(status) = member.status(&tls, last_snapshot).await {
            self.report.update_quietly(|s| s.etcd = Some(status));
        }
    }

    /// Takes this machine's member out of its cluster before a reset; refused when that would
    /// cost the cluster its quorum or its last member.
    pub async fn leave_etcd(&self, spec: &MachineSpec) -> Result<Option<String>, String> {
        let Some(e) = &spec.etcd else { return Ok(None) };
        if !host::has_member_data(std::path::Path::new("/")) {
            return Ok(None);
        }
        let tls = tls_on_disk().ok_or_else(|| format!("no etcd TLS files in {}", host::PKI_DIR))?;
        let member = self.local_member(&e.cluster).map_err(|e| e.to_string())?;
        member.leave(&tls, false).await.map_err(|e| e.to_string())?;
        Ok(Some(format!("left etcd cluster {}", e.cluster)))
    }
}
