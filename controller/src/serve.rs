//! `keelson-controller serve`: first-start setup of the data directory, the store, the API
//! server and the background loops, and an orderly shutdown of all of them.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use etcd_client::Client;
use keelson_api::config::ClientConfig;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::http::{self, ApiConfig, App};
use crate::leader::{self, EtcdElection, Leading};
use crate::metrics::Metrics;
use crate::pki::{self, Authority};
use crate::registry::{POOLS, Registry};
use crate::shared_ca::{self, SharedCaError};
use crate::store::Store;
use crate::store::etcd::{EtcdOptions, EtcdStore};
use crate::store::sqlite::SqliteStore;
use crate::waiters::{SpecWaiters, follow_changes, follow_machines};

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// Extra DNS names or IP addresses for the server certificate.
    pub sans: Vec<String>,
    pub store: StoreChoice,
    /// A machine silent for this long is marked `Reachable=False`.
    pub unreachable_after: Duration,
    /// How often pool membership is re-checked (it is also checked on every change).
    pub reconcile_interval: Duration,
    pub api: ApiConfig,
}

#[derive(Debug, Clone)]
pub enum StoreChoice {
    /// `DATA_DIR/keelson.db`, the default.
    Sqlite,
    Etcd(EtcdOptions),
}

/// Under the etcd prefix: the replicas' election (one key per candidate, named by its lease).
const ELECTION: &str = "/controller/election";

/// The admin credential file in the data directory.
pub fn admin_conf_path(data_dir: &Path) -> PathBuf {
    data_dir.join("admin.conf")
}

/// The store, and on etcd the election the replicas sharing it campaign in.
async fn open_store(opts: &ServeOptions) -> anyhow::Result<(Arc<dyn Store>, Option<(Client, String)>)> {
    Ok(match &opts.store {
        StoreChoice::Sqlite => (Arc::new(SqliteStore::open(&opts.data_dir.join("keelson.db"))?), None),
        StoreChoice::Etcd(etcd) => {
            let store = EtcdStore::open(etcd).await.with_context(|| format!("opening the etcd store at {}", etcd.endpoints.join(",")))?;
            let election = (store.client(), format!("{}{ELECTION}", store.prefix()));
            (Arc::new(store), Some(election))
        }
    })
}

/// Loads the controller CA from the data directory, or makes it on the first start of the
/// first replica; with several replicas, all must hold the same (crate::shared_ca).
/// Says whether it was made now.
async fn load_authority(store: &dyn Store, data_dir: &Path) -> anyhow::Result<(Authority, bool)> {
    let copy_it = format!(
        "copy ca.crt, ca.key and etcd-ca/ from the data directory of a running replica into {} before starting this one (docs/controller.md, \"Several replicas\")",
        data_dir.display()
    );
    if !shared_ca::present(data_dir) && shared_ca::recorded(store, shared_ca::CONTROLLER_CA).await?.is_some() {
        anyhow::bail!("the store already belongs to a fleet whose CA this data directory lacks: {copy_it}");
    }
    let (authority, created) = Authority::load_or_create(data_dir)?;
    match shared_ca::pin(store, shared_ca::CONTROLLER_CA, &authority.cert_pem).await {
        Ok(()) => {}
        Err(SharedCaError::Mismatch { .. }) => {
            if created {
                // Another replica made its CA at the same moment and recorded it first.
                let _ = std::fs::remove_file(data_dir.join("ca.key"));
                let _ = std::fs::remove_file(data_dir.join("ca.crt"));
            }
            anyhow::bail!("{}/ca.crt is not the CA of the fleet this store holds: {copy_it}", data_dir.display());
        }
        Err(SharedCaError::Store(e)) => return Err(e.into()),
    }
    if created {
        tracing::info!(path = %data_dir.join("ca.crt").display(), "created a new certificate authority");
    }
    Ok((authority, created))
}

/// The names the server certificate is valid for: the listen address (loopback and the
/// host name too when it listens on every address) and the operator's extra names.
fn server_names(listen: &SocketAddr, sans: &[String]) -> Vec<String> {
    let mut names = Vec::new();
    if listen.ip().is_unspecified() {
        names.extend(["127.0.0.1".to_owned(), "::1".to_owned(), "localhost".to_owned()]);
        let host = hostname();
        if !host.is_empty() {
            names.push(host);
        }
    } else {
        names.push(listen.ip().to_string());
    }
    names.extend(sans.iter().cloned());
    names.sort();
    names.dedup();
    names
}

fn server_url(listen: &SocketAddr) -> String {
    let ip = if listen.ip().is_unspecified() { "127.0.0.1".parse().unwrap_or(listen.ip()) } else { listen.ip() };
    format!("https://{}", SocketAddr::new(ip, listen.port()))
}

pub async fn run(opts: ServeOptions, cancel: CancellationToken) -> anyhow::Result<()> {
    std::fs::create_dir_all(&opts.data_dir).with_context(|| format!("creating {}", opts.data_dir.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&opts.data_dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restricting {}", opts.data_dir.display()))?;
    }
    let (store, election) = open_store(&opts).await?;
    let (authority, created) = load_authority(&*store, &opts.data_dir).await?;
    let listener = http::server::listen(opts.listen).with_context(|| format!("listening on {}", opts.listen))?;
    let bound = listener.local_addr()?;
    let (server_cert, server_key) = authority.issue_server(&server_names(&bound, &opts.sans))?;
    pki::write_private(&opts.data_dir.join("server.crt"), server_cert.cert_pem.as_bytes())?;
    let admin_path = admin_conf_path(&opts.data_dir);
    if created || !admin_path.exists() {
        let (admin, key) = authority.issue_admin("admin")?;
        let conf = ClientConfig::new(vec![server_url(&bound)], authority.cert_pem.clone(), admin.cert_pem, key.serialize_pem());
        pki::write_private(&admin_path, conf.to_yaml().as_bytes())?;
        tracing::info!(path = %admin_path.display(), "wrote the admin credential");
    }
    let tls = Arc::new(pki::server_tls_config(&authority.cert_pem, &server_cert.cert_pem, &server_key)?);
    let authority = Arc::new(authority);
    // On SQLite this controller is the only one and leads throughout.
    let (leading_tx, leading) = tokio::sync::watch::channel(election.is_none());
    let waiters = Arc::new(SpecWaiters::default());
    let app = Arc::new(App {
        registry: Registry::new(store.clone(), authority, leading.clone()),
        waiters: waiters.clone(),
        metrics: Metrics::new(),
        config: opts.api.clone(),
        etcd_pki: crate::etcd_pki::EtcdAuthorities::new(&opts.data_dir),
        shutdown: cancel.clone(),
    });

    let mut tasks: JoinSet<anyhow::Result<()>> = JoinSet::new();
    let wake = app.clone();
    tasks.spawn(follow_machines(store.clone(), waiters, move || wake.registry.rollout_wake.notify_one(), cancel.clone()));
    // Pool changes made through another replica reach the leader's pass this way.
    let wake = app.clone();
    tasks.spawn(follow_changes(store.clone(), POOLS, move || wake.registry.rollout_wake.notify_one(), cancel.clone()));
    // Without an election the sender lives as long as this function: this replica leads
    // throughout, and nothing waits on the sender to go.
    let _single = match election {
        Some((client, name)) => {
            let identity = format!("{} {}", hostname(), server_url(&bound));
            tasks.spawn(EtcdElection { client, name, identity }.run(leading_tx, cancel.clone()));
            None
        }
        None => Some(leading_tx),
    };
    tasks.spawn(follow_leadership(app.clone(), leading.clone(), cancel.clone()));
    let (reach, timeout) = (app.clone(), opts.unreachable_after);
    tasks.spawn(leader::while_leading(leading.clone(), cancel.clone(), move |term| reachability_loop(reach.clone(), timeout, term)));
    let (pools, period) = (app.clone(), opts.reconcile_interval);
    tasks.spawn(leader::while_leading(leading.clone(), cancel.clone(), move |term| pool_loop(pools.clone(), period, term)));
    // Drains started through another replica reach the leader's drainer this way.
    let wake = app.clone();
    tasks.spawn(follow_changes(store.clone(), crate::drain::DRAINS, move || wake.registry.drain_wake.notify_one(), cancel.clone()));
    let drainer = crate::drain::Drainer::new(app.clone());
    tasks.spawn(leader::while_leading(leading, cancel.clone(), move |term| drainer.clone().run(term)));
    tasks.spawn(http::server::serve(listener, tls, http::router(app.clone()), cancel.clone()));
    // Printed for operators and for tests that wait for the controller to come up.
    println!("keelson-controller listening on {}", server_url(&bound));
    sd_ready();

    // The first task to end (an error, or every task seeing the cancellation) ends them all.
    let mut result = Ok(());
    while let Some(joined) = tasks.join_next().await {
        let outcome = joined.map_err(anyhow::Error::from).and_then(|r| r);
        if let Err(e) = outcome
            && result.is_ok()
        {
            result = Err(e);
        }
        cancel.cancel();
    }
    result
}

/// Shows in the metrics whether this replica leads, and lets go of what only a leader keeps.
async fn follow_leadership(app: Arc<App>, mut leading: Leading, cancel: CancellationToken) -> anyhow::Result<()> {
    loop {
        let leads = *leading.borrow_and_update();
        app.metrics.set_leader(leads);
        if !leads {
            app.registry.forget_decoded_fleet().await;
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            changed = leading.changed() => if changed.is_err() { return Ok(()) },
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default()
}

/// Tells systemd the controller is ready when it runs as a notify service.
fn sd_ready() {
    if std::env::var_os("NOTIFY_SOCKET").is_some()
        && let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready])
    {
        tracing::warn!(error = %e, "could not notify systemd");
    }
}

async fn reachability_loop(app: Arc<App>, timeout: Duration, cancel: CancellationToken) -> anyhow::Result<()> {
    let period = (timeout / 4).clamp(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(period) => {}
        }
        // Given up half-way when the term ends: each machine's mark is its own write.
        let checked = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            checked = app.registry.mark_unreachable(timeout) => checked,
        };
        if let Err(e) = checked {
            tracing::warn!(error = %e, "reachability check failed");
        }
    }
}

/// The rollout pass: at once when a pool member's progress changes, and every `period`
/// anyway (canary soaks end by the clock, not by a report).
async fn pool_loop(app: Arc<App>, period: Duration, cancel: CancellationToken) -> anyhow::Result<()> {
    // Reports arrive in bursts; one pass after a short pause takes in the whole burst.
    const GATHER: Duration = Duration::from_millis(100);
    loop {
        // Given up half-way when the term ends (level-triggered: the next leader's pass
        // starts from what is stored, as after a crash).
        let passed = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            passed = app.registry.reconcile_pools() => passed,
        };
        if let Err(e) = passed {
            tracing::warn!(error = %e, "pool reconcile failed");
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(period) => {}
            _ = app.registry.rollout_wake.notified() => tokio::time::sleep(GATHER).await,
        }
    }
}
