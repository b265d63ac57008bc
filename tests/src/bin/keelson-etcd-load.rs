//! keelson-etcd-load: the client the etcd VM scenario runs on the build machine while keelson
//! changes the cluster. It writes a key every `--interval-ms` through any member that answers,
//! checks every second how many members report themselves healthy, and when `--stop-file`
//! appears reads every key back. The last line is a JSON summary: writes acknowledged and
//! failed, acknowledged writes missing at the end, the longest run of failed writes, and the
//! seconds in which fewer than a majority of members were healthy.

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
    let majority = args.endpoints.len() / 2 + 1;

    let started = Instant::now();
    let (mut acked, mut failed, mut run, mut longest_run) = (Vec::new(), 0u64, 0u64, 0u64);
    let (mut checks, mut without_quorum) = (0u64, Vec::new());
    let mut next_check = Instant::now();
    let mut last_error = String::new();
    let mut i = 0u64;
    while !args.stop_file.exists() {
        let key = format!("{}{i:08}", args.prefix);
        match client.put(&key, &i.to_string()).await {
            Ok(_) => {
                acked.push(key);
                run = 0;
            }
            Err(e) => {
                failed += 1;
                run += 1;
                longest_run = longest_run.max(run);
                last_error = e.to_string();
            }
        }
        i += 1;
        if Instant::now() >= next_check {
            next_check += Duration::from_secs(1);
            checks += 1;
            let mut healthy = 0;
            for e in &args.endpoints {
                if client.healthy(e).await {
                    healthy += 1;
                }
            }
            if healthy < majority {
                without_quorum.push(format!("{:.0}s: {healthy} of {} healthy", started.elapsed().as_secs_f64(), args.endpoints.len()));
            }
        }
        tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
    }

    let stored: HashSet<String> =
        client.get_prefix(&args.prefix).await.context("reading the keys back")?.into_iter().map(|(k, _)| k).collect();
    let lost: Vec<&String> = acked.iter().filter(|k| !stored.contains(*k)).collect();
    println!(
        "{}",
        json!({
            "seconds": started.elapsed().as_secs(),
            "acknowledged": acked.len(),
            "failed": failed,
            "longest_failed_run": longest_run,
            "lost": lost.len(),
            "lost_keys": lost.iter().take(10).collect::<Vec<_>>(),
            "health_checks": checks,
            "without_quorum": without_quorum,
            "last_error": last_error,
        })
    );
    Ok(())
}
