//! `keelson-agent run`: enroll if needed, then keep three owned tasks going until shutdown —
//! the spec long-poll, the status sender, and the reconcile loop — plus systemd notifications.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use keelson_api::meta::{ConditionStatus, condition, find_condition};
use keelson_api::wire::{AgentSpec, AgentStatus};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::client::Controller;
use crate::config::AgentConfig;
use crate::drivers::systemd;
use crate::enroll::{EnrollOptions, default_name, enroll};
use crate::reconcile::{Outcome, Reconciler, Report};
use crate::state::CERT_FILE;

const LONG_POLL_SECS: u64 = 60;
/// Rotate the machine certificate when less than this much of its life is left.
const ROTATE_WHEN_LEFT_SECS: i64 = 10 * 24 * 3600;
const BACKOFF_MAX_SECS: u64 = 60;

/// Exponential backoff with jitter, so a fleet does not retry in step.
fn backoff(attempt: u32) -> Duration {
    let base = 1u64 << attempt.min(6);
    let capped = base.min(BACKOFF_MAX_SECS);
    let jitter: f64 = rand::random::<f64>() * 0.5 + 0.75;
    Duration::from_secs_f64(capped as f64 * jitter)
}

async fn ensure_enrolled(config: &AgentConfig, cancel: &CancellationToken) -> anyhow::Result<()> {
    if config.state_dir.join(CERT_FILE).exists() {
        return Ok(());
    }
    let token = config.token.clone().context("not enrolled and no token configured: set token in the agent configuration")?;
    let name = match &config.name {
        Some(n) => n.clone(),
        None => default_name()?,
    };
    let mut attempt = 0;
    loop {
        for server in &config.servers {
            let opts = EnrollOptions {
                server: server.clone(),
                ca_file: config.ca_file.clone(),
                token: token.clone(),
                name: name.clone(),
                state_dir: config.state_dir.clone(),
            };
            match enroll(&opts).await {
                Ok(answer) => {
                    tracing::info!(name = %answer.name, %server, "enrolled");
                    return Ok(());
                }
                // A refusal will not change by retrying (bad token, name taken).
                Err(e @ crate::enroll::EnrollError::Refused { .. }) => return Err(e.into()),
                Err(e) => tracing::warn!(%server, error = %e, "enrollment failed; retrying"),
            }
        }
        attempt += 1;
        tokio::select! {
            _ = tokio::time::sleep(backoff(attempt)) => {}
            _ = cancel.cancelled() => anyhow::bail!("shut down before enrolling"),
        }
    }
}

pub async fn run(config: AgentConfig, cancel: CancellationToken) -> anyhow::Result<()> {
    crate::state::ensure_dir(&config.state_dir)?;
    ensure_enrolled(&config, &cancel).await?;
    let controller = Controller::from_state(&config.state_dir, &config.servers)?;
    let report = Arc::new(Report::default());
    let (spec_tx, spec_rx) = watch::channel::<Option<AgentSpec>>(None);

    let mut tasks: JoinSet<anyhow::Result<()>> = JoinSet::new();
    // Its own token: a decommission stops the poller before the controller revokes the
    // identity, so that the poller's 403 is not taken for a failure.
    let polling = cancel.child_token();
    tasks.spawn(poll_spec(controller.clone(), spec_tx, polling.clone()));
    tasks.spawn(send_status(controller.clone(), report.clone(), spec_rx.clone(), config.heartbeat_interval, cancel.clone()));
    let rotation = Rotation { state_dir: config.state_dir.clone(), controller: controller.clone(), name: identity_name(&config)? };
    let reconciler = Reconciler {
        state_dir: config.state_dir.clone(),
        name: identity_name(&config)?,
        etcd_address: crate::facts::etcd_address(config.etcd_advertise_address),
        controller,
        lease_ttl: config.lease_ttl,
        report: report.clone(),
        cancel: cancel.clone(),
    };
    let intervals = Intervals { drift: config.drift_interval, etcd_refresh: config.heartbeat_interval };
    tasks.spawn(reconcile_loop(reconciler, rotation, spec_rx, intervals, polling, cancel.clone()));
    tasks.spawn(watchdog(cancel.clone()));
    notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status("waiting for the spec")]);

    let mut result = Ok(());
    while let Some(joined) = tasks.join_next().await {
        if let Err(e) = joined.map_err(anyhow::Error::from).and_then(|r| r)
            && result.is_ok()
        {
            result = Err(e);
        }
        cancel.cancel();
    }
    notify(&[sd_notify::NotifyState::Stopping]);
    result
}

fn notify(states: &[sd_notify::NotifyState<'_>]) {
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        let _ = sd_notify::notify(states);
    }
}

/// Pings the systemd watchdog at half its interval while the process is alive.
async fn watchdog(cancel: CancellationToken) -> anyhow::Result<()> {
    let Some(usec) = std::env::var("WATCHDOG_USEC").ok().and_then(|v| v.parse::<u64>().ok()) else {
        cancel.cancelled().await;
        return Ok(());
    };
    let period = Duration::from_micros(usec / 2);
    loop {
        notify(&[sd_notify::NotifyState::Watchdog]);
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = cancel.cancelled() => return Ok(()),
        }
    }
}

async fn poll_spec(controller: Controller, tx: watch::Sender<Option<AgentSpec>>, cancel: CancellationToken) -> anyhow::Result<()> {
    let mut after = 0;
    let mut failures = 0;
    loop {
        let answer = tokio::select! {
            a = controller.spec(after, Duration::from_secs(LONG_POLL_SECS)) => a,
            _ = cancel.cancelled() => return Ok(()),
        };
        match answer {
            Ok(spec) => {
                failures = 0;
                if spec.changed || spec.generation != after {
                    after = spec.generation;
                    tracing::info!(generation = spec.generation, "received the spec");
                    tx.send_replace(Some(spec));
                }
            }
            Err(e) if e.status() == Some(403) || e.status() == Some(401) => {
                anyhow::bail!("the controller no longer accepts this machine's identity: {e}");
            }
            Err(e) => {
                failures += 1;
                let wait = backoff(failures);
                tracing::warn!(error = %e, retry_in = ?wait, "could not fetch the spec; the machine is left as it is");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = cancel.cancelled() => return Ok(()),
                }
            }
        }
    }
}

async fn send_status(
    controller: Controller,
    report: Arc<Report>,
    spec: watch::Receiver<Option<AgentSpec>>,
    every: Duration,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let facts = crate::facts::collect();
    let mut first = true;
    loop {
        tokio::select! {
            _ = report.changed.notified() => {}
            _ = tokio::time::sleep(every) => {}
            _ = cancel.cancelled() => return Ok(()),
        }
        let desired = spec.borrow().as_ref().map(|s| s.spec.clone()).unwrap_or_default();
        let degraded =
            find_condition(&report.snapshot().conditions, condition::DEGRADED).is_some_and(|c| c.status == ConditionStatus::True);
        let runtime_ok = (desired.container_runtime.is_none() || systemd::is_active("containerd").await)
            && (desired.kubelet.is_none() || systemd::is_active("kubelet").await);
        let (ready, reason, message) = match (degraded, runtime_ok) {
            (true, _) => (ConditionStatus::False, "Degraded", "see the Degraded condition"),
            (false, false) => (ConditionStatus::False, "ComponentDown", "containerd or the kubelet is not active"),
            (false, true) => (ConditionStatus::True, "Healthy", ""),
        };
        // Only Ready is the sender's: set it in place, so the reconciler's conditions,
        // changed while we asked systemd, are not overwritten with an older copy.
        report.update_quietly(|s| {
            keelson_api::meta::set_condition(&mut s.conditions, condition::READY, ready, reason, message, keelson_api::meta::now());
        });
        let state = report.snapshot();
        let status = AgentStatus {
            phase: state.phase,
            observed_generation: state.observed_generation,
            conditions: state.conditions,
            versions: state.versions.clone(),
            facts: first.then(|| facts.clone()),
            current_step: state.current_step.clone(),
            etcd: state.etcd.clone(),
        };
        if let Some(step) = &state.current_step {
            let text = format!("{}/{} {}", step.index, step.total, step.description);
            notify(&[sd_notify::NotifyState::Status(&text)]);
        }
        match controller.status(&status).await {
            Ok(()) => first = false,
            Err(e) => tracing::warn!(error = %e, "could not report status"),
        }
        let events = report.take_events();
        if !events.is_empty()
            && let Err(e) = controller.events(events.clone()).await
        {
            tracing::warn!(error = %e, "could not send events; keeping them");
            report.update(|s| {
                let mut kept = events;
                kept.append(&mut s.events);
                s.events = kept;
            });
        }
    }
}

/// Whether the running executable was replaced on disk since it started.
fn binary_replaced() -> bool {
    std::fs::read_link("/proc/self/exe").is_ok_and(|p| p.to_string_lossy().ends_with(" (deleted)"))
}

/// The machine's name, as enrolled.
fn identity_name(config: &AgentConfig) -> anyhow::Result<keelson_api::meta::Name> {
    let path = config.state_dir.join(crate::state::IDENTITY_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let record: crate::enroll::IdentityRecord = serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    Ok(record.name)
}

#[derive(Debug)]
struct Rotation {
    state_dir: std::path::PathBuf,
    controller: Controller,
    name: keelson_api::meta::Name,
}

impl Rotation {
    /// Rotates the certificate when it is due. Returns whether it did: the process then exits
    /// between steps so that systemd starts it again on the new identity.
    async fn rotate_if_due(&self) -> bool {
        let Ok(expiry) = crate::enroll::certificate_expiry(&self.state_dir) else { return false };
        if expiry - keelson_api::meta::now() > time::Duration::seconds(ROTATE_WHEN_LEFT_SECS) {
            return false;
        }
        match crate::enroll::rotate(&self.state_dir, &self.controller, &self.name).await {
            Ok(()) => {
                tracing::info!("rotated the machine certificate");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "certificate rotation failed; trying again later");
                false
            }
        }
    }
}

/// The machine was deleted: reset it, tell the controller (which then forgets it), forget
/// the identity, and keep the agent from starting again at boot. The agent then exits 0, which
/// systemd (`Restart=on-failure`) leaves alone.
async fn decommission(
    reconciler: &Reconciler,
    spec: &mut watch::Receiver<Option<AgentSpec>>,
    polling: &CancellationToken,
    cancel: &CancellationToken,
) -> anyhow::Result<()> {
    let report = &reconciler.report;
    report.event("Normal", "ResetStarted", "the machine was deleted: undoing what keelson installed");
    report.condition(condition::UPDATING, ConditionStatus::True, "Resetting", "the machine was deleted");
    // An etcd member leaves its cluster first; while that would cost the cluster its quorum
    // (or its last member) nothing is undone, and the refusal is what the status says. The
    // spec is still polled meanwhile: the operator may force the removal.
    let ledger_spec = crate::ledger::Ledger::load(&reconciler.state_dir).unwrap_or_default().spec.unwrap_or_default();
    let mut attempt = 0;
    loop {
        let force = spec.borrow_and_update().as_ref().is_some_and(|s| s.force_etcd_leave);
        match reconciler.leave_etcd(&ledger_spec, force).await {
            Ok(Some(what)) => {
                report.event(if force { "Warning" } else { "Normal" }, "EtcdMemberRemoved", what);
                break;
            }
            Ok(None) => break,
            Err(e) => {
                report.condition(condition::DEGRADED, ConditionStatus::True, "EtcdLeaveRefused", &e);
                report.event("Warning", "EtcdLeaveRefused", format!("not resetting yet: {e}"));
                attempt += 1;
                tokio::select! {
                    _ = tokio::time::sleep(backoff(attempt)) => {}
                    r = spec.changed() => r?,
                    _ = cancel.cancelled() => anyhow::bail!("stopped while the etcd member could not leave its cluster"),
                }
            }
        }
    }
    // The reset revokes this machine's identity: nothing more to ask the controller for.
    polling.cancel();
    report.condition(condition::DEGRADED, ConditionStatus::False, "AsExpected", "");
    let reset = crate::reset::reset_machine(&reconciler.state_dir).await;
    let summary = reset.summary();
    tracing::info!(%summary, "reset done");
    let mut attempt = 0;
    loop {
        let events = report.take_events();
        let sent = async {
            if !events.is_empty() {
                reconciler.controller.events(events.clone()).await?;
            }
            reconciler.controller.reset_done(&summary).await
        }
        .await;
        match sent {
            Ok(()) => break,
            Err(e) => {
                report.update(|s| {
                    s.events.splice(0..0, events);
                });
                attempt += 1;
                tracing::warn!(error = %e, "could not report the reset; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff(attempt)) => {}
                    _ = cancel.cancelled() => anyhow::bail!("stopped before the controller heard of the reset; it runs again at the next start"),
                }
            }
        }
    }
    crate::reset::forget_identity(&reconciler.state_dir).context("forgetting the machine's identity")?;
    if let Err(e) = systemd::disable("keelson-agent").await {
        tracing::warn!(error = %e, "could not disable keelson-agent; it would fail to start without an identity anyway");
    }
    Ok(())
}

/// How often the reconcile loop wakes between passes.
struct Intervals {
    /// A full pass (observe, plan, correct drift) without a new spec.
    drift: Duration,
    /// Re-reading the etcd member's state (raft index, leader, health) for the status, so the
    /// pool's view of the cluster is as fresh as the heartbeat.
    etcd_refresh: Duration,
}

async fn reconcile_loop(
    reconciler: Reconciler,
    rotation: Rotation,
    mut spec: watch::Receiver<Option<AgentSpec>>,
    intervals: Intervals,
    polling: CancellationToken,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    // Nothing to do before the first spec arrives.
    loop {
        if spec.borrow().is_some() {
            break;
        }
        tokio::select! {
            r = spec.changed() => r?,
            _ = cancel.cancelled() => return Ok(()),
        }
    }
    loop {
        let current = spec.borrow_and_update().clone();
        let Some(current) = current else { continue };
        if current.deleting {
            decommission(&reconciler, &mut spec, &polling, &cancel).await?;
            cancel.cancel();
            return Ok(());
        }
        reconciler.refresh_versions(&current.spec);
        let outcome = reconciler.reconcile(current.generation, &current.spec).await;
        reconciler.refresh_versions(&current.spec);
        reconciler.refresh_etcd(&current.spec).await;
        tracing::info!(generation = current.generation, ?outcome, "reconcile pass ended");
        match outcome {
            Outcome::Rebooting | Outcome::Interrupted => {
                // systemd stops us for the reboot; shutdown ends the loop.
                cancel.cancelled().await;
                return Ok(());
            }
            Outcome::Converged | Outcome::Degraded { .. } => {}
        }
        if rotation.rotate_if_due().await {
            anyhow::bail!("rotated the machine certificate; exiting so that systemd starts the agent on it");
        }
        if binary_replaced() {
            // A package upgrade replaced this binary (its postinst leaves the restart to us):
            // exit non-zero between steps so systemd starts the new one, which resumes.
            anyhow::bail!("keelson-agent was upgraded on disk; exiting so that systemd starts the new binary");
        }
        let drift_at = tokio::time::Instant::now() + intervals.drift;
        let mut etcd_refresh = tokio::time::interval_at(tokio::time::Instant::now() + intervals.etcd_refresh, intervals.etcd_refresh);
        etcd_refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                r = spec.changed() => { r?; break }
                _ = tokio::time::sleep_until(drift_at) => break,
                _ = etcd_refresh.tick(), if current.spec.etcd.is_some() => reconciler.refresh_etcd(&current.spec).await,
                _ = cancel.cancelled() => return Ok(()),
            }
        }
    }
}
