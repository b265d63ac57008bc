//! The reconcile state machine: one generation of the spec, carried out step by step.
//!
//! ```text
//!            new generation / drift timer
//!   Idle ──────────────────────────────▶ Planning ──(empty plan)──▶ Converged ──▶ Idle
//!    ▲                                      │ steps (journal written)
//!    │                                      ▼
//!    │         ┌──────────────────────▶ Executing(i) ──ok──▶ Executing(i+1) … ──▶ Converged
//!    │         │ lease granted              │ disruptive, no lease        │ reboot step
//!    │    WaitingForLease ◀─────────────────┘                             ▼
//!    │                                                    Rebooting ──(new boot id)──▶ Verifying
//!    │                                                                  kernel as expected │ ▲ not
//!    │                                                                   → Executing(i+1) ─┘ └─▶ Degraded
//!    └──── Degraded ◀── a step failed MAX_ATTEMPTS times, or the spec asks for what this agent
//!                      cannot do; stays until a new generation arrives
//! ```
//!
//! The journal (see `journal`) is written before every step and after every transition, so a
//! kill, a crash or the reboot itself resumes at the same place. The phase names above are
//! what the agent reports in its status.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keelson_api::machine::{CurrentStep, KubeadmUpgrade, MachineSpec, Phase, Versions};
use keelson_api::meta::{self, Condition, ConditionStatus, condition, set_condition};
use keelson_api::wire::Event;
use tokio_util::sync::CancellationToken;

use crate::client::{Controller, Lease, LeaseAnswer};
use crate::drivers::packages::{Manager, PackageError};
use crate::drivers::{artifact, containerd, files, kubeadm, kubelet, script, systemd};
use crate::journal::{Journal, RebootRecord};
use crate::ledger::{InstalledArtifact, Ledger};
use crate::observe::{self, CONTAINERD_CONFIG};
use crate::plan::{self, Action, Context, Step};

mod etcd_step;

/// Attempts at a failing step before the machine is Degraded.
pub const MAX_ATTEMPTS: u32 = 3;
const RETRY_BASE_SECS: u64 = 5;
const LEASE_RETRY_SECS: u64 = 5;
/// A reboot outlives any renewal by the agent, so its lease must cover the whole boot.
const REBOOT_LEASE_TTL_SECS: u64 = 900;

/// How one reconcile pass ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Converged,
    Degraded {
        reason: String,
        message: String,
    },
    /// The machine is rebooting; the next start of the agent carries on.
    Rebooting,
    /// Shutdown was requested between steps; the journal says where to resume.
    Interrupted,
}

/// What the agent will report next; shared with the status sender.
#[derive(Debug, Default)]
pub struct Report {
    inner: Mutex<ReportState>,
    pub changed: tokio::sync::Notify,
}

#[derive(Debug, Clone, Default)]
pub struct ReportState {
    pub phase: Option<Phase>,
    pub observed_generation: u64,
    pub conditions: Vec<Condition>,
    pub current_step: Option<CurrentStep>,
    pub events: Vec<Event>,
    /// What is installed, as last observed (each pass and each drift check).
    pub versions: Versions,
    /// This machine's etcd member, as last seen (role etcd only).
    pub etcd: Option<keelson_api::machine::EtcdMemberStatus>,
}

impl Report {
    pub fn update(&self, f: impl FnOnce(&mut ReportState)) {
        {
            let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut s);
        }
        self.changed.notify_one();
    }

    /// Changes the report without waking the status sender (for the sender's own changes).
    pub fn update_quietly(&self, f: impl FnOnce(&mut ReportState)) {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut s);
    }

    pub fn snapshot(&self) -> ReportState {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Takes the events not yet sent.
    pub fn take_events(&self) -> Vec<Event> {
        std::mem::take(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner()).events)
    }

    pub fn event(&self, type_: &str, reason: &str, message: impl Into<String>) {
        let message = message.into();
        match type_ {
            "Warning" => tracing::warn!(reason, %message, "event"),
            _ => tracing::info!(reason, %message, "event"),
        }
        self.update(|s| {
            s.events.push(Event { time: meta::now(), type_: type_.into(), reason: reason.into(), message, source: "agent".into() })
        });
    }

    pub fn condition(&self, type_: &str, status: ConditionStatus, reason: &str, message: &str) {
        self.update(|s| {
            set_condition(&mut s.conditions, type_, status, reason, message, meta::now());
        });
    }
}

#[derive(Debug)]
pub struct Reconciler {
    pub state_dir: PathBuf,
    /// This machine's name (its identity's).
    pub name: keelson_api::meta::Name,
    /// The address an etcd member here advertises.
    pub etcd_address: Option<std::net::IpAddr>,
    pub controller: Controller,
    pub lease_ttl: Duration,
    pub report: Arc<Report>,
    pub cancel: CancellationToken,
}

/// Runs blocking work (unpacking a release) on tokio's blocking threads: the agent has one
/// runtime thread, and its heartbeats, watchdog and spec long-poll must go on meanwhile.
async fn off_runtime<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, StepError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| transient(format!("blocking task ended abnormally: {e}")))
}

#[derive(Debug, thiserror::Error)]
enum StepError {
    /// Retrying cannot help (a version the repositories lack): fail at once.
    #[error("{0}")]
    Permanent(String),
    #[error("{0}")]
    Transient(String),
}

/// A release that is not what it should be fails at once; trouble writing it is retried.
impl From<containerd::TarballError> for StepError {
    fn from(e: containerd::TarballError) -> Self {
        match e {
            containerd::TarballError::Invalid { .. } => StepError::Permanent(e.to_string()),
            other => transient(other),
        }
    }
}

impl From<PackageError> for StepError {
    fn from(e: PackageError) -> Self {
        match e {
            PackageError::VersionNotFound(_) => StepError::Permanent(e.to_string()),
            other => StepError::Transient(other.to_string()),
        }
    }
}

fn transient(e: impl std::fmt::Display) -> StepError {
    StepError::Transient(e.to_string())
}

enum StepDone {
    Done,
    Rebooting,
}

impl Reconciler {
    fn root() -> PathBuf {
        PathBuf::from("/")
    }

    fn packages() -> Result<Manager, StepError> {
        Manager::detect(&Self::root()).ok_or_else(|| StepError::Permanent("no dpkg or rpm database on this machine".into()))
    }

    /// The newest version of `package` that is release `version` of `component`; when there is
    /// none, a permanent error that says what the repositories offer.
    async fn newest_of_release(pm: Manager, package: &str, component: &str, version: &str) -> Result<String, StepError> {
        let (chosen, offered) = pm.newest_of_release(package, version).await?;
        chosen.ok_or_else(|| {
            let offered = if offered.is_empty() { "none".to_owned() } else { offered.join(", ") };
            StepError::Permanent(format!("apt: no version of {package} for {component} {version} (the repositories offer: {offered})"))
        })
    }

    fn set_phase(&self, phase: Phase, generation: u64) {
        self.report.update(|s| {
            s.phase = Some(phase);
            s.observed_generation = generation;
        });
    }

    fn degraded(&self, generation: u64, reason: &str, message: String) -> Outcome {
        self.set_phase(Phase::Degraded, generation);
        self.report.condition(condition::DEGRADED, ConditionStatus::True, reason, &message);
        self.report.condition(condition::UPDATING, ConditionStatus::False, reason, "");
        self.report.condition(condition::UP_TO_DATE, ConditionStatus::False, reason, &message);
        self.report.update(|s| s.current_step = None);
        Outcome::Degraded { reason: reason.into(), message }
    }

    /// Observes the versions of what the spec manages, for the status reports.
    pub fn refresh_versions(&self, spec: &MachineSpec) {
        let ledger = Ledger::load(&self.state_dir).unwrap_or_default();
        match observe::observe(&Self::root(), &ledger, spec) {
            Ok(o) => {
                let versions = observe::versions(&o, &ledger, spec);
                self.report.update_quietly(|s| s.versions = versions);
            }
            Err(e) => tracing::warn!(error = %e, "could not observe installed versions"),
        }
    }

    /// One pass for `generation`: resume the journal, or plan and carry out a new one.
    pub async fn reconcile(&self, generation: u64, spec: &MachineSpec) -> Outcome {
        let journal = match Journal::load(&self.state_dir) {
            Ok(j) => j,
            Err(e) => return self.degraded(generation, "JournalUnreadable", e.to_string()),
        };
        let mut journal = match journal {
            Some(j) if j.generation == generation && j.failed.is_some() => {
                // Already failed: not retried until a new generation arrives.
                let message = j.failed.clone().unwrap_or_default();
                return self.degraded(generation, "StepFailed", message);
            }
            Some(j) if j.generation == generation && !j.is_done() => j,
            previous => {
                let rebooted_for = previous.as_ref().and_then(|j| j.rebooted_for_generation);
                let ledger = match Ledger::load(&self.state_dir) {
                    Ok(l) => l,
                    Err(e) => return self.degraded(generation, "LedgerUnreadable", e.to_string()),
                };
                let observed = match observe::observe(&Self::root(), &ledger, spec) {
                    Ok(o) => o,
                    Err(e) => return self.degraded(generation, "ObserveFailed", e.to_string()),
                };
                if ledger.spec.as_ref() != Some(spec)
                    && let Err(e) = Ledger::update(&self.state_dir, |l| l.spec = Some(spec.clone()))
                {
                    return self.degraded(generation, "LedgerUnwritable", e.to_string());
                }
                let ctx = Context {
                    generation,
                    rebooted_for_generation: rebooted_for,
                    name: self.name.to_string(),
                    etcd_address: self.etcd_address,
                };
                let steps = match plan::plan(spec, &observed, &ctx) {
                    Ok(s) => s,
                    Err(e) => return self.degraded(generation, "Unsupported", e.to_string()),
                };
                let drift = previous.as_ref().is_some_and(|j| j.generation == generation && j.is_done());
                let journal = Journal::new(generation, steps, rebooted_for);
                if let Err(e) = journal.save(&self.state_dir) {
                    return self.degraded(generation, "JournalUnwritable", e.to_string());
                }
                if journal.steps.is_empty() {
                    return self.converged(generation);
                }
                if drift {
                    let what = journal.steps.iter().map(|s| s.description.clone()).collect::<Vec<_>>().join("; ");
                    self.report.condition(condition::UP_TO_DATE, ConditionStatus::False, "Drift", &what);
                    self.report.event("Warning", "Drift", format!("the machine no longer matches generation {generation}: {what}"));
                } else {
                    self.report.condition(
                        condition::UP_TO_DATE,
                        ConditionStatus::False,
                        "Pending",
                        &format!("{} steps to generation {generation}", journal.steps.len()),
                    );
                }
                journal
            }
        };
        self.report.condition(condition::DEGRADED, ConditionStatus::False, "AsExpected", "");
        self.execute(&mut journal).await
    }

    fn converged(&self, generation: u64) -> Outcome {
        self.set_phase(Phase::Ready, generation);
        self.report.condition(condition::UP_TO_DATE, ConditionStatus::True, "Converged", &format!("generation {generation} applied"));
        self.report.condition(condition::UPDATING, ConditionStatus::False, "Converged", "");
        self.report.condition(condition::DEGRADED, ConditionStatus::False, "AsExpected", "");
        self.report.update(|s| s.current_step = None);
        Outcome::Converged
    }

    fn save(&self, journal: &Journal) -> Result<(), Outcome> {
        journal.save(&self.state_dir).map_err(|e| self.degraded(journal.generation, "JournalUnwritable", e.to_string()))
    }

    async fn execute(&self, journal: &mut Journal) -> Outcome {
        let generation = journal.generation;
        let total = journal.steps.len() as u32;
        while !journal.is_done() {
            if self.cancel.is_cancelled() {
                return Outcome::Interrupted;
            }
            let index = journal.next;
            let step = journal.steps[index].clone();
            self.set_phase(Phase::Converging, generation);
            self.report
                .update(|s| s.current_step = Some(CurrentStep { index: index as u32 + 1, total, description: step.description.clone() }));
            // Resuming with a lease from before a restart: it may have expired meanwhile.
            if step.disruptive
                && journal.reboot.is_none()
                && let Some(id) = journal.lease.clone()
                && let Err(e) = self.controller.renew_lease(&id, self.lease_ttl).await
            {
                tracing::info!(lease = %id, error = %e, "the lease from before the restart is gone; asking again");
                journal.lease = None;
                journal.kubeadm_upgrade = None;
            }
            if step.disruptive && journal.lease.is_none() {
                let ttl =
                    if matches!(step.action, Action::Reboot { .. }) { Duration::from_secs(REBOOT_LEASE_TTL_SECS) } else { self.lease_ttl };
                match self.acquire_lease(&step.description, ttl).await {
                    Some(lease) => {
                        journal.lease = Some(lease.id);
                        journal.kubeadm_upgrade = lease.kubeadm;
                        if let Err(o) = self.save(journal) {
                            return o;
                        }
                    }
                    None => return Outcome::Interrupted,
                }
            }
            self.report.condition(
                condition::UPDATING,
                ConditionStatus::True,
                "Step",
                &format!("{}/{total} {}", index + 1, step.description),
            );
            if let Err(o) = self.save(journal) {
                return o;
            }
            let result = if journal.reboot.is_some() {
                self.verify_reboot(journal).await
            } else {
                self.report.event("Normal", "StepStarted", format!("{}/{total} {}", index + 1, step.description));
                let renewing = self.renew_in_background(journal.lease.clone(), &step);
                let r = self.run_step(journal, &step).await;
                if let Some(h) = renewing {
                    h.abort();
                }
                r
            };
            match result {
                Ok(StepDone::Rebooting) => {
                    self.set_phase(Phase::Converging, generation);
                    return Outcome::Rebooting;
                }
                Ok(StepDone::Done) => {
                    self.report.event("Normal", "StepSucceeded", format!("{}/{total} {}", index + 1, step.description));
                    journal.next += 1;
                    journal.attempts = 0;
                    journal.reboot = None;
                    let next_disruptive = journal.steps.get(journal.next).is_some_and(|s| s.disruptive);
                    if !next_disruptive {
                        self.release_lease(journal).await;
                    }
                    if let Err(o) = self.save(journal) {
                        return o;
                    }
                }
                Err(e) => {
                    journal.attempts += 1;
                    let permanent = matches!(e, StepError::Permanent(_));
                    let message = format!("step {}/{total} ({}) failed: {e}", index + 1, step.description);
                    self.report.event("Warning", "StepFailed", format!("{message} (attempt {} of {MAX_ATTEMPTS})", journal.attempts));
                    if permanent || journal.attempts >= MAX_ATTEMPTS {
                        journal.failed = Some(message.clone());
                        self.release_lease(journal).await;
                        if let Err(o) = self.save(journal) {
                            return o;
                        }
                        return self.degraded(generation, "StepFailed", message);
                    }
                    if let Err(o) = self.save(journal) {
                        return o;
                    }
                    let backoff = Duration::from_secs(RETRY_BASE_SECS * 3u64.pow(journal.attempts - 1));
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = self.cancel.cancelled() => return Outcome::Interrupted,
                    }
                }
            }
        }
        self.release_lease(journal).await;
        let _ = self.save(journal);
        self.report.event("Normal", "Converged", format!("generation {generation} applied"));
        self.converged(generation)
    }

    /// Waits for a lease, reporting why it waits. `None` when shutting down.
    async fn acquire_lease(&self, what: &str, ttl: Duration) -> Option<Lease> {
        let mut waiting_reported = false;
        loop {
            match self.controller.acquire_lease(what, ttl).await {
                // The controller records the grant (`DisruptionGranted`) in the grant's own
                // write: one event per lease in the machine's history, not one from each side.
                Ok(LeaseAnswer::Granted(l)) => return Some(l),
                Ok(LeaseAnswer::Wait(message)) => {
                    if !waiting_reported {
                        self.report.condition(condition::UPDATING, ConditionStatus::True, "WaitingForDisruptionBudget", &message);
                        waiting_reported = true;
                    }
                }
                Err(e) => {
                    self.report.condition(condition::UPDATING, ConditionStatus::True, "WaitingForController", &e.to_string());
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(LEASE_RETRY_SECS)) => {}
                _ = self.cancel.cancelled() => return None,
            }
        }
    }

    async fn release_lease(&self, journal: &mut Journal) {
        journal.kubeadm_upgrade = None;
        if let Some(id) = journal.lease.take()
            && let Err(e) = self.controller.release_lease(&id).await
        {
            // Not fatal: an unreleased lease expires by itself.
            tracing::warn!(lease = %id, error = %e, "could not release the disruption lease");
        }
    }

    fn renew_in_background(&self, lease: Option<String>, step: &Step) -> Option<tokio::task::JoinHandle<()>> {
        let id = lease?;
        if matches!(step.action, Action::Reboot { .. }) {
            return None;
        }
        let controller = self.controller.clone();
        let ttl = self.lease_ttl;
        Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(ttl / 3).await;
                if let Err(e) = controller.renew_lease(&id, ttl).await {
                    tracing::warn!(lease = %id, error = %e, "could not renew the disruption lease");
                }
            }
        }))
    }

    async fn run_step(&self, journal: &mut Journal, step: &Step) -> Result<StepDone, StepError> {
        match &step.action {
            Action::Repositories { content } => {
                let pm = Self::packages()?;
                let path = format!("/{}", pm.sources_file());
                match content {
                    Some(c) => files::write(&path, c, 0o644, None).map_err(transient)?,
                    None => match std::fs::remove_file(&path) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(transient(format!("removing {path}: {e}"))),
                        _ => {}
                    },
                }
                pm.update().await?;
            }
            Action::Packages { install, hold } => {
                let pm = Self::packages()?;
                pm.update().await?;
                pm.ensure_available(install).await?;
                pm.install(install).await?;
                pm.hold(hold).await?;
            }
            Action::Hold { names } => Self::packages()?.hold(names).await?,
            Action::Runtime { name, tarball: false, package, config, previous, .. } => {
                self.runtime_package_step(name, package.as_ref(), config.as_deref(), previous.as_deref()).await?
            }
            Action::Runtime { tarball: true, artifact, unit, config, .. } => {
                self.runtime_tarball_step(artifact.as_ref(), unit.as_deref(), config.as_deref()).await?
            }
            Action::WriteFile { path, content, mode, owner } => files::write(path, content, *mode, owner.as_deref()).map_err(transient)?,
            Action::FetchArtifact { url, sha256 } => {
                let url: url::Url = url.parse().map_err(|e| StepError::Permanent(format!("artifact url {url:?}: {e}")))?;
                let ca = std::fs::read_to_string(self.state_dir.join(crate::state::CA_FILE)).ok();
                match artifact::fetch(&self.state_dir, &url, sha256, ca.as_deref()).await {
                    Ok(_) => {}
                    Err(e @ artifact::ArtifactError::Mismatch { .. }) => return Err(StepError::Permanent(e.to_string())),
                    Err(e) => return Err(transient(e)),
                }
            }
            Action::Kubelet { package: Some(package), version, previous_package, .. } => {
                self.kubelet_package_step(package, version, previous_package.as_deref()).await?
            }
            Action::Kubelet { artifact: digest, version, unit, dropin, package: None, .. } => {
                self.kubelet_step(digest.as_deref(), version, unit.as_deref(), dropin.as_deref()).await?
            }
            Action::Etcd { cluster, version, package, previous_package, artifact, unit, env, join } => {
                let source = match (package, artifact) {
                    (Some(name), _) => Some(etcd_step::Source::Package { name, previous: previous_package.as_deref() }),
                    (None, Some(sha256)) => Some(etcd_step::Source::Tarball { sha256 }),
                    (None, None) => None,
                };
                self.etcd_step(cluster, version, source, unit.as_deref(), env.as_deref(), *join).await?
            }
            Action::KubeadmInstall { version, package, artifact } => {
                self.kubeadm_install_step(version, package.as_deref(), artifact.as_deref()).await?
            }
            Action::KubeadmUpgrade { version, control_plane } => {
                self.kubeadm_upgrade_step(version, journal.kubeadm_upgrade, *control_plane).await?
            }
            Action::Script { name, when, run, env, timeout_seconds } => {
                self.script_step(journal.generation, name, *when, run, env, *timeout_seconds).await?
            }
            Action::Reboot { reason } => {
                let observed = observe::observe(&Self::root(), &Ledger::default(), &MachineSpec::default()).map_err(transient)?;
                journal.reboot =
                    Some(RebootRecord { boot_id_before: observed.boot_id.clone(), expected_kernel: observed.boot_kernel.clone() });
                journal.rebooted_for_generation = Some(journal.generation);
                journal.save(&self.state_dir).map_err(transient)?;
                self.report.event(
                    "Normal",
                    "Rebooting",
                    format!("{reason}; expecting kernel {}", observed.boot_kernel.unwrap_or_else(|| "unknown".into())),
                );
                systemd::reboot().await.map_err(transient)?;
                return Ok(StepDone::Rebooting);
            }
        }
        Ok(StepDone::Done)
    }

    async fn script_step(
        &self,
        generation: u64,
        name: &str,
        when: keelson_api::machine::ScriptWhen,
        argv: &[String],
        env: &std::collections::BTreeMap<String, String>,
        timeout_seconds: u32,
    ) -> Result<(), StepError> {
        let mut env = env.clone();
        env.insert("KEELSON_GENERATION".into(), generation.to_string());
        env.insert("KEELSON_SCRIPT".into(), name.to_owned());
        let r = script::run(argv, &env, Duration::from_secs(timeout_seconds.into())).await.map_err(transient)?;
        let summary = r.summary();
        if !r.succeeded() {
            return Err(transient(format!("script {name} ({}): {summary}", argv.join(" "))));
        }
        self.report.event("Normal", "ScriptSucceeded", format!("script {name}: {summary}"));
        if when == keelson_api::machine::ScriptWhen::Bootstrap {
            Ledger::update(&self.state_dir, |l| {
                l.bootstrapped.insert(name.to_owned());
            })
            .map_err(transient)?;
        }
        Ok(())
    }

    async fn runtime_tarball_step(
        &self,
        artifact: Option<&plan::RuntimeArtifact>,
        unit: Option<&str>,
        config: Option<&str>,
    ) -> Result<(), StepError> {
        let installed = match artifact {
            Some(a) => {
                let cached = artifact::cached(&self.state_dir, &a.sha256);
                if !cached.exists() {
                    return Err(transient(format!("artifact {} is not in the cache (fetch it first)", a.sha256)));
                }
                let stamps = off_runtime(move || containerd::install_tarball(&cached, std::path::Path::new(containerd::BIN_DIR))).await??;
                Some((a, stamps))
            }
            None => None,
        };
        if let Some(u) = unit {
            files::write(containerd::UNIT, u, 0o644, None).map_err(transient)?;
        }
        if let Some(c) = config {
            files::write(&format!("/{CONTAINERD_CONFIG}"), c, 0o644, None).map_err(transient)?;
        }
        let ctr = format!("{}/ctr", containerd::BIN_DIR);
        let checked = async {
            systemd::daemon_reload_enable("containerd").await.map_err(|e| e.to_string())?;
            systemd::restart("containerd").await.map_err(|e| e.to_string())?;
            let serving = containerd::wait_healthy(&ctr).await.map_err(|e| e.to_string())?;
            match installed.as_ref() {
                Some((a, _)) if !containerd::same_release(&serving, &a.version) => {
                    Err(format!("the daemon reports version {serving}, not {}", a.version))
                }
                _ => Ok(serving),
            }
        }
        .await;
        match (checked, installed) {
            (Ok(serving), Some((a, stamps))) => {
                tracing::info!(version = %serving, "containerd from the tarball answers");
                Ledger::update(&self.state_dir, |l| {
                    l.runtime_artifact = Some(InstalledArtifact { sha256: a.sha256.clone(), version: a.version.clone(), binaries: stamps });
                })
                .map_err(transient)
            }
            (Ok(_), None) => Ok(()),
            (Err(health), Some((a, stamps))) => {
                let what = match containerd::restore_binaries(&stamps) {
                    Ok(()) => match systemd::restart("containerd").await {
                        Ok(()) => "put the previous binaries back".to_owned(),
                        Err(e) => format!("put the previous binaries back but could not restart containerd: {e}"),
                    },
                    Err(e) => format!("putting the previous binaries back failed: {e}"),
                };
                Err(StepError::Permanent(format!("containerd {} failed its health check ({health}); {what}", a.version)))
            }
            (Err(health), None) => Err(transient(format!("containerd failed its health check: {health}"))),
        }
    }

    async fn runtime_package_step(
        &self,
        name: &str,
        package: Option<&plan::Pin>,
        config: Option<&str>,
        previous: Option<&str>,
    ) -> Result<(), StepError> {
        let pm = Self::packages()?;
        if let Some(p) = package {
            pm.update().await?;
            pm.ensure_available(std::slice::from_ref(p)).await?;
            pm.install(std::slice::from_ref(p)).await?;
        }
        // Held, so that nothing but keelson moves it.
        pm.hold(&[name.to_owned()]).await?;
        if let Some(c) = config {
            files::write(&format!("/{CONTAINERD_CONFIG}"), c, 0o644, None).map_err(transient)?;
        }
        systemd::restart("containerd").await.map_err(transient)?;
        match containerd::wait_healthy("ctr").await {
            Ok(version) => {
                tracing::info!(%version, "containerd answers");
                Ok(())
            }
            Err(health) => {
                let (Some(p), Some(prev)) = (package, previous) else {
                    return Err(StepError::Transient(format!("containerd failed its health check: {health}")));
                };
                let back = plan::Pin { name: p.name.clone(), version: prev.to_owned() };
                let rolled = async {
                    pm.ensure_available(std::slice::from_ref(&back)).await?;
                    pm.install(std::slice::from_ref(&back)).await?;
                    systemd::restart("containerd").await?;
                    Ok::<(), PackageError>(())
                }
                .await;
                let what = match rolled {
                    Ok(()) => format!("rolled back to {prev}"),
                    Err(e) => format!("rollback to {prev} failed too: {e}"),
                };
                Err(StepError::Permanent(format!("containerd {} failed its health check ({health}); {what}", p.version)))
            }
        }
    }

    async fn kubelet_step(&self, digest: Option<&str>, version: &str, unit: Option<&str>, dropin: Option<&str>) -> Result<(), StepError> {
        if let Some(u) = unit {
            files::write(kubelet::UNIT, u, 0o644, None).map_err(transient)?;
        }
        if let Some(d) = dropin {
            files::write(kubelet::DROPIN, d, 0o644, None).map_err(transient)?;
        }
        let previous = kubelet::installed_version(std::path::Path::new("/"));
        if let Some(sha) = digest {
            let cached = artifact::cached(&self.state_dir, sha);
            if !cached.exists() {
                return Err(transient(format!("artifact {sha} is not in the cache (fetch it first)")));
            }
            kubelet::install_binary(&cached).map_err(|e| transient(format!("installing {}: {e}", kubelet::BINARY)))?;
        }
        kubelet::restart().await.map_err(transient)?;
        // The digest pins the bytes; the version the spec names must be what they are.
        let installed = kubelet::installed_version(std::path::Path::new("/"));
        let check = match installed.as_deref() {
            Some(v) if v == version => kubelet::healthy().await,
            other => Err(format!("the installed binary reports {}, not {version}", other.unwrap_or("no version"))),
        };
        match check {
            Ok(()) => Ok(()),
            Err(health) if digest.is_some() => {
                let what = match kubelet::restore_previous() {
                    Ok(true) => match kubelet::restart().await {
                        Ok(()) => format!("rolled back to the previous binary ({})", previous.unwrap_or_else(|| "unknown version".into())),
                        Err(e) => format!("restored the previous binary but could not restart it: {e}"),
                    },
                    Ok(false) => "there was no previous binary to roll back to".into(),
                    Err(e) => format!("rolling back failed: {e}"),
                };
                Err(StepError::Permanent(format!("kubelet {version} failed its check ({health}); {what}")))
            }
            Err(health) => Err(transient(format!("kubelet failed its health check: {health}"))),
        }
    }

    /// Installs and holds the newest version of `package` that is release `version` of
    /// `component`: the package manager and the package version chosen.
    async fn install_release_package(package: &str, component: &str, version: &str) -> Result<(Manager, String), StepError> {
        let pm = Self::packages()?;
        pm.update().await?;
        let chosen = Self::newest_of_release(pm, package, component, version).await?;
        let pin = plan::Pin { name: package.to_owned(), version: chosen.clone() };
        pm.install(std::slice::from_ref(&pin)).await?;
        pm.hold(&[package.to_owned()]).await?;
        Ok((pm, chosen))
    }

    async fn kubelet_package_step(&self, package: &str, version: &str, previous_package: Option<&str>) -> Result<(), StepError> {
        let (pm, chosen) = Self::install_release_package(package, "kubelet", version).await?;
        kubelet::restart().await.map_err(transient)?;
        let installed = kubelet::installed_version(std::path::Path::new("/"));
        let check = match installed.as_deref() {
            Some(v) if v == version => kubelet::healthy().await,
            other => Err(format!("{package} {chosen} reports {}, not {version}", other.unwrap_or("no version"))),
        };
        let Err(health) = check else { return Ok(()) };
        let what = match previous_package {
            Some(prev) => {
                let back = plan::Pin { name: package.to_owned(), version: prev.to_owned() };
                let rolled = async {
                    pm.ensure_available(std::slice::from_ref(&back)).await?;
                    pm.install(std::slice::from_ref(&back)).await?;
                    kubelet::restart().await?;
                    Ok::<(), PackageError>(())
                }
                .await;
                match rolled {
                    Ok(()) => format!("rolled back to {package} {prev}"),
                    Err(e) => format!("rollback to {package} {prev} failed too: {e}"),
                }
            }
            None => "there was no previous package to roll back to".to_owned(),
        };
        Err(StepError::Permanent(format!("kubelet {version} ({package} {chosen}) failed its check ({health}); {what}")))
    }

    async fn kubeadm_install_step(&self, version: &str, package: Option<&str>, digest: Option<&str>) -> Result<(), StepError> {
        let root = std::path::Path::new("/");
        if let Some(package) = package {
            let (_, chosen) = Self::install_release_package(package, "kubeadm", version).await?;
            return match kubeadm::installed_version(root) {
                Some(v) if v == version => Ok(()),
                other => Err(StepError::Permanent(format!(
                    "{package} {chosen} reports kubeadm {}, not {version}",
                    other.as_deref().unwrap_or("no version")
                ))),
            };
        }
        let Some(sha) = digest else { return Err(StepError::Permanent("kubeadm has neither a package nor an artifact".into())) };
        let cached = artifact::cached(&self.state_dir, sha);
        if !cached.exists() {
            return Err(transient(format!("artifact {sha} is not in the cache (fetch it first)")));
        }
        let previous = kubeadm::installed_version(root);
        kubeadm::install_binary(&cached).map_err(|e| transient(format!("installing {}: {e}", kubeadm::BINARY)))?;
        // The digest pins the bytes; the version the spec names must be what they are.
        match kubeadm::installed_version(root) {
            Some(v) if v == version => Ok(()),
            other => {
                let what = match kubeadm::restore_previous() {
                    Ok(true) => format!("put the previous binary back ({})", previous.as_deref().unwrap_or("unknown version")),
                    Ok(false) => "there was no previous binary to put back".into(),
                    Err(e) => format!("putting the previous binary back failed: {e}"),
                };
                Err(StepError::Permanent(format!(
                    "the kubeadm artifact reports {}, not {version}; {what}",
                    other.as_deref().unwrap_or("no version")
                )))
            }
        }
    }

    /// `kubeadm upgrade apply` or `node`, as the lease says. A control-plane machine needs the
    /// controller's word: only it knows whether another machine has upgraded the cluster yet.
    async fn kubeadm_upgrade_step(&self, version: &str, mode: Option<KubeadmUpgrade>, control_plane: bool) -> Result<(), StepError> {
        let mode = match mode {
            Some(m) => m,
            None if !control_plane => KubeadmUpgrade::Node,
            None => {
                return Err(StepError::Permanent(
                    "the disruption lease did not say whether this control-plane machine runs kubeadm upgrade apply or node \
                     (link its pool to a cluster: spec.kubernetes.cluster)"
                        .into(),
                ));
            }
        };
        self.report.event("Normal", "KubeadmUpgrade", format!("running kubeadm upgrade {mode} for {version}"));
        kubeadm::upgrade(mode, version).await.map_err(|e| transient(format!("kubeadm upgrade {mode}: {e}")))?;
        Ledger::update(&self.state_dir, |l| l.kubeadm_upgraded = Some(version.to_owned())).map_err(transient)?;
        Ok(())
    }

    /// After the reboot: a new boot id means the machine rebooted; the kernel must be the one
    /// the boot loader was to start.
    async fn verify_reboot(&self, journal: &mut Journal) -> Result<StepDone, StepError> {
        let record = journal.reboot.clone().ok_or_else(|| transient("no reboot record"))?;
        let observed = observe::observe(&Self::root(), &Ledger::default(), &MachineSpec::default()).map_err(transient)?;
        if observed.boot_id == record.boot_id_before {
            // The agent restarted before the machine went down: ask again.
            systemd::reboot().await.map_err(transient)?;
            return Ok(StepDone::Rebooting);
        }
        match &record.expected_kernel {
            Some(k) if *k != observed.running_kernel => {
                Err(StepError::Permanent(format!("the machine came back on kernel {}, expected {k}", observed.running_kernel)))
            }
            _ => {
                self.report.event("Normal", "Rebooted", format!("running kernel {}", observed.running_kernel));
                Ok(StepDone::Done)
            }
        }
    }
}
