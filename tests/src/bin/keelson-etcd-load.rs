//! keelson-etcd-load: the client the etcd VM scenario runs on the build machine while keelson
//! changes the cluster. It writes a key every `--interval-ms` (or right after the previous
//! write is answered, when that takes longer) through any member that answers, checks every
//! second, on its own, how many members report themselves healthy (probing again within the
//! second when fewer than a majority do: a planned leader change makes `/health` false for a
//! moment with every member up), and when `--stop-file` appears reads every key back. The
//! last line is a JSON summary: writes attempted, acknowledged and failed, acknowledged writes
//! missing at the end, the longest run of failed writes, write latency, the seconds in which
//! no probe found a healthy majority, and the seconds in which only a later probe did.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use keelson_agent::etcd::client::{EtcdClient, EtcdTls};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Write to an etcd cluster steadily and check that nothing acknowledged is lost")]
struct Args {
    /// Client URLs, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    endpoints: Vec<String>,
    #[arg(long)]
    ca: PathBuf,
    #[arg(long)]
    cert: PathBuf,
    #[arg(long)]
    key: PathBuf,
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    /// Stop writing when this file exists.
    #[arg(long)]
    stop_file: PathBuf,
    /// Key prefix to write under.
    #[arg(long, default_value = "/keelson-load/")]
    prefix: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    let tls = EtcdTls::from_files(&args.ca, &args.cert, &args.key)?;
    let client = EtcdClient::new(args.endpoints.clone(), Some(&tls))?;
    let started = Instant::now();

    // Health: every second, on its own, so that slow writes never space the checks out.
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let health = tokio::spawn(watch_health(client.clone(), args.endpoints.clone(), started, stopped));

    // Writes: one at a time, each started an interval after the one before, or as soon as the
    // one before is answered when that takes longer. (Sending on a fixed clock regardless
    // would pile writes up on guests that answer slower than the clock, as emulated VMs do,
    // until they collapse; a client that waits is also what a kube-apiserver's writes look
    // like to a member.)
    let mut tick = tokio::time::interval(Duration::from_millis(args.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut outcomes = Outcomes::default();
    let mut i = 0u64;
    while !args.stop_file.exists() {
        tick.tick().await;
        let key = format!("{}{i:08}", args.prefix);
        i += 1;
        let sent = Instant::now();
        let result = client.put(&key, &key).await.map(|_| ()).map_err(|e| e.to_string());
        outcomes.record(key, result, sent.elapsed());
    }
    let _ = stop.send(());
    let health = health.await?;

    let stored: HashSet<String> =
        client.get_prefix(&args.prefix).await.context("reading the keys back")?.into_iter().map(|(k, _)| k).collect();
    let lost: Vec<&String> = outcomes.acked.iter().filter(|k| !stored.contains(*k)).collect();
    outcomes.latencies.sort();
    let quantile = |q: f64| {
        let l = &outcomes.latencies;
        l.get(((l.len() as f64 * q) as usize).min(l.len().saturating_sub(1))).map_or(0, |d| d.as_millis())
    };
    println!(
        "{}",
        json!({
            "seconds": started.elapsed().as_secs(),
            "attempted": i,
            "acknowledged": outcomes.acked.len(),
            "failed": outcomes.failed,
            "longest_failed_run": outcomes.longest_run,
            "lost": lost.len(),
            "lost_keys": lost.iter().take(10).collect::<Vec<_>>(),
            "write_p50_ms": quantile(0.5),
            "write_p99_ms": quantile(0.99),
            "health_checks": health.checks,
            "without_quorum": health.without_quorum,
            "brief_dips": health.brief_dips,
            "last_error": outcomes.last_error,
        })
    );
    Ok(())
}

#[derive(Default)]
struct Outcomes {
    acked: Vec<String>,
    latencies: Vec<Duration>,
    failed: u64,
    run: u64,
    longest_run: u64,
    last_error: String,
}

impl Outcomes {
    fn record(&mut self, key: String, result: Result<(), String>, took: Duration) {
        match result {
            Ok(()) => {
                self.acked.push(key);
                self.latencies.push(took);
                self.run = 0;
            }
            Err(e) => {
                self.failed += 1;
                self.run += 1;
                self.longest_run = self.longest_run.max(self.run);
                self.last_error = e;
            }
        }
    }
}

/// How often within one second the members are probed again when fewer than a majority
/// answer healthy, and how far apart.
const PROBES_PER_SECOND: usize = 3;
const PROBE_GAP: Duration = Duration::from_millis(300);

/// What the health checks saw.
#[derive(Default)]
struct Health {
    checks: u64,
    /// Seconds in which no probe found a majority of members healthy: quorum lost.
    without_quorum: Vec<String>,
    /// Seconds in which the first probe found fewer than a majority but a later one found a
    /// majority: etcd answers `/health` false while a leader is elected, which a planned
    /// leadership transfer causes for a few hundred milliseconds with every member up.
    brief_dips: Vec<String>,
}

/// Every second until `stop`, counts the members that report themselves healthy, probing up
/// to `PROBES_PER_SECOND` times when fewer than a majority do.
async fn watch_health(
    client: EtcdClient,
    endpoints: Vec<String>,
    started: Instant,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Health {
    let majority = endpoints.len() / 2 + 1;
    let mut health = Health::default();
    let mut every_second = tokio::time::interval(Duration::from_secs(1));
    every_second.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every_second.tick() => {}
            _ = &mut stop => return health,
        }
        health.checks += 1;
        let at = started.elapsed().as_secs_f64();
        let mut seen = Vec::new();
        for probe in 0..PROBES_PER_SECOND {
            if probe > 0 {
                tokio::time::sleep(PROBE_GAP).await;
            }
            let answers = futures_util::future::join_all(endpoints.iter().map(|e| client.healthy(e))).await;
            seen.push(answers.into_iter().filter(|h| *h).count());
            if seen[probe] >= majority {
                break;
            }
        }
        let counts = seen.iter().map(ToString::to_string).collect::<Vec<_>>().join(", then ");
        if seen.iter().all(|&n| n < majority) {
            health.without_quorum.push(format!("{at:.0}s: {counts} of {} healthy", endpoints.len()));
        } else if seen.len() > 1 {
            health.brief_dips.push(format!("{at:.0}s: {counts} of {} healthy", endpoints.len()));
        }
    }
}
