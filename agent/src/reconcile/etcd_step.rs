//! The etcd step of a pass: this machine's member installed, configured, and joined or
//! restarted with the cluster's safety checks (see `crate::etcd::member`). A new binary that
//! does not come back healthy and caught up is replaced by the previous one.

use std::time::{Duration, Instant};

use keelson_api::machine::MachineSpec;
use keelson_api::meta::Name;

use super::{Reconciler, StepError, off_runtime, transient};
use crate::drivers::{artifact, etcd as host, files, systemd};
use crate::etcd::client::{EtcdClient, EtcdTls};
use crate::etcd::member::{Left, LocalMember, MemberError};
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

/// Where a member's new binary comes from.
pub(super) enum Source<'a> {
    /// A distribution package (held), with the version installed before, if any.
    Package { name: &'a str, previous: Option<&'a str> },
    /// A release tarball already in the artifact cache.
    Tarball { sha256: &'a str },
}

/// A member's new binary, ready to go in place.
enum Prepared<'a> {
    Package { pm: crate::drivers::packages::Manager, pin: Pin, previous: Option<&'a str> },
    Tarball(crate::drivers::containerd::Staged),
}

/// How to go back to the binary that ran before a failed change.
enum Undo {
    /// The tarball's binaries, each kept beside the new one.
    Binaries(std::collections::BTreeMap<String, crate::ledger::FileStamp>),
    /// The package version installed before.
    Package(Pin),
}

impl Reconciler {
    fn local_member<'a>(&'a self, cluster: &'a Name) -> Result<LocalMember<'a>, StepError> {
        let address = self.etcd_address.ok_or_else(|| {
            StepError::Permanent("this machine has no address to advertise to etcd peers: set etcd_advertise_address".into())
        })?;
        Ok(LocalMember { name: &self.name, cluster, address, state_dir: &self.state_dir, controller: &self.controller })
    }

    pub(super) async fn etcd_step(
        &self,
        cluster: &str,
        version: &str,
        source: Option<Source<'_>>,
        unit: Option<&str>,
        env: Option<&str>,
        join: bool,
    ) -> Result<(), StepError> {
        let cluster: Name = cluster.parse().map_err(|e| StepError::Permanent(format!("spec.etcd.cluster: {e}")))?;
        let member = self.local_member(&cluster)?;
        let tls = member.ensure_tls().await.map_err(member_err)?;
        let local_url = host::local_client_url();
        let local = EtcdClient::new(vec![local_url.clone()], Some(&tls)).map_err(transient)?;

        // The slow part of an install (refreshing package lists, unpacking a release) comes
        // first, while this member still serves and may still lead.
        let began = Instant::now();
        let prepared = match source {
            Some(source) => Some(self.prepare_etcd(version, source).await?),
            None => None,
        };
        let staged = began.elapsed();

        let mut snapshot = None;
        if !join && systemd::is_active(host::UNIT_NAME).await {
            let (path, size) = member.prepare_restart(&local).await.map_err(member_err)?;
            self.report.event("Normal", "EtcdSnapshot", format!("{} ({size} bytes), taken before the member changes", path.display()));
            snapshot = Some(format!("{} ({size} bytes)", path.display()));
        }
        let checked = began.elapsed() - staged;

        let undo = match prepared {
            Some(p) => self.install_etcd(p).await?,
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

        let installed = began.elapsed() - staged - checked;
        let restarted = Instant::now();
        let result = if join {
            member.join(&tls).await
        } else {
            async {
                systemd::restart(host::UNIT_NAME).await.map_err(|e| MemberError::Transient(e.to_string()))?;
                let status = membership::wait_caught_up(&local, &local_url, CATCH_UP_WAIT).await?;
                if status.version.trim_start_matches('v') != version {
                    return Err(MemberError::Permanent(format!("the member serves etcd {}, not {version}", status.version)));
                }
                // What an upgrade costs, by phase (docs/benchmarks.md reads these).
                self.report.event(
                    "Normal",
                    "EtcdRestarted",
                    format!(
                        "etcd {version} healthy and caught up at raft index {}: staging {:.1}s, checks, snapshot and leader \
                         move {:.1}s, install {:.1}s, restart to caught up {:.1}s",
                        status.raft_applied_index,
                        staged.as_secs_f64(),
                        checked.as_secs_f64(),
                        installed.as_secs_f64(),
                        restarted.elapsed().as_secs_f64()
                    ),
                );
                Ok(())
            }
            .await
        };
        let e = match result {
            Ok(()) => {
                let status = member.status(&tls, snapshot).await;
                self.report.update(|s| s.etcd = status);
                return Ok(());
            }
            Err(e) => e,
        };
        let Some(undo) = undo else { return Err(member_err(e)) };
        let what = self.undo_etcd(undo, previous_unit.as_deref()).await;
        Err(StepError::Permanent(format!("etcd {version} did not come back healthy and caught up ({e}); {what}")))
    }

    /// Gets `version` ready to install from its source without touching what runs: the package
    /// version chosen from fresh lists, or the release unpacked beside the binaries it replaces.
    async fn prepare_etcd<'a>(&self, version: &str, source: Source<'a>) -> Result<Prepared<'a>, StepError> {
        match source {
            Source::Package { name, previous } => {
                // Before the package is there, so that its own unit never starts a stray member.
                systemd::mask(host::PACKAGE_UNIT).await.map_err(transient)?;
                let pm = Self::packages()?;
                pm.update().await?;
                let chosen = Self::newest_of_release(pm, name, "etcd", version).await?;
                Ok(Prepared::Package { pm, pin: Pin { name: name.to_owned(), version: chosen }, previous })
            }
            Source::Tarball { sha256 } => {
                let cached = artifact::cached(&self.state_dir, sha256);
                if !cached.exists() {
                    return Err(transient(format!("artifact {sha256} is not in the cache (fetch it first)")));
                }
                let staged = off_runtime(move || host::stage_tarball(&cached, std::path::Path::new(host::TARBALL_BIN_DIR))).await??;
                Ok(Prepared::Tarball(staged))
            }
        }
    }

    /// Puts the prepared binary in place; returns how to go back to what ran before, when
    /// there is something to go back to.
    async fn install_etcd(&self, prepared: Prepared<'_>) -> Result<Option<Undo>, StepError> {
        match prepared {
            Prepared::Package { pm, pin, previous } => {
                let name = pin.name.clone();
                pm.install(&[pin]).await?;
                pm.hold(std::slice::from_ref(&name)).await?;
                Ok(previous.map(|v| Undo::Package(Pin { name, version: v.to_owned() })))
            }
            Prepared::Tarball(staged) => Ok(Some(Undo::Binaries(off_runtime(move || staged.install()).await??))),
        }
    }

    /// Puts the previous binary (and unit) back and restarts the member on it; says what it did.
    async fn undo_etcd(&self, undo: Undo, previous_unit: Option<&str>) -> String {
        let restored = match &undo {
            Undo::Binaries(stamps) => crate::drivers::containerd::restore_binaries(stamps).map_err(|e| e.to_string()),
            Undo::Package(pin) => match Self::packages() {
                Ok(pm) => async {
                    pm.ensure_available(std::slice::from_ref(pin)).await?;
                    pm.install(std::slice::from_ref(pin)).await
                }
                .await
                .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            },
        };
        let restored = restored.and_then(|()| match previous_unit {
            Some(u) => files::write(host::UNIT, u, 0o644, None).map_err(|e| e.to_string()),
            None => Ok(()),
        });
        if restored.is_ok() && previous_unit.is_some() {
            let _ = systemd::daemon_reload().await;
        }
        let previous = match &undo {
            Undo::Package(pin) => format!("{} {}", pin.name, pin.version),
            Undo::Binaries(_) => "the previous binaries".to_owned(),
        };
        match restored {
            Ok(()) => match systemd::restart(host::UNIT_NAME).await {
                Ok(()) => format!("put {previous} back"),
                Err(e) => format!("put {previous} back but could not restart the member: {e}"),
            },
            Err(e) => format!("putting {previous} back failed: {e}"),
        }
    }

    /// Re-reads the member's state for the status (after a pass and every heartbeat between
    /// passes).
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
    /// cost the cluster its quorum or its last member, unless `force` (the operator's
    /// `keelson delete machine NAME --force-etcd-leave`).
    pub async fn leave_etcd(&self, spec: &MachineSpec, force: bool) -> Result<Option<String>, String> {
        let Some(e) = &spec.etcd else { return Ok(None) };
        if !host::has_member_data(std::path::Path::new("/")) {
            return Ok(None);
        }
        let tls = tls_on_disk().ok_or_else(|| format!("no etcd TLS files in {}", host::PKI_DIR))?;
        let member = self.local_member(&e.cluster).map_err(|e| e.to_string())?;
        let cluster = &e.cluster;
        Ok(Some(match member.leave(&tls, force).await.map_err(|e| e.to_string())? {
            Left::Removed if force => {
                format!("left etcd cluster {cluster} (forced by the operator: the quorum check was skipped)")
            }
            Left::Removed => format!("left etcd cluster {cluster}"),
            Left::NotAMember => format!("not a member of etcd cluster {cluster} any more"),
            Left::ClusterEnded => {
                format!("was the last member of etcd cluster {cluster}; forced by the operator, the cluster ends with this reset")
            }
        }))
    }
}
