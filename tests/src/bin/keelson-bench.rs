//! keelson-bench: measures the real controller over mTLS on this machine.
//!
//! It starts a controller in a temporary directory, enrolls N machines (each with its own key
//! and certificate, through the real enrollment endpoint), then measures
//! 1. status writes: every machine writes its status in a loop for a fixed time;
//!    throughput and latency percentiles;
//! 2. fan-out: every machine long-polls its spec; the pool template changes; time until each
//!    machine has the new generation.
//!
//! The last line printed is a JSON summary. Talks only to the controller it starts on loopback.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use keelson_tests::{ApiClient, Controller, percentile, runtime_spec, status_report};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Benchmark the keelson controller over mTLS")]
struct Args {
    /// Simulated machines.
    #[arg(long, default_value_t = 1000)]
    machines: usize,
    /// Seconds of each status-write phase.
    #[arg(long, default_value_t = 10)]
    status_seconds: u64,
    /// Offered status writes per second, spread evenly over the machines (the paced phase).
    #[arg(long, default_value_t = 2000)]
    status_rate: u64,
    /// Fan-out rounds (template changes) to measure.
    #[arg(long, default_value_t = 3)]
    fanout_rounds: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let controller = Controller::start(dir.path(), &["--unreachable-after-seconds", "600"])?;
    let admin = controller.admin()?;
    let pool = |version: &str| {
        json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": "bench"},
               "spec": {"selector": {"matchLabels": {"pool": "bench"}}, "template": {"spec": runtime_spec(version)}}})
    };
    let a = admin.put("/v1/pools/bench", &pool("1.6.20~ds1-1+deb12u1")).await?;
    if a.status != 200 {
        bail!("creating the pool: {}", a.text);
    }
    let token = controller.token(&["--labels", "pool=bench", "--usages", &args.machines.to_string()])?;

    eprintln!("enrolling {} machines…", args.machines);
    let started = Instant::now();
    let ca = controller.ca_pem()?;
    let anon = controller.anonymous()?;
    let mut machines = Vec::with_capacity(args.machines);
    let mut enrollments = tokio::task::JoinSet::new();
    let limit = Arc::new(tokio::sync::Semaphore::new(32));
    for i in 0..args.machines {
        let (anon, token, ca, base, limit) = (anon.clone(), token.clone(), ca.clone(), controller.url.clone(), limit.clone());
        enrollments.spawn(async move {
            let _permit = limit.acquire().await?;
            let name: keelson_api::meta::Name = format!("sim-{i:05}").parse()?;
            let (key, csr) = keelson_agent::enroll::make_key_and_csr(&name)?;
            let a = anon.post("/v1/enroll", &json!({"token": token, "csr": csr, "name": name})).await?;
            if a.status != 200 {
                bail!("enroll {name}: {}", a.text);
            }
            let cert = a.body["certificate"].as_str().context("no certificate")?.to_owned();
            ApiClient::new(&base, &ca, Some((&cert, &key.serialize_pem())))
        });
    }
    while let Some(m) = enrollments.join_next().await {
        machines.push(m??);
    }
    let enroll_seconds = started.elapsed().as_secs_f64();
    eprintln!("enrolled in {enroll_seconds:.1}s");

    // 1a. Status writes as fast as the machines can go: the ceiling.
    let saturated = status_phase(&machines, Duration::from_secs(args.status_seconds), None).await?;
    let saturated_per_second = saturated.len() as f64 / args.status_seconds as f64;
    eprintln!(
        "status, saturated: {saturated_per_second:.0}/s, p50 {:.1} ms, p99 {:.1} ms",
        percentile(&saturated, 50.0),
        percentile(&saturated, 99.0)
    );
    // 1b. Status writes at the offered rate: the latency a fleet sees.
    let interval = Duration::from_secs_f64(machines.len() as f64 / args.status_rate.max(1) as f64);
    let latencies = status_phase(&machines, Duration::from_secs(args.status_seconds), Some(interval)).await?;
    let writes_per_second = latencies.len() as f64 / args.status_seconds as f64;
    eprintln!(
        "status at {} offered/s: {writes_per_second:.0}/s done, p50 {:.1} ms, p99 {:.1} ms",
        args.status_rate,
        percentile(&latencies, 50.0),
        percentile(&latencies, 99.0)
    );

    // 2. Fan-out of a template change to every long-polling machine.
    let mut fanout_p99 = Vec::new();
    let mut fanout_max = Vec::new();
    let versions = ["1.6.20~ds1-1+deb12u2", "1.6.20~ds1-1+deb12u3", "1.6.20~ds1-1+deb12u4", "1.6.20~ds1-1+deb12u5"];
    for round in 0..args.fanout_rounds {
        let generation = admin.get("/v1/machines/sim-00000").await?.body["metadata"]["generation"].as_u64().context("generation")?;
        let mut pollers = tokio::task::JoinSet::new();
        for m in &machines {
            let m = m.clone();
            pollers.spawn(async move {
                let a = m.get(&format!("/v1/agent/spec?after={generation}&timeoutSeconds=60")).await?;
                if a.body["changed"] != true {
                    bail!("poll ended without a change: {}", a.text);
                }
                Ok(Instant::now())
            });
        }
        // Let every poll reach the controller before the change.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let changed_at = Instant::now();
        let a = admin.put("/v1/pools/bench", &pool(versions[round % versions.len()])).await?;
        if a.status != 200 {
            bail!("template change: {}", a.text);
        }
        let mut delays = Vec::new();
        while let Some(t) = pollers.join_next().await {
            delays.push(t??.duration_since(changed_at).as_secs_f64() * 1000.0);
        }
        delays.sort_by(f64::total_cmp);
        eprintln!(
            "fan-out round {round}: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
            percentile(&delays, 50.0),
            percentile(&delays, 99.0),
            percentile(&delays, 100.0)
        );
        fanout_p99.push(percentile(&delays, 99.0));
        fanout_max.push(percentile(&delays, 100.0));
    }
    fanout_p99.sort_by(f64::total_cmp);
    fanout_max.sort_by(f64::total_cmp);

    let rss_kib = std::fs::read_to_string(format!("/proc/{}/status", controller.child.id()))?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:").and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse::<u64>().ok()))
        .unwrap_or(0);
    let summary = json!({
        "machines": args.machines,
        "enroll_seconds": round1(enroll_seconds),
        "status_saturated_per_second": round1(saturated_per_second),
        "status_saturated_p99_ms": round1(percentile(&saturated, 99.0)),
        "status_offered_per_second": args.status_rate,
        "status_per_second": round1(writes_per_second),
        "status_p50_ms": round1(percentile(&latencies, 50.0)),
        "status_p99_ms": round1(percentile(&latencies, 99.0)),
        "fanout_p99_ms_median": round1(percentile(&fanout_p99, 50.0)),
        "fanout_max_ms_median": round1(percentile(&fanout_max, 50.0)),
        "controller_rss_mib": round1(rss_kib as f64 / 1024.0),
    });
    println!("{summary}");
    Ok(())
}

/// Every machine writes its status until `length` has passed: back to back, or once per
/// `interval` from a staggered start. Returns the sorted latencies in milliseconds.
async fn status_phase(machines: &[ApiClient], length: Duration, interval: Option<Duration>) -> anyhow::Result<Vec<f64>> {
    let start = tokio::time::Instant::now();
    let deadline = start + length;
    let mut writers = tokio::task::JoinSet::new();
    for (i, m) in machines.iter().enumerate() {
        let m = m.clone();
        let offset = interval.map(|iv| iv.mul_f64(i as f64 / machines.len() as f64));
        writers.spawn(async move {
            let mut latencies = Vec::new();
            let body = status_report(0);
            let mut next = start + offset.unwrap_or_default();
            loop {
                if let Some(iv) = interval {
                    tokio::time::sleep_until(next).await;
                    next += iv;
                }
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
                let t = Instant::now();
                let a = m.put("/v1/agent/status", &body).await?;
                if a.status != 204 {
                    bail!("status write: {} {}", a.status, a.text);
                }
                latencies.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            Ok(latencies)
        });
    }
    let mut latencies = Vec::new();
    while let Some(l) = writers.join_next().await {
        latencies.extend(l??);
    }
    latencies.sort_by(f64::total_cmp);
    Ok(latencies)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
