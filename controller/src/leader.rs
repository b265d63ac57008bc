//! Leadership among controller replicas.
//!
//! Every replica serves the API; the loops that must run once for the fleet (the rollout
//! pass with its scale-in and lease bookkeeping, and the reachability check) run only on the
//! leader. On the etcd store the leader is elected through etcd's election service with a
//! lease of `LEASE_TTL`: a leader that dies loses the lease when it expires and another
//! replica's campaign then succeeds; a leader that shuts down revokes it at once. A leader
//! that cannot renew its lease stops its loops `STEP_DOWN_MARGIN` before the lease can
//! expire at etcd, so two leaders never run loops at the same time while their clocks agree.
//!
//! Leadership is an efficiency, not the safety: every write the loops make is a
//! compare-and-swap in the store, so a stale leader's write is refused, never applied twice.
//! On SQLite there is one controller, and it always leads.

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use etcd_client::Client;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The election lease's time to live. A dead leader is replaced after at most this (and an
/// election round).
pub const LEASE_TTL: Duration = Duration::from_secs(6);
/// How often the lease is renewed.
const RENEW_EVERY: Duration = Duration::from_secs(2);
/// A leader that could not renew stops this long before its lease can expire.
const STEP_DOWN_MARGIN: Duration = Duration::from_secs(1);
/// Pause before campaigning again after a failure.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// Whether this replica leads now; `changed()` wakes on every change.
pub type Leading = watch::Receiver<bool>;

/// Runs `work` while this replica leads, giving it a token that is cancelled when leadership
/// is lost (or on shutdown), and starts it again when leadership comes back. Returns when
/// `cancel` fires, or with `work`'s error.
pub async fn while_leading<F, Fut>(mut leading: Leading, cancel: CancellationToken, work: F) -> anyhow::Result<()>
where
    F: Fn(CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            led = async { leading.wait_for(|l| *l).await.is_ok() } => if !led { return Ok(()) },
        }
        let term = cancel.child_token();
        let run = work(term.clone());
        tokio::pin!(run);
        tokio::select! {
            ended = &mut run => return ended,
            _ = async { leading.wait_for(|l| !*l).await.is_ok() } => {
                term.cancel();
                run.await?;
            }
        }
    }
}

/// A campaign for leadership under `name` in etcd, announcing `identity` (the replica's
/// host and URL) as the leader key's value.
pub struct EtcdElection {
    pub client: Client,
    pub name: String,
    pub identity: String,
}

impl std::fmt::Debug for EtcdElection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdElection").field("name", &self.name).field("identity", &self.identity).finish_non_exhaustive()
    }
}

/// How a term of office (or a campaign that did not win) ended.
enum TermEnd {
    Shutdown,
    Lost(String),
}

impl EtcdElection {
    /// Campaigns until `cancel`, publishing whether this replica leads through `leading`.
    pub async fn run(self, leading: watch::Sender<bool>, cancel: CancellationToken) -> anyhow::Result<()> {
        loop {
            let end = self.term(&leading, &cancel).await;
            leading.send_replace(false);
            match end {
                TermEnd::Shutdown => return Ok(()),
                TermEnd::Lost(why) => tracing::warn!(reason = %why, "not leading; campaigning again"),
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep(RETRY_DELAY) => {}
            }
        }
    }

    /// One lease: campaign with it, lead while it is renewed, give it up when done.
    async fn term(&self, leading: &watch::Sender<bool>, cancel: &CancellationToken) -> TermEnd {
        let ttl = i64::try_from(LEASE_TTL.as_secs()).unwrap_or(6);
        let asked = Instant::now();
        let lease = match self.client.lease_client().grant(ttl, None).await {
            Ok(granted) => granted.id(),
            Err(e) => return TermEnd::Lost(format!("granting the election lease: {e}")),
        };
        let end = self.hold(lease, asked, leading, cancel).await;
        // Revoking ends this replica's candidacy at once instead of after the TTL.
        let mut leases = self.client.lease_client();
        match tokio::time::timeout(Duration::from_secs(2), leases.revoke(lease)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, lease, "could not revoke the election lease; it expires by itself"),
            Err(_) => tracing::debug!(lease, "revoking the election lease timed out; it expires by itself"),
        }
        end
    }

    async fn hold(&self, lease: i64, granted_after: Instant, leading: &watch::Sender<bool>, cancel: &CancellationToken) -> TermEnd {
        let (mut keeper, mut renewals) = match self.client.lease_client().keep_alive(lease).await {
            Ok(k) => k,
            Err(e) => return TermEnd::Lost(format!("renewing the election lease: {e}")),
        };
        // The lease runs from when etcd granted it, which is after we asked.
        let mut valid_until = granted_after + LEASE_TTL;
        let mut unanswered: VecDeque<Instant> = VecDeque::new();
        let mut renew = tokio::time::interval(RENEW_EVERY);
        let campaign = || {
            let mut elections = self.client.election_client();
            let (name, identity) = (self.name.clone(), self.identity.clone());
            async move { elections.campaign(name, identity, lease).await }
        };
        let mut campaigning = Box::pin(campaign());
        let mut elected = false;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return TermEnd::Shutdown,
                won = &mut campaigning, if !elected => match won {
                    Ok(_) => {
                        elected = true;
                        leading.send_replace(true);
                        tracing::info!(identity = %self.identity, "leading the controller replicas");
                    }
                    // Requests carry the client's timeout (tonic reports it as cancelled): a
                    // campaign still waiting for the leader to go is simply asked again (with
                    // the same lease, the same key).
                    Err(etcd_client::Error::GRpcStatus(s)) if matches!(s.code(), tonic::Code::Cancelled | tonic::Code::DeadlineExceeded) => {
                        campaigning = Box::pin(campaign());
                    }
                    Err(e) => return TermEnd::Lost(format!("campaigning: {e}")),
                },
                _ = renew.tick() => {
                    if let Err(e) = keeper.keep_alive().await {
                        return TermEnd::Lost(format!("renewing the election lease: {e}"));
                    }
                    unanswered.push_back(Instant::now());
                }
                renewed = renewals.message() => match renewed {
                    Ok(Some(r)) if r.ttl() > 0 => {
                        let sent = unanswered.pop_front().unwrap_or(granted_after);
                        valid_until = valid_until.max(sent + Duration::from_secs(u64::try_from(r.ttl()).unwrap_or(0)));
                    }
                    Ok(Some(_)) => return TermEnd::Lost("the election lease expired".into()),
                    Ok(None) => return TermEnd::Lost("the lease renewal stream ended".into()),
                    Err(e) => return TermEnd::Lost(format!("renewing the election lease: {e}")),
                },
                _ = tokio::time::sleep_until(valid_until.checked_sub(STEP_DOWN_MARGIN).unwrap_or(valid_until)) => {
                    return TermEnd::Lost("the election lease could not be renewed in time".into());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn work_runs_only_while_leading_and_stops_when_leadership_goes() -> anyhow::Result<()> {
        let (tx, rx) = watch::channel(false);
        let cancel = CancellationToken::new();
        let running = Arc::new(AtomicUsize::new(0));
        let starts = Arc::new(AtomicUsize::new(0));
        let (r, s) = (running.clone(), starts.clone());
        let task = tokio::spawn(while_leading(rx, cancel.clone(), move |term| {
            let (r, s) = (r.clone(), s.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                r.fetch_add(1, Ordering::SeqCst);
                term.cancelled().await;
                r.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }
        }));
        let settle = || tokio::time::sleep(Duration::from_millis(50));
        settle().await;
        assert_eq!(running.load(Ordering::SeqCst), 0, "not leading: nothing runs");
        tx.send_replace(true);
        settle().await;
        assert_eq!(running.load(Ordering::SeqCst), 1);
        tx.send_replace(false);
        settle().await;
        assert_eq!(running.load(Ordering::SeqCst), 0, "leadership lost: the work stopped");
        tx.send_replace(true);
        settle().await;
        assert_eq!((running.load(Ordering::SeqCst), starts.load(Ordering::SeqCst)), (1, 2), "started again on a new term");
        cancel.cancel();
        task.await??;
        assert_eq!(running.load(Ordering::SeqCst), 0);
        Ok(())
    }
}
