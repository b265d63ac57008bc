//! Real etcd members on loopback for the membership tests: the binaries `tests/fetch-etcd`
//! puts in `.cache/etcd/<version>/`, each member in its own temporary data directory with
//! ports of its own. Dropping a member kills its process.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// The etcd binary of `version` fetched by `tests/fetch-etcd`.
pub fn etcd_binary(version: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/etcd").join(version).join("etcd");
    assert!(path.exists(), "{} is missing: run tests/fetch-etcd first (the README's test command does)", path.display());
    path
}

/// Where member ports are taken from: below the kernel's ephemeral range (32768 and up by
/// default). A port found by binding port 0 and then let go comes from that range, and until
/// etcd binds it, any outgoing connection may take it as its local port, or the next bind of
/// port 0 may hand it out again; a member started late (a learner joining) then cannot listen.
const MEMBER_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A port no member of this process has had and nothing listens on now.
fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(MEMBER_PORTS.end - MEMBER_PORTS.start);
    // Test processes side by side start at different places.
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = MEMBER_PORTS.start + u16::try_from(offset).unwrap_or_default();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {MEMBER_PORTS:?} on 127.0.0.1")
}

#[derive(Debug)]
pub struct EtcdMember {
    pub name: String,
    pub data_dir: PathBuf,
    pub client_url: String,
    pub peer_url: String,
    pub version: String,
    /// CA, certificate and key files when the member serves TLS (peer and client, with
    /// client certificates required).
    pub tls: Option<[PathBuf; 3]>,
    child: Option<Child>,
}

impl EtcdMember {
    /// A member that is not started yet, with a data directory under `root`.
    pub fn new(root: &Path, name: &str, version: &str) -> Self {
        EtcdMember {
            name: name.to_string(),
            data_dir: root.join(name),
            client_url: format!("http://127.0.0.1:{}", free_port()),
            peer_url: format!("http://127.0.0.1:{}", free_port()),
            version: version.to_string(),
            tls: None,
            child: None,
        }
    }

    /// The same member serving TLS with these files: https URLs, client certificates
    /// required on both listeners.
    pub fn with_tls(mut self, ca: &Path, cert: &Path, key: &Path) -> Self {
        self.client_url = self.client_url.replace("http://", "https://");
        self.peer_url = self.peer_url.replace("http://", "https://");
        self.tls = Some([ca.to_owned(), cert.to_owned(), key.to_owned()]);
        self
    }

    pub fn initial_cluster_entry(&self) -> String {
        format!("{}={}", self.name, self.peer_url)
    }

    /// Starts etcd with `state` `new` or `existing` and `initial_cluster`; an existing data
    /// directory makes etcd ignore both, as on a restart.
    pub fn start(&mut self, state: &str, initial_cluster: &str) {
        let log = std::fs::File::create(self.log_path()).unwrap_or_else(|e| panic!("etcd log: {e}"));
        let mut command = Command::new(etcd_binary(&self.version));
        if let Some([ca, cert, key]) = &self.tls {
            command.arg("--client-cert-auth").arg("--trusted-ca-file").arg(ca).arg("--cert-file").arg(cert).arg("--key-file").arg(key);
            command
                .arg("--peer-client-cert-auth")
                .arg("--peer-trusted-ca-file")
                .arg(ca)
                .arg("--peer-cert-file")
                .arg(cert)
                .arg("--peer-key-file")
                .arg(key);
        }
        let child = command
            .args(["--name", &self.name, "--data-dir"])
            .arg(&self.data_dir)
            .args(["--listen-client-urls", &self.client_url, "--advertise-client-urls", &self.client_url])
            .args(["--listen-peer-urls", &self.peer_url, "--initial-advertise-peer-urls", &self.peer_url])
            .args(["--initial-cluster", initial_cluster, "--initial-cluster-state", state])
            .args(["--initial-cluster-token", "keelson-test", "--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting etcd {}: {e}", self.version));
        self.child = Some(child);
    }

    /// The end of this member's log (its stderr), for a failure message.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_else(|e| format!("(no log: {e})"));
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    fn log_path(&self) -> PathBuf {
        self.data_dir.with_extension(format!("{}.log", self.version))
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdMember {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The etcd the controller's store tests run on: Debian's, as operators would.
pub const STORE_VERSION: &str = "3.4.23";

/// `n` plain-HTTP members started together as one new cluster (etcd's static bootstrap).
pub fn start_cluster(root: &Path, version: &str, n: usize) -> Vec<EtcdMember> {
    let mut members: Vec<EtcdMember> = (0..n).map(|i| EtcdMember::new(root, &format!("m{i}"), version)).collect();
    let initial: Vec<String> = members.iter().map(EtcdMember::initial_cluster_entry).collect();
    let initial = initial.join(",");
    for m in &mut members {
        m.start("new", &initial);
    }
    members
}

/// Waits until every plain-HTTP member answers healthy.
pub async fn wait_serving(members: &[EtcdMember]) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder().timeout(std::time::Duration::from_secs(2)).build()?;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    for m in members {
        loop {
            let health = http.get(format!("{}/health", m.client_url)).send().await;
            let body = match health {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            if body.contains(r#""health":"true""#) {
                break;
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "etcd {} not healthy after 30 s", m.name);
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// `--store etcd://…` for these members.
pub fn store_url(members: &[EtcdMember]) -> String {
    let hosts: Vec<&str> = members.iter().map(|m| m.client_url.trim_start_matches("http://").trim_start_matches("https://")).collect();
    format!("etcd://{}", hosts.join(","))
}
