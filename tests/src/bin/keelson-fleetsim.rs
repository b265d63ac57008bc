//! keelson-fleetsim: a fleet of simulated machines against a real controller, to measure
//! what the controller costs at scale.
//!
//! Each simulated machine is the agent's own protocol code (`keelson_agent::enroll` and
//! `keelson_agent::client::Controller`): it enrolls with a bootstrap token and a CSR, holds
//! its mTLS identity, long-polls its spec, heartbeats its status, and takes a disruption lease
//! before "upgrading". Nothing touches the host: an upgrade is done the moment it is received.
//! The controller is the real binary, started here on loopback with the chosen store.
//!
//! Phases: enroll every machine; heartbeats only, for `--duration` seconds (status latency,
//! throughput, the controller's CPU); a template change that every machine may take at once
//! (fan-out: from the change until each machine has it); a rollout of the whole fleet at
//! `maxUnavailable: 10%` (from the change until the pool reports it rolled out). The last line
//! on stdout is a JSON summary.
//!
//! `--ceiling` runs the same machines' heartbeats against a minimal HTTPS server on the same
//! stack (rustls, hyper, axum, the controller's TLS setup) that answers every status without
//! storing it: what the controller's own work adds is the difference.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Parser;
use futures_util::StreamExt;
use keelson_agent::client::{Controller, LeaseAnswer};
use keelson_agent::enroll::{EnrollOptions, enroll};
use keelson_api::wire::AgentStatus;
use keelson_tests::{ApiClient, percentile, status_report};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(name = "keelson-fleetsim", about = "simulated machines against a real keelson-controller")]
struct Args {
    /// How many machines.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=50_000))]
    machines: u32,
    /// The controller's store: sqlite, or etcd://HOST:PORT[,…] (a prefix of this run's own is used).
    #[arg(long, default_value = "sqlite")]
    store: String,
    /// Seconds of heartbeats only, measured.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    duration: u64,
    /// Seconds between a machine's heartbeats (the agent's default is 10).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=300))]
    heartbeat_seconds: u64,
    /// Machines enrolling at the same time.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1024))]
    enroll_concurrency: u64,
    /// Measure heartbeats against a minimal HTTPS server instead of the controller.
    #[arg(long)]
    ceiling: bool,
}

/// What the machines measure, shared by all of them.
#[derive(Default)]
struct Stats {
    /// Status round trips (ms) while `recording`.
    status_ms: Mutex<Vec<f64>>,
    recording: AtomicBool,
    status_errors: AtomicU64,
    /// How many status reports failed, by error (its first line): a count alone
    /// does not say whether the controller refused, conflicted or timed out.
    status_error_kinds: Mutex<BTreeMap<String, u64>>,
    /// Template marker → when each machine received it.
    received: Mutex<HashMap<String, Vec<Instant>>>,
    lease_waits: AtomicU64,
}

fn main() -> anyhow::Result<()> {
    raise_open_files_limit()?;
    if let Some(dir) = std::env::var_os(CEILING_ENV) {
        return serve_ceiling(Path::new(&dir));
    }
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let summary = runtime.block_on(run(&args))?;
    println!("{summary}");
    Ok(())
}

/// Every simulated machine holds a connection, and so does the controller for each: both
/// processes need more descriptors than the usual soft limit.
fn raise_open_files_limit() -> anyhow::Result<()> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let want = 200_000;
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < want {
        // Raising the hard limit needs root; without it take what the hard limit allows.
        if setrlimit(Resource::RLIMIT_NOFILE, want, want.max(hard)).is_err() {
            setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
        }
    }
    Ok(())
}

fn pool(marker: &str, max_unavailable: &str) -> serde_json::Value {
    json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": "sim"},
           "spec": {"selector": {"matchLabels": {"pool": "sim"}}, "rollout": {"maxUnavailable": max_unavailable},
                    "template": {"spec": {"roles": ["worker"], "files": [{"path": "/etc/keelson-sim", "content": marker}]}}}})
}

async fn run(args: &Args) -> anyhow::Result<serde_json::Value> {
    let work = tempfile::tempdir()?;
    let data_dir = work.path().join("controller");
    let mut controller_args = vec!["--reconcile-interval-seconds".to_owned(), "1".to_owned()];
    // Three missed heartbeats, as with the defaults.
    controller_args.extend(["--unreachable-after-seconds".to_owned(), (3 * args.heartbeat_seconds).to_string()]);
    if args.store == "sqlite" {
        controller_args.extend(["--store".into(), "sqlite".into()]);
    } else if args.store.starts_with("etcd://") {
        let prefix = format!("/keelson-fleetsim-{}", time::OffsetDateTime::now_utc().unix_timestamp());
        controller_args.extend(["--store".into(), args.store.clone(), "--etcd-prefix".into(), prefix]);
    } else {
        bail!("--store {:?}: expected sqlite or etcd://HOST:PORT[,…]", args.store);
    }
    let argv: Vec<&str> = controller_args.iter().map(String::as_str).collect();
    let controller = keelson_tests::Controller::start(&data_dir, &argv)?;
    let pid = controller.child.id();
    let admin = controller.admin()?;
    let n = args.machines as usize;

    let put = admin.put("/v1/pools/sim", &pool("1", "100%")).await?;
    anyhow::ensure!(put.status == 200, "creating the pool: {}", put.text);
    let token = admin.post("/v1/tokens", &json!({"usageLimit": args.machines, "labels": {"pool": "sim"}})).await?;
    let token = token.body["token"].as_str().ok_or_else(|| anyhow!("no token in {}", token.text))?.to_owned();

    // Enroll, as `keelson-agent enroll` does.
    eprintln!("fleetsim: enrolling {n} machines");
    let started = Instant::now();
    let ca_file = data_dir.join("ca.crt");
    let states = work.path().join("machines");
    let enrolled: Vec<anyhow::Result<(String, PathBuf)>> = futures_util::stream::iter(0..n)
        .map(|i| {
            let name = format!("sim-{i:05}");
            let opts = EnrollOptions {
                server: controller.url.clone(),
                ca_file: ca_file.clone(),
                token: token.clone(),
                name: name.parse().unwrap_or_else(|e| panic!("{name}: {e}")),
                state_dir: states.join(&name),
            };
            async move {
                enroll(&opts).await.with_context(|| format!("enrolling {name}"))?;
                Ok((name, opts.state_dir))
            }
        })
        .buffer_unordered(usize::try_from(args.enroll_concurrency).unwrap_or(32))
        .collect()
        .await;
    let enroll_seconds = started.elapsed().as_secs_f64();
    let machines: Vec<(String, PathBuf)> = enrolled.into_iter().collect::<anyhow::Result<_>>()?;

    let stats = Arc::new(Stats::default());
    let ceiling = if args.ceiling { Some(Ceiling::start(&data_dir).await?) } else { None };
    let url = ceiling.as_ref().map_or(controller.url.clone(), |c| c.url.clone());
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (name, state)) in machines.iter().enumerate() {
        let client = Controller::from_state(state, std::slice::from_ref(&url)).map_err(|e| anyhow!("{name}: {e}"))?;
        // Heartbeats spread evenly over the interval, as independent machines' would be.
        let offset = Duration::from_secs(args.heartbeat_seconds).mul_f64(i as f64 / n as f64);
        let beat = Duration::from_secs(args.heartbeat_seconds);
        tasks.spawn(machine(client, stats.clone(), offset, beat, !args.ceiling));
    }

    // Every machine has its first spec and has reported it: the fleet is in steady state.
    if !args.ceiling {
        wait_until(Duration::from_secs(300), "every machine Ready with its first spec", || async {
            let p = admin.get("/v1/pools/sim").await.ok()?;
            (p.body["status"]["ready"].as_u64() == Some(n as u64) && p.body["status"]["updated"].as_u64() == Some(n as u64)).then_some(())
        })
        .await?;
    } else {
        tokio::time::sleep(Duration::from_secs(args.heartbeat_seconds)).await;
    }

    eprintln!("fleetsim: {}s of heartbeats", args.duration);
    let cpu_before = cpu_seconds(pid)?;
    let window = Instant::now();
    stats.recording.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(args.duration)).await;
    stats.recording.store(false, Ordering::SeqCst);
    let window = window.elapsed().as_secs_f64();
    let cpu = (cpu_seconds(pid)? - cpu_before) / window * 100.0;
    let mut latencies = std::mem::take(&mut *stats.status_ms.lock().map_err(|_| anyhow!("poisoned"))?);
    latencies.sort_by(f64::total_cmp);

    let mut summary = json!({
        "machines": n,
        "store": if args.ceiling { "none (ceiling)" } else { args.store.as_str() },
        "enroll_seconds": round(enroll_seconds),
        "status_p50_ms": round(percentile(&latencies, 50.0)),
        "status_p99_ms": round(percentile(&latencies, 99.0)),
        "status_per_second": round(latencies.len() as f64 / window),
        "status_errors": stats.status_errors.load(Ordering::SeqCst),
        "status_error_kinds": stats.status_error_kinds.lock().map_err(|_| anyhow!("poisoned"))?.clone(),
        "controller_cpu_percent": round(cpu),
    });

    if !args.ceiling {
        // What is measured so far, in case a later phase does not finish.
        eprintln!("fleetsim: heartbeats: {summary}");
        // Fan-out: a change every machine may take at once.
        eprintln!("fleetsim: fan-out");
        let changed = Instant::now();
        let put = admin.put("/v1/pools/sim", &pool("2", "100%")).await?;
        anyhow::ensure!(put.status == 200, "changing the template: {}", put.text);
        let arrivals = wait_until(Duration::from_secs(600), "every machine receiving the change", || async {
            let received = stats.received.lock().ok()?;
            let got = received.get("2")?;
            (got.len() == n).then(|| got.clone())
        })
        .await?;
        let mut fanout: Vec<f64> = arrivals.iter().map(|t| t.duration_since(changed).as_secs_f64() * 1000.0).collect();
        fanout.sort_by(f64::total_cmp);
        wait_rolled_out(&admin, 2, n).await?;

        // A rollout of the whole fleet, 10% at a time, each machine taking a disruption lease.
        eprintln!("fleetsim: rollout at maxUnavailable 10%");
        let changed = Instant::now();
        let put = admin.put("/v1/pools/sim", &pool("3", "10%")).await?;
        anyhow::ensure!(put.status == 200, "changing the template: {}", put.text);
        wait_rolled_out(&admin, 3, n).await?;
        let rollout = changed.elapsed().as_secs_f64();
        summary["fanout_p50_ms"] = json!(round(percentile(&fanout, 50.0)));
        summary["fanout_p99_ms"] = json!(round(percentile(&fanout, 99.0)));
        summary["rollout_seconds"] = json!(round(rollout));
        summary["rollout_ms_per_machine"] = json!(round(rollout * 1000.0 / n as f64));
        summary["lease_waits"] = json!(stats.lease_waits.load(Ordering::SeqCst));
    }
    let (rss, peak) = rss_mib(ceiling.as_ref().map_or(pid, |c| c.pid))?;
    summary["controller_rss_mib"] = json!(round(rss));
    summary["controller_peak_rss_mib"] = json!(round(peak));
    if let Some(c) = &ceiling {
        summary["controller_cpu_percent"] = json!(round((cpu_seconds(c.pid)? - c.cpu_at_start) / window * 100.0));
    }
    tasks.abort_all();
    Ok(summary)
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

async fn wait_until<T, F, Fut>(within: Duration, what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_rolled_out(admin: &ApiClient, revision: u64, n: usize) -> anyhow::Result<()> {
    wait_until(Duration::from_secs(1800), &format!("revision {revision} rolled out"), || async {
        let p = admin.get("/v1/pools/sim").await.ok()?;
        let s = &p.body["status"];
        let rolled = s["conditions"]
            .as_array()?
            .iter()
            .any(|c| c["type"] == "RolledOut" && c["status"] == "True" && c["message"] == format!("revision {revision}").as_str());
        (rolled && s["revision"] == revision && s["updated"].as_u64() == Some(n as u64)).then_some(())
    })
    .await
}

/// One simulated machine: a long-poll for its spec and a heartbeat, side by side as in the
/// agent (one HTTP/2 connection carries both). As the agent's, its report changes only when
/// the machine does: heartbeats repeat the last one.
async fn machine(client: Controller, stats: Arc<Stats>, offset: Duration, beat: Duration, poll: bool) -> anyhow::Result<()> {
    let last = Arc::new(Mutex::new(applied(0)?));
    if poll {
        let (client, stats, last) = (client.clone(), stats.clone(), last.clone());
        tokio::spawn(async move {
            let mut after = 0;
            loop {
                let Ok(answer) = client.spec(after, Duration::from_secs(60)).await else {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                };
                if answer.generation == after {
                    continue;
                }
                let marker = answer.spec.files.first().map(|f| f.content.clone()).unwrap_or_default();
                if let Ok(mut received) = stats.received.lock() {
                    received.entry(marker).or_default().push(Instant::now());
                }
                let Ok(status) = applied(answer.generation) else { continue };
                if after != 0 {
                    // A change after the first spec: take a lease, "upgrade" at once, report, release.
                    upgrade(&client, &stats, &status).await;
                }
                after = answer.generation;
                if let Ok(mut last) = last.lock() {
                    *last = status.clone();
                }
                let _ = report(&client, &stats, &status).await;
            }
        });
    }
    tokio::time::sleep(offset).await;
    let mut ticks = tokio::time::interval(beat);
    loop {
        ticks.tick().await;
        let status = last.lock().map_err(|_| anyhow!("poisoned"))?.clone();
        let _ = report(&client, &stats, &status).await;
    }
}

async fn upgrade(client: &Controller, stats: &Stats, status: &AgentStatus) {
    loop {
        match client.acquire_lease("simulated upgrade", Duration::from_secs(60)).await {
            Ok(LeaseAnswer::Granted(lease)) => {
                // Reported before the lease goes, as the agent does after its health check.
                let _ = report(client, stats, status).await;
                let _ = client.release_lease(&lease.id).await;
                return;
            }
            Ok(LeaseAnswer::Wait(_)) => {
                stats.lease_waits.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}

/// The report of a machine that has just applied `generation`.
fn applied(generation: u64) -> anyhow::Result<AgentStatus> {
    Ok(serde_json::from_value(status_report(generation))?)
}

async fn report(client: &Controller, stats: &Stats, status: &AgentStatus) -> anyhow::Result<()> {
    let started = Instant::now();
    match client.status(status).await {
        Ok(()) => {
            if stats.recording.load(Ordering::Relaxed)
                && let Ok(mut v) = stats.status_ms.lock()
            {
                v.push(started.elapsed().as_secs_f64() * 1000.0);
            }
            Ok(())
        }
        Err(e) => {
            stats.status_errors.fetch_add(1, Ordering::Relaxed);
            let message = e.to_string();
            // The whole chain: its cause (a reset, a timeout) comes after the URL.
            let kind: String = message.lines().next().unwrap_or_default().chars().take(400).collect();
            if let Ok(mut kinds) = stats.status_error_kinds.lock() {
                *kinds.entry(kind).or_default() += 1;
            }
            Err(anyhow!(message))
        }
    }
}

/// utime + stime of a process, in seconds (/proc counts in USER_HZ, 100 on Linux).
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may hold spaces; the fields after it do not.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or_else(|| anyhow!("unexpected /proc/{pid}/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).ok_or_else(|| anyhow!("/proc/{pid}/stat field {i}"));
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

/// Current and peak resident memory of a process, MiB.
fn rss_mib(pid: u32) -> anyhow::Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .ok_or_else(|| anyhow!("no {key} in /proc/{pid}/status"))
    };
    Ok((kib("VmRSS:")? / 1024.0, kib("VmHWM:")? / 1024.0))
}

/// The ceiling: this same program as a minimal HTTPS server (`KEELSON_FLEETSIM_CEILING` set),
/// with a server certificate from the controller's CA so the machines' identities verify.
struct Ceiling {
    child: std::process::Child,
    url: String,
    pid: u32,
    cpu_at_start: f64,
}

/// Set to a controller data directory, this program is the ceiling server instead.
const CEILING_ENV: &str = "KEELSON_FLEETSIM_CEILING";

impl Ceiling {
    async fn start(data_dir: &Path) -> anyhow::Result<Ceiling> {
        use std::io::BufRead;
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .env(CEILING_ENV, data_dir)
            .arg("--machines=1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("starting the ceiling server")?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout).read_line(&mut line).map(|_| line)
        })
        .await??;
        let url = line.trim().to_owned();
        anyhow::ensure!(url.starts_with("https://"), "the ceiling server said {line:?}");
        let pid = child.id();
        Ok(Ceiling { child, url, pid, cpu_at_start: cpu_seconds(pid)? })
    }
}

/// The ceiling server: the controller's TLS configuration and HTTP server loop, and one route
/// that reads the status body and answers 204, storing nothing.
fn serve_ceiling(data_dir: &Path) -> anyhow::Result<()> {
    use keelson_controller::pki::{Authority, server_tls_config};
    let (authority, created) = Authority::load_or_create(data_dir)?;
    anyhow::ensure!(!created, "{} held no CA", data_dir.display());
    let (cert, key) = authority.issue_server(&["127.0.0.1".to_owned()])?;
    let tls = Arc::new(server_tls_config(&authority.cert_pem, &cert.cert_pem, &key)?);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = keelson_controller::http::server::listen("127.0.0.1:0".parse()?)?;
        println!("https://{}", listener.local_addr()?);
        let router = axum::Router::new().route(
            "/v1/agent/status",
            axum::routing::put(|axum::Json(status): axum::Json<AgentStatus>| async move {
                std::hint::black_box(status);
                axum::http::StatusCode::NO_CONTENT
            }),
        );
        keelson_controller::http::server::serve(listener, tls, router, tokio_util::sync::CancellationToken::new()).await
    })
}

impl Drop for Ceiling {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
