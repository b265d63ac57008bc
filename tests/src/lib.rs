//! The end-to-end harness: runs the real keelson binaries (controller, CLI, agent) in
//! temporary directories on loopback and gives tests and benchmarks HTTP clients that hold
//! each kind of identity (admin, machine, none, a foreign CA).

pub mod etcd;
pub mod kubeapi;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use keelson_api::config::ClientConfig;

/// The directory holding the workspace's built binaries (next to the test executable's `deps`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    let dir = exe.parent().unwrap_or_else(|| panic!("test binary has no parent directory"));
    if dir.ends_with("deps") { dir.parent().map(Path::to_path_buf).unwrap_or_default() } else { dir.to_path_buf() }
}

pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(path.exists(), "{} is not built: run `cargo build --workspace --bins` first", path.display());
    path
}

/// The store a test's controller runs on: SQLite in its data directory, or etcd members of
/// the test's own on loopback (killed when this is dropped).
#[derive(Debug)]
pub enum TestStore {
    Sqlite,
    Etcd { members: Vec<etcd::EtcdMember>, _dir: tempfile::TempDir },
}

impl TestStore {
    /// A new etcd cluster of `members` members, serving.
    pub async fn etcd(members: usize) -> anyhow::Result<TestStore> {
        let dir = tempfile::tempdir()?;
        let members = etcd::start_cluster(dir.path(), etcd::STORE_VERSION, members);
        etcd::wait_serving(&members).await?;
        Ok(TestStore::Etcd { members, _dir: dir })
    }

    /// The controller's arguments for this store.
    pub fn args(&self) -> Vec<String> {
        match self {
            TestStore::Sqlite => vec!["--store".into(), "sqlite".into()],
            TestStore::Etcd { members, .. } => vec!["--store".into(), etcd::store_url(members)],
        }
    }

    /// Every file the store keeps its data in, with its content (a controller with its data
    /// in `data_dir`).
    pub fn files(&self, data_dir: &Path) -> anyhow::Result<Vec<(PathBuf, Vec<u8>)>> {
        let mut todo: Vec<PathBuf> = match self {
            TestStore::Sqlite => vec![data_dir.join("keelson.db"), data_dir.join("keelson.db-wal")],
            TestStore::Etcd { members, .. } => members.iter().map(|m| m.data_dir.clone()).collect(),
        };
        let mut files = Vec::new();
        while let Some(path) = todo.pop() {
            if path.is_dir() {
                for entry in std::fs::read_dir(&path)? {
                    todo.push(entry?.path());
                }
            } else if path.exists() {
                files.push((path.clone(), std::fs::read(&path)?));
            }
        }
        Ok(files)
    }

    /// Starts a controller with its data in `data_dir` on this store.
    pub fn start(&self, data_dir: &Path, extra_args: &[&str]) -> anyhow::Result<Controller> {
        let mut args = self.args();
        args.extend(extra_args.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Controller::start(data_dir, &args)
    }
}

/// Runs one async test body on both stores, as two tests `NAME::sqlite` and `NAME::etcd`
/// (the latter on a single etcd member of its own); the body sees the store as `$store`.
#[macro_export]
macro_rules! on_both_stores {
    ($(#[$attr:meta])* async fn $name:ident($store:ident) -> R $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            async fn body($store: &$crate::TestStore) -> R $body
            $(#[$attr])*
            async fn sqlite() -> R {
                body(&$crate::TestStore::Sqlite).await
            }
            $(#[$attr])*
            async fn etcd() -> R {
                body(&$crate::TestStore::etcd(1).await?).await
            }
        }
    };
}

/// A running controller. Dropping it kills the process.
#[derive(Debug)]
pub struct Controller {
    pub child: Child,
    pub data_dir: PathBuf,
    pub url: String,
    pub listen: String,
    extra_args: Vec<String>,
}

impl Controller {
    /// Starts a controller on a free loopback port with its data in `data_dir`.
    pub fn start(data_dir: &Path, extra_args: &[&str]) -> anyhow::Result<Controller> {
        Self::start_on(data_dir, "127.0.0.1:0", extra_args)
    }

    pub fn start_on(data_dir: &Path, listen: &str, extra_args: &[&str]) -> anyhow::Result<Controller> {
        let mut child = Command::new(bin("keelson-controller"))
            .args(["serve", "--data-dir"])
            .arg(data_dir)
            .args(["--listen", listen])
            .args(extra_args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
            .spawn()
            .context("starting keelson-controller")?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep draining so the controller never blocks on a full pipe.
            for _ in lines {}
        });
        let line = rx.recv_timeout(Duration::from_secs(30)).map_err(|_| anyhow!("the controller did not report that it listens"))?;
        let url = line.rsplit(' ').next().ok_or_else(|| anyhow!("unexpected first line {line:?}"))?.to_owned();
        let listen = url.trim_start_matches("https://").to_owned();
        Ok(Controller { child, data_dir: data_dir.to_owned(), url, listen, extra_args: extra_args.iter().map(|s| s.to_string()).collect() })
    }

    pub fn admin_conf(&self) -> PathBuf {
        self.data_dir.join("admin.conf")
    }

    /// SIGKILL: no chance to flush anything.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts again on the same address and data.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let args: Vec<&str> = self.extra_args.iter().map(String::as_str).collect();
        let next = Controller::start_on(&self.data_dir, &self.listen, &args)?;
        *self = next;
        Ok(())
    }

    pub fn admin(&self) -> anyhow::Result<ApiClient> {
        let text = std::fs::read_to_string(self.admin_conf())?;
        let conf = ClientConfig::from_yaml(&text).map_err(|e| anyhow!(e))?;
        ApiClient::new(&self.url, &conf.certificate_authority, Some((&conf.client_certificate, &conf.client_key)))
    }

    pub fn ca_pem(&self) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(self.data_dir.join("ca.crt"))?)
    }

    /// A client with no certificate.
    pub fn anonymous(&self) -> anyhow::Result<ApiClient> {
        ApiClient::new(&self.url, &self.ca_pem()?, None)
    }

    /// Runs the CLI against this controller.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        Ok(Command::new(bin("keelson")).env("KEELSON_CONFIG", self.admin_conf()).args(args).output()?)
    }

    /// Creates a token through the CLI.
    pub fn token(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all = vec!["token", "create"];
        all.extend_from_slice(args);
        let out = self.cli(&all)?;
        if !out.status.success() {
            bail!("token create failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8(out.stdout)?.trim().to_owned())
    }

    /// A client holding the identity an agent keeps in `state_dir`.
    pub fn machine_client(&self, state_dir: &Path) -> anyhow::Result<ApiClient> {
        let cert = std::fs::read_to_string(state_dir.join("machine.crt"))?;
        let key = std::fs::read_to_string(state_dir.join("machine.key"))?;
        ApiClient::new(&self.url, &self.ca_pem()?, Some((&cert, &key)))
    }

    /// Enrolls a machine with the real agent binary; returns a client holding its identity.
    pub fn enroll(&self, name: &str, token: &str, state_dir: &Path) -> anyhow::Result<ApiClient> {
        let ca = self.data_dir.join("ca.crt");
        let out = Command::new(bin("keelson-agent"))
            .arg("--state-dir")
            .arg(state_dir)
            .args(["enroll", "--server", &self.url, "--ca-file"])
            .arg(&ca)
            .args(["--token", token, "--name", name])
            .output()?;
        if !out.status.success() {
            bail!("enroll {name} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        self.machine_client(state_dir)
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An HTTPS client bound to one identity.
#[derive(Debug, Clone)]
pub struct ApiClient {
    pub http: reqwest::Client,
    pub base: String,
}

/// An answer: status code and body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: serde_json::Value,
    pub text: String,
}

impl ApiClient {
    pub fn new(base: &str, ca_pem: &str, identity: Option<(&str, &str)>) -> anyhow::Result<Self> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let tls = keelson_api::tls::client_config(ca_pem, identity)?;
        let http =
            reqwest::Client::builder().use_preconfigured_tls(tls).timeout(Duration::from_secs(120)).pool_max_idle_per_host(4).build()?;
        Ok(ApiClient { http, base: base.to_owned() })
    }

    pub async fn request(&self, method: reqwest::Method, path: &str, body: Option<&serde_json::Value>) -> anyhow::Result<Answer> {
        let mut r = self.http.request(method, format!("{}{}", self.base, path));
        if let Some(b) = body {
            r = r.json(b);
        }
        let response = r.send().await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
        Ok(Answer { status, body, text })
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Answer> {
        self.request(reqwest::Method::GET, path, None).await
    }

    pub async fn put(&self, path: &str, body: &serde_json::Value) -> anyhow::Result<Answer> {
        self.request(reqwest::Method::PUT, path, Some(body)).await
    }

    pub async fn post(&self, path: &str, body: &serde_json::Value) -> anyhow::Result<Answer> {
        self.request(reqwest::Method::POST, path, Some(body)).await
    }

    pub async fn raw_post(&self, path: &str, body: Vec<u8>) -> anyhow::Result<Answer> {
        let response =
            self.http.post(format!("{}{}", self.base, path)).header("content-type", "application/json").body(body).send().await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
        Ok(Answer { status, body, text })
    }
}

/// A Machine object as JSON.
pub fn machine_json(name: &str, labels: serde_json::Value, spec: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "keelson.io/v1alpha1",
        "kind": "Machine",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    })
}

/// Waits up to `secs` for pool `web` to satisfy `ok`; its last state, or an error saying
/// `what` did not happen, with the pool's status.
pub async fn wait_for_pool_web(
    admin: &ApiClient,
    what: &str,
    secs: u64,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    wait_for_pool(admin, "web", what, secs, ok).await
}

/// Waits up to `secs` for pool `name` to satisfy `ok`; its last state, or an error saying
/// `what` did not happen, with the pool's status.
pub async fn wait_for_pool(
    admin: &ApiClient,
    name: &str,
    what: &str,
    secs: u64,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let p = admin.get(&format!("/v1/pools/{name}")).await?;
        if ok(&p.body) {
            return Ok(p.body);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "{what} within {secs}s; pool status: {}", p.body["status"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A spec that pins one containerd version from a package.
/// Asks for a disruption lease as an agent does (`request`: reason and ttlSeconds) until it is
/// granted: the lease, and every "wait" answer on the way.
pub async fn lease_granted(
    machine: &ApiClient,
    request: &serde_json::Value,
    secs: u64,
) -> anyhow::Result<(serde_json::Value, Vec<String>)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    let mut waits = Vec::new();
    loop {
        let answer = machine.post("/v1/agent/disruptions", request).await?;
        match answer.status {
            201 => return Ok((answer.body, waits)),
            429 => waits.push(answer.body["message"].as_str().unwrap_or(&answer.text).to_owned()),
            other => bail!("{other}: {}", answer.text),
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "no lease within {secs}s; waited for: {waits:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub fn runtime_spec(version: &str) -> serde_json::Value {
    serde_json::json!({
        "roles": ["worker"],
        "containerRuntime": {"name": "containerd", "version": version, "source": {"package": "containerd"}},
    })
}

/// A status report as an agent sends it.
pub fn status_report(observed_generation: u64) -> serde_json::Value {
    let now = time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_default();
    serde_json::json!({
        "phase": "Ready",
        "observedGeneration": observed_generation,
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "Healthy", "lastTransitionTime": now},
            {"type": "UpToDate", "status": "True", "reason": "Converged", "lastTransitionTime": now},
        ],
        "versions": {"kernel": "6.1.0-50-amd64", "containerRuntime": "1.6.20~ds1-1+deb12u3"},
    })
}

/// Percentile of sorted samples (nearest rank).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The events of a watch response (`?watch=true`: one JSON object per line), one at a time.
pub struct WatchEvents {
    stream: futures_util::stream::BoxStream<'static, reqwest::Result<Vec<u8>>>,
    buffer: Vec<u8>,
}

impl std::fmt::Debug for WatchEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchEvents").field("buffered", &self.buffer.len()).finish()
    }
}

impl WatchEvents {
    pub fn new(response: reqwest::Response) -> Self {
        use futures_util::StreamExt;
        WatchEvents { stream: response.bytes_stream().map(|chunk| chunk.map(|b| b.to_vec())).boxed(), buffer: Vec::new() }
    }

    /// The next event; an error when none comes within `limit` or the watch ends.
    pub async fn next(&mut self, limit: Duration) -> anyhow::Result<serde_json::Value> {
        use futures_util::StreamExt;
        loop {
            if let Some(i) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=i).collect();
                return Ok(serde_json::from_slice(&line)?);
            }
            let chunk = tokio::time::timeout(limit, self.stream.next())
                .await
                .map_err(|_| anyhow!("no watch event within {limit:?}"))?
                .ok_or_else(|| anyhow!("the watch ended"))??;
            self.buffer.extend_from_slice(&chunk);
        }
    }
}
