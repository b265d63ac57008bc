//! keelson-controller: argument parsing, logging and signals; the work is in the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use keelson_controller::http::ApiConfig;
use keelson_controller::serve::{ServeOptions, StoreChoice, run};
use keelson_controller::store::etcd::{EtcdOptions, EtcdTlsFiles};
use tokio_util::sync::CancellationToken;

/// mimalloc, not glibc's malloc: answering a fan-out is mostly allocating and freeing, and
/// mimalloc does that in less CPU (measured in docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "keelson-controller", version, about = "keelson controller: the fleet's source of truth")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the API (creating the CA and admin credential on first start).
    Serve {
        /// Directory for the store, the CA and admin.conf.
        #[arg(long, default_value = "/var/lib/keelson-controller")]
        data_dir: PathBuf,
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:9443")]
        listen: SocketAddr,
        /// Extra DNS name or IP address for the server certificate (repeatable).
        #[arg(long = "san")]
        sans: Vec<String>,
        /// Store: sqlite (embedded, in the data directory) or etcd://HOST:PORT[,HOST:PORT…]
        /// (for several replicas).
        #[arg(long, default_value = "sqlite")]
        store: String,
        /// etcd store: the CA that signed the members' client-facing certificates.
        #[arg(long, requires_all = ["etcd_cert_file", "etcd_key_file"])]
        etcd_ca_file: Option<PathBuf>,
        /// etcd store: this controller's client certificate.
        #[arg(long, requires_all = ["etcd_ca_file", "etcd_key_file"])]
        etcd_cert_file: Option<PathBuf>,
        /// etcd store: the key of that certificate.
        #[arg(long, requires_all = ["etcd_ca_file", "etcd_cert_file"])]
        etcd_key_file: Option<PathBuf>,
        /// etcd store: the prefix every key of this controller lives under.
        #[arg(long, default_value = keelson_controller::store::etcd::DEFAULT_PREFIX)]
        etcd_prefix: String,
        /// etcd store: every this many seconds, compact etcd's history up to the revision that
        /// was newest one interval before (as kube-apiserver does); 0 leaves it to etcd's own
        /// --auto-compaction-retention. Without either, etcd grows until its space quota.
        #[arg(long, default_value_t = 300)]
        etcd_compaction_interval_seconds: u64,
        /// Seconds without a heartbeat before a machine is Reachable=False (3 heartbeat intervals).
        #[arg(long, default_value_t = 30)]
        unreachable_after_seconds: u64,
        /// Seconds between rollout passes when nothing reports (they also run on every change).
        #[arg(long, default_value_t = 5)]
        reconcile_interval_seconds: u64,
        /// Seconds a spec long-poll waits by default.
        #[arg(long, default_value_t = 60)]
        long_poll_seconds: u64,
        /// Log filter (tracing env-filter syntax); RUST_LOG overrides.
        #[arg(long, default_value = "info")]
        log_level: String,
    },
}

/// Logs go to journald when systemd runs us (JOURNAL_STREAM is set), to stderr otherwise.
fn init_logging(level: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::prelude::*;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let journald = std::env::var_os("JOURNAL_STREAM").and_then(|_| tracing_journald::layer().ok());
    let registry = tracing_subscriber::registry().with(filter);
    match journald {
        Some(layer) => registry.with(layer).init(),
        None => {
            registry.with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal())).init()
        }
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve {
            data_dir,
            listen,
            sans,
            store,
            etcd_ca_file,
            etcd_cert_file,
            etcd_key_file,
            etcd_prefix,
            etcd_compaction_interval_seconds,
            unreachable_after_seconds,
            reconcile_interval_seconds,
            long_poll_seconds,
            log_level,
        } => {
            init_logging(&log_level);
            if unreachable_after_seconds == 0 || reconcile_interval_seconds == 0 || long_poll_seconds == 0 {
                eprintln!(
                    "keelson-controller: --unreachable-after-seconds, --reconcile-interval-seconds and --long-poll-seconds must be at least 1"
                );
                return std::process::ExitCode::from(2);
            }
            let tls = match (etcd_ca_file, etcd_cert_file, etcd_key_file) {
                (Some(ca), Some(cert), Some(key)) => Some(EtcdTlsFiles { ca, cert, key }),
                _ => None,
            };
            let store = match store.as_str() {
                "sqlite" if tls.is_none() => StoreChoice::Sqlite,
                "sqlite" => {
                    eprintln!("keelson-controller: --etcd-ca-file, --etcd-cert-file and --etcd-key-file apply only to --store etcd://…");
                    return std::process::ExitCode::from(2);
                }
                other if other.starts_with("etcd://") => match EtcdOptions::parse(other, tls, &etcd_prefix) {
                    Ok(o) => StoreChoice::Etcd(EtcdOptions {
                        compact_every: (etcd_compaction_interval_seconds > 0)
                            .then(|| Duration::from_secs(etcd_compaction_interval_seconds)),
                        ..o
                    }),
                    Err(e) => {
                        eprintln!("keelson-controller: {e}");
                        return std::process::ExitCode::from(2);
                    }
                },
                other => {
                    eprintln!("keelson-controller: --store {other:?}: expected sqlite or etcd://HOST:PORT[,HOST:PORT…]");
                    return std::process::ExitCode::from(2);
                }
            };
            let opts = ServeOptions {
                data_dir,
                listen,
                sans,
                store,
                unreachable_after: Duration::from_secs(unreachable_after_seconds),
                reconcile_interval: Duration::from_secs(reconcile_interval_seconds),
                api: ApiConfig { long_poll_default: Duration::from_secs(long_poll_seconds), ..ApiConfig::default() },
            };
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("keelson-controller: cannot start the runtime: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            };
            let result = runtime.block_on(async {
                let cancel = CancellationToken::new();
                let on_signal = cancel.clone();
                tokio::spawn(async move {
                    shutdown_signal().await;
                    tracing::info!("shutting down");
                    on_signal.cancel();
                });
                run(opts, cancel).await
            });
            match result {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("keelson-controller: {e:#}");
                    std::process::ExitCode::FAILURE
                }
            }
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
