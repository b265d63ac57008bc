//! A Kubernetes API server double, for tests only: no kube-apiserver can be had here
//! (TESTBED.md). It serves, over HTTPS with a bearer token, the endpoints a node drain uses,
//! with the semantics a real API server gives them:
//!
//! - discovery (`/version`, `/api`, `/apis`, `/api/v1`, `/apis/policy/v1`, `/apis/apps/v1`);
//! - nodes: list, get, watch, merge and strategic-merge patch, replace;
//! - pods: list (all namespaces or one; `fieldSelector` on `spec.nodeName`, `metadata.name`,
//!   `metadata.namespace`; `labelSelector` with `=`, `==`, `!=`), get, watch, delete;
//! - the Eviction subresource with PodDisruptionBudget semantics: a pod may go while the
//!   budgets that select it keep `minAvailable` (or lose at most `maxUnavailable`) healthy
//!   pods; otherwise 429 `TooManyRequests` with a `DisruptionBudget` cause; more than one
//!   budget for a pod is a 500, as on a real server; an unhealthy pod may go while its budget
//!   is met (`IfHealthyBudget`);
//! - PodDisruptionBudgets (list) and DaemonSets (get), which drain reads;
//! - ConfigMaps (get, merge patch), for the kubeadm stand-in (tests/fixtures/kubeadm-standin):
//!   while `kube-system/kubeadm-config` names a `kubernetesVersion` in its
//!   `ClusterConfiguration`, `/version` reports that version, as a real API server does once
//!   `kubeadm upgrade apply` has restarted it at the version it writes there.
//!
//! A deleted or evicted pod terminates for `grace` (it has a `deletionTimestamp` meanwhile,
//! as a kubelet stopping it), then is gone. A pod owned by a ReplicaSet gets a replacement on
//! another schedulable node that turns Ready after `replacement_ready_after`, as a ReplicaSet
//! controller and a kubelet would make: budgets then free up one pod at a time.
//!
//! What is not here: authorization beyond the one token, admission, server-side apply,
//! protobuf, pagination (`limit` is ignored, which clients accept), selectors with set
//! expressions. `tests/tests/kubeapi.rs` checks the double against Debian's kubectl.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

type Key = (String, String);

/// What the double holds, and what happened to it.
#[derive(Debug)]
pub struct Cluster {
    revision: u64,
    pub nodes: BTreeMap<String, Value>,
    pub pods: BTreeMap<Key, Value>,
    pub pdbs: BTreeMap<Key, Value>,
    pub daemonsets: BTreeMap<Key, Value>,
    pub configmaps: BTreeMap<Key, Value>,
    /// What clients did and what followed, in order: `cordon NODE`, `uncordon NODE`,
    /// `evict NS/POD`, `refuse NS/POD` (a 429), `delete NS/POD`, `gone NS/POD`, `ready NS/POD`
    /// (a replacement pod turned Ready), `configmap NS/NAME` (patched).
    pub log: Vec<String>,
    /// Requests for paths the double does not serve (a client needing more than it has).
    pub unserved: Vec<String>,
    /// How long a deleted pod takes to terminate.
    pub grace: Duration,
    /// When set, a ReplicaSet's deleted pod is replaced on another node, Ready after this.
    pub replacement_ready_after: Option<Duration>,
    /// The version `/version` reports (`gitVersion`).
    pub version: String,
    history: Vec<WatchEvent>,
    events: broadcast::Sender<WatchEvent>,
}

#[derive(Debug, Clone)]
struct WatchEvent {
    kind: &'static str,
    type_: &'static str,
    object: Value,
}

/// The oldest watch events are dropped past this; a watch from before them gets 410.
const HISTORY_KEPT: usize = 10_000;

fn now() -> String {
    time::OffsetDateTime::now_utc()
        .replace_nanosecond(0)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default()
}

fn key_of(object: &Value) -> Key {
    let meta = &object["metadata"];
    (meta["namespace"].as_str().unwrap_or_default().to_owned(), meta["name"].as_str().unwrap_or_default().to_owned())
}

impl Cluster {
    fn new() -> Self {
        Cluster {
            revision: 1,
            nodes: BTreeMap::new(),
            pods: BTreeMap::new(),
            pdbs: BTreeMap::new(),
            daemonsets: BTreeMap::new(),
            configmaps: BTreeMap::new(),
            log: Vec::new(),
            unserved: Vec::new(),
            grace: Duration::from_millis(200),
            replacement_ready_after: None,
            version: "v1.30.4".into(),
            history: Vec::new(),
            events: broadcast::channel(1024).0,
        }
    }

    /// Stamps `object` with a new resourceVersion (and a uid and creation time when new).
    fn stamp(&mut self, object: &mut Value) {
        self.revision += 1;
        let meta = &mut object["metadata"];
        meta["resourceVersion"] = json!(self.revision.to_string());
        if meta["uid"].is_null() {
            meta["uid"] = json!(format!("{:08x}-0000-4000-8000-{:012x}", rand::random::<u32>(), self.revision));
        }
        if meta["creationTimestamp"].is_null() {
            meta["creationTimestamp"] = json!(now());
        }
    }

    fn publish(&mut self, kind: &'static str, type_: &'static str, object: Value) {
        let event = WatchEvent { kind, type_, object };
        self.history.push(event.clone());
        if self.history.len() > HISTORY_KEPT {
            self.history.remove(0);
        }
        let _ = self.events.send(event);
    }

    /// kube-system/kubeadm-config as `kubeadm init` leaves it, at `version`.
    pub fn add_kubeadm_config(&mut self, version: &str) {
        let mut config = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "kubeadm-config", "namespace": "kube-system"},
            "data": {"ClusterConfiguration": format!("apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: {version}\n")}});
        self.stamp(&mut config);
        self.configmaps.insert(key_of(&config), config);
    }

    /// The version `/version` reports: kubeadm-config's `kubernetesVersion` when it names one.
    pub fn server_version(&self) -> String {
        let config = self.configmaps.get(&("kube-system".to_owned(), "kubeadm-config".to_owned()));
        let named = config.and_then(|c| c["data"]["ClusterConfiguration"].as_str()).and_then(|text| {
            text.lines().find_map(|l| l.trim().strip_prefix("kubernetesVersion:")).map(|v| v.trim().trim_matches('"').to_owned())
        });
        named.unwrap_or_else(|| self.version.clone())
    }

    pub fn add_node(&mut self, name: &str, ready: bool) {
        let mut node = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {},
            "status": {"conditions": [ready_condition(ready)], "nodeInfo": {"kubeletVersion": "v1.30.4"}},
        });
        self.stamp(&mut node);
        self.nodes.insert(name.to_owned(), node.clone());
        self.publish("Node", "ADDED", node);
    }

    /// Sets a node's Ready condition, as its kubelet would.
    pub fn set_node_ready(&mut self, name: &str, ready: bool) {
        let Some(mut node) = self.nodes.get(name).cloned() else { return };
        node["status"]["conditions"] = json!([ready_condition(ready)]);
        self.stamp(&mut node);
        self.nodes.insert(name.to_owned(), node.clone());
        self.publish("Node", "MODIFIED", node);
    }

    /// Adds a pod (its `metadata.namespace` defaults to `default`), Running and Ready.
    pub fn add_pod(&mut self, mut pod: Value) {
        if pod["metadata"]["namespace"].is_null() {
            pod["metadata"]["namespace"] = json!("default");
        }
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        if pod["status"].is_null() {
            pod["status"] = json!({"phase": "Running", "conditions": [ready_condition(true)]});
        }
        self.stamp(&mut pod);
        self.pods.insert(key_of(&pod), pod.clone());
        self.publish("Pod", "ADDED", pod);
    }

    pub fn add_pdb(&mut self, mut pdb: Value) {
        if pdb["metadata"]["namespace"].is_null() {
            pdb["metadata"]["namespace"] = json!("default");
        }
        pdb["apiVersion"] = json!("policy/v1");
        pdb["kind"] = json!("PodDisruptionBudget");
        self.stamp(&mut pdb);
        self.pdbs.insert(key_of(&pdb), pdb);
    }

    pub fn add_daemonset(&mut self, namespace: &str, name: &str) {
        let mut ds = json!({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": namespace}, "spec": {}});
        self.stamp(&mut ds);
        self.daemonsets.insert((namespace.to_owned(), name.to_owned()), ds);
    }

    /// The pods bound to `node` (terminating ones included).
    pub fn pods_on(&self, node: &str) -> Vec<String> {
        self.pods.values().filter(|p| p["spec"]["nodeName"] == node).map(|p| format!("{}/{}", key_of(p).0, key_of(p).1)).collect()
    }

    pub fn unschedulable(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|n| n["spec"]["unschedulable"] == true)
    }

    /// The budgets that select `pod`.
    fn budgets_for(&self, pod: &Value) -> Vec<Value> {
        let (namespace, _) = key_of(pod);
        self.pdbs
            .values()
            .filter(|b| key_of(b).0 == namespace && selector_matches(&b["spec"]["selector"], &pod["metadata"]["labels"]))
            .cloned()
            .collect()
    }

    /// Whether `budget` lets `pod` go now: Err with the reason when it does not.
    fn budget_allows(&self, budget: &Value, pod: &Value) -> Result<(), String> {
        let (namespace, name) = key_of(budget);
        let selected: Vec<&Value> = self
            .pods
            .values()
            .filter(|p| key_of(p).0 == namespace && selector_matches(&budget["spec"]["selector"], &p["metadata"]["labels"]))
            .collect();
        let expected = selected.len() as i64;
        let current = selected.iter().filter(|p| healthy(p)).count() as i64;
        let spec = &budget["spec"];
        let desired = if !spec["minAvailable"].is_null() {
            scaled(&spec["minAvailable"], expected)?
        } else if !spec["maxUnavailable"].is_null() {
            (expected - scaled(&spec["maxUnavailable"], expected)?).max(0)
        } else {
            0
        };
        // An unhealthy pod may go while the budget is met (IfHealthyBudget, the default).
        let allowed = if healthy(pod) { current - desired > 0 } else { current >= desired };
        if allowed { Ok(()) } else { Err(format!("The disruption budget {name} needs {desired} healthy pods and has {current} currently")) }
    }
}

fn ready_condition(ready: bool) -> Value {
    json!({"type": "Ready", "status": if ready { "True" } else { "False" }, "lastTransitionTime": now()})
}

fn healthy(pod: &Value) -> bool {
    pod["metadata"]["deletionTimestamp"].is_null()
        && pod["status"]["conditions"].as_array().is_some_and(|cs| cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

/// An int-or-percent budget field against `expected` pods (percentages round up, as the
/// disruption controller does).
fn scaled(value: &Value, expected: i64) -> Result<i64, String> {
    if let Some(n) = value.as_i64() {
        return Ok(n);
    }
    let text = value.as_str().unwrap_or_default();
    let percent: i64 = text.strip_suffix('%').and_then(|p| p.parse().ok()).ok_or_else(|| format!("invalid int or percent {text:?}"))?;
    Ok((percent * expected + 99) / 100)
}

/// A label selector's `matchLabels` (set expressions are not supported by the double).
fn selector_matches(selector: &Value, labels: &Value) -> bool {
    let Some(wanted) = selector["matchLabels"].as_object() else { return selector.as_object().is_some_and(|s| s.is_empty()) };
    wanted.iter().all(|(k, v)| &labels[k] == v)
}

/// Kubernetes' `Status` object, as error and eviction answers carry it.
fn status(code: StatusCode, reason: &str, message: &str, causes: Value) -> Response {
    let mut body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": if code.is_success() { "Success" } else { "Failure" },
                          "message": message, "reason": reason, "code": code.as_u16()});
    if !causes.is_null() {
        body["details"] = json!({"causes": causes});
    }
    (code, Json(body)).into_response()
}

fn not_found(kind: &str, name: &str) -> Response {
    status(StatusCode::NOT_FOUND, "NotFound", &format!("{kind} \"{name}\" not found"), Value::Null)
}

/// A running double: its URL, the CA that signed its certificate, the token it accepts.
#[derive(Debug)]
pub struct KubeApi {
    pub url: String,
    pub ca_pem: String,
    pub token: String,
    pub cluster: Arc<Mutex<Cluster>>,
    stop: CancellationToken,
    _dir: tempfile::TempDir,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl KubeApi {
    pub async fn start() -> anyhow::Result<KubeApi> {
        Self::start_with_names(&[]).await
    }

    /// Started with its certificate valid for `names` too, besides 127.0.0.1 (where it listens):
    /// for clients that reach this machine's loopback at another address (QEMU guests).
    pub async fn start_with_names(names: &[String]) -> anyhow::Result<KubeApi> {
        use keelson_controller::pki::{Authority, server_tls_config};
        let dir = tempfile::tempdir()?;
        let (authority, _) = Authority::load_or_create_named(dir.path(), "kube-apiserver double CA")?;
        let sans: Vec<String> = std::iter::once("127.0.0.1".to_owned()).chain(names.iter().cloned()).collect();
        let (cert, key) = authority.issue_server(&sans)?;
        let tls = Arc::new(server_tls_config(&authority.cert_pem, &cert.cert_pem, &key)?);
        let token: String = rand::Rng::sample_iter(rand::rng(), rand::distr::Alphanumeric).take(32).map(char::from).collect();
        let cluster = Arc::new(Mutex::new(Cluster::new()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("https://{}", listener.local_addr()?);
        let stop = CancellationToken::new();
        let app = Arc::new(App { cluster: cluster.clone(), token: token.clone(), stop: stop.clone() });
        let router = router(app);
        let serving = stop.clone();
        tokio::spawn(async move {
            if let Err(e) = keelson_controller::http::server::serve(listener, tls, router, serving).await {
                eprintln!("kube-apiserver double: {e}");
            }
        });
        Ok(KubeApi { url, ca_pem: authority.cert_pem.clone(), token, cluster, stop, _dir: dir })
    }

    /// A kubeconfig for the double, as an operator would hand one over.
    pub fn kubeconfig(&self) -> String {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {}\n    certificate-authority-data: {ca}\n\
             users:\n- name: admin\n  user:\n    token: {}\ncontexts:\n- name: double\n  context:\n    cluster: double\n    user: admin\n\
             current-context: double\n",
            self.url, self.token
        )
    }

    pub fn with<T>(&self, f: impl FnOnce(&mut Cluster) -> T) -> T {
        f(&mut self.cluster.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[derive(Debug)]
struct App {
    cluster: Arc<Mutex<Cluster>>,
    token: String,
    stop: CancellationToken,
}

impl App {
    fn cluster(&self) -> std::sync::MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/version", get(version))
        .route("/api", get(|| async { Json(json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})) }))
        .route("/apis", get(|| async { Json(api_groups()) }))
        .route("/api/v1", get(|| async { Json(core_resources()) }))
        .route(
            "/apis/policy/v1",
            get(|| async {
                Json(resources("policy/v1", &[("poddisruptionbudgets", "PodDisruptionBudget", true, &["get", "list", "watch"])]))
            }),
        )
        .route(
            "/apis/apps/v1",
            get(|| async { Json(resources("apps/v1", &[("daemonsets", "DaemonSet", true, &["get", "list", "watch"])])) }),
        )
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node).put(put_node))
        .route("/api/v1/pods", get(list_pods_everywhere))
        .route("/api/v1/namespaces/{ns}/pods", get(list_pods_in))
        .route("/api/v1/namespaces/{ns}/pods/{name}", get(get_pod).delete(delete_pod))
        .route("/api/v1/namespaces/{ns}/pods/{name}/eviction", axum::routing::post(evict))
        .route("/apis/policy/v1/poddisruptionbudgets", get(list_pdbs_everywhere))
        .route("/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", get(list_pdbs_in))
        .route("/apis/apps/v1/namespaces/{ns}/daemonsets/{name}", get(get_daemonset))
        .route("/api/v1/namespaces/{ns}/configmaps/{name}", get(get_configmap).patch(patch_configmap))
        .fallback(unserved)
        .layer(axum::middleware::from_fn_with_state(app.clone(), authenticate))
        .with_state(app)
}

async fn version(State(app): State<Arc<App>>) -> Response {
    let git_version = app.cluster().server_version();
    let mut parts = git_version.trim_start_matches('v').split('.');
    let (major, minor) = (parts.next().unwrap_or_default().to_owned(), parts.next().unwrap_or_default().to_owned());
    Json(json!({"major": major, "minor": minor, "gitVersion": git_version, "platform": "linux/amd64"})).into_response()
}

async fn authenticate(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let presented = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if presented != Some(app.token.as_str()) {
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized", Value::Null);
    }
    next.run(request).await
}

async fn unserved(State(app): State<Arc<App>>, request: Request) -> Response {
    let what = format!("{} {}", request.method(), request.uri());
    app.cluster().unserved.push(what.clone());
    status(StatusCode::NOT_FOUND, "NotFound", &format!("the server could not find the requested resource ({what})"), Value::Null)
}

fn api_groups() -> Value {
    let group = |name: &str| {
        let gv = format!("{name}/v1");
        json!({"name": name, "versions": [{"groupVersion": gv, "version": "v1"}], "preferredVersion": {"groupVersion": gv, "version": "v1"}})
    };
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group("apps"), group("policy")]})
}

fn resources(group_version: &str, list: &[(&str, &str, bool, &[&str])]) -> Value {
    let resources: Vec<Value> = list
        .iter()
        .map(|(name, kind, namespaced, verbs)| {
            let singular = if name.contains('/') { "" } else { kind };
            json!({"name": name, "singularName": singular.to_lowercase(), "namespaced": namespaced, "kind": kind, "verbs": verbs})
        })
        .collect();
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources})
}

fn core_resources() -> Value {
    resources(
        "v1",
        &[
            ("nodes", "Node", false, &["get", "list", "patch", "update", "watch"]),
            ("pods", "Pod", true, &["delete", "get", "list", "watch"]),
            ("pods/eviction", "Eviction", true, &["create"]),
            ("configmaps", "ConfigMap", true, &["get", "patch"]),
        ],
    )
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    #[serde(default)]
    watch: Option<String>,
    field_selector: Option<String>,
    label_selector: Option<String>,
    resource_version: Option<String>,
    timeout_seconds: Option<u64>,
}

impl ListQuery {
    fn watching(&self) -> bool {
        matches!(self.watch.as_deref(), Some("true" | "1"))
    }
}

/// Requirements of a field or label selector: (key, wanted, equal).
fn requirements(selector: Option<&str>) -> Vec<(String, String, bool)> {
    selector
        .unwrap_or_default()
        .split(',')
        .filter(|r| !r.is_empty())
        .filter_map(|r| {
            if let Some((k, v)) = r.split_once("!=") {
                Some((k.to_owned(), v.to_owned(), false))
            } else {
                let (k, v) = r.split_once("==").or_else(|| r.split_once('='))?;
                Some((k.to_owned(), v.to_owned(), true))
            }
        })
        .collect()
}

/// Whether `object` passes a list query's selectors; Err names an unsupported field.
fn selected(object: &Value, query: &ListQuery, fields: &[&str]) -> Result<bool, String> {
    for (field, wanted, equal) in requirements(query.field_selector.as_deref()) {
        if !fields.contains(&field.as_str()) {
            return Err(format!("field label not supported: {field}"));
        }
        let value = field.split('.').fold(object, |v, part| &v[part]);
        if (value.as_str().unwrap_or_default() == wanted) != equal {
            return Ok(false);
        }
    }
    for (label, wanted, equal) in requirements(query.label_selector.as_deref()) {
        if (object["metadata"]["labels"][&label].as_str() == Some(wanted.as_str())) != equal {
            return Ok(false);
        }
    }
    Ok(true)
}

const POD_FIELDS: &[&str] = &["spec.nodeName", "metadata.name", "metadata.namespace", "status.phase"];
const NODE_FIELDS: &[&str] = &["metadata.name", "spec.unschedulable"];

/// A list, or with `watch` a stream of newline-delimited watch events.
fn list_or_watch(app: Arc<App>, kind: &'static str, namespace: Option<String>, query: ListQuery) -> Response {
    let fields = if kind == "Pod" { POD_FIELDS } else { NODE_FIELDS };
    let in_scope = {
        let namespace = namespace.clone();
        move |o: &Value| namespace.as_deref().is_none_or(|ns| o["metadata"]["namespace"] == ns)
    };
    let cluster = app.cluster();
    let objects: Vec<&Value> = match kind {
        "Pod" => cluster.pods.values().collect(),
        "Node" => cluster.nodes.values().collect(),
        _ => cluster.pdbs.values().collect(),
    };
    let mut items = Vec::new();
    for o in objects.into_iter().filter(|o| in_scope(o)) {
        match selected(o, &query, fields) {
            Ok(true) => items.push(o.clone()),
            Ok(false) => {}
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e, Value::Null),
        }
    }
    if !query.watching() {
        let api_version = if kind == "PodDisruptionBudget" { "policy/v1" } else { "v1" };
        return Json(json!({"kind": format!("{kind}List"), "apiVersion": api_version,
                           "metadata": {"resourceVersion": cluster.revision.to_string()}, "items": items}))
        .into_response();
    }
    // A watch: from a resourceVersion, the changes after it; without one (or "0"), the
    // current objects as ADDED first.
    let from: Option<u64> = query.resource_version.as_deref().filter(|rv| *rv != "0").and_then(|rv| rv.parse().ok());
    let backlog: Vec<WatchEvent> = match from {
        Some(rv) => {
            if cluster.history.first().is_some_and(|e| revision_of(&e.object) > rv + 1) && rv < cluster.revision {
                let expired = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "Expired", "code": 410, "message": format!("too old resource version: {rv}")}});
                return ndjson(vec![expired]);
            }
            cluster.history.iter().filter(|e| e.kind == kind && revision_of(&e.object) > rv).cloned().collect()
        }
        None => items.into_iter().map(|object| WatchEvent { kind, type_: "ADDED", object }).collect(),
    };
    let mut live = cluster.events.subscribe();
    let last = from.unwrap_or(cluster.revision);
    drop(cluster);
    let timeout = Duration::from_secs(query.timeout_seconds.unwrap_or(1800));
    let stop = app.stop.clone();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(64);
    tokio::spawn(async move {
        let pass = |e: &WatchEvent| e.kind == kind && in_scope(&e.object) && selected(&e.object, &query, fields).unwrap_or(false);
        let line = |e: &WatchEvent| {
            let mut bytes = serde_json::to_vec(&json!({"type": e.type_, "object": e.object})).unwrap_or_default();
            bytes.push(b'\n');
            bytes
        };
        for e in backlog.iter().filter(|e| pass(e)) {
            if tx.send(Ok(line(e))).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            let event = tokio::select! {
                _ = &mut deadline => return,
                _ = stop.cancelled() => return,
                event = live.recv() => match event {
                    Ok(e) => e,
                    Err(_) => return,
                },
            };
            if revision_of(&event.object) > last && pass(&event) && tx.send(Ok(line(&event))).await.is_err() {
                return;
            }
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn ndjson(lines: Vec<Value>) -> Response {
    let body: String = lines.iter().map(|l| format!("{l}\n")).collect();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn revision_of(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"].as_str().and_then(|r| r.parse().ok()).unwrap_or(0)
}

async fn list_nodes(State(app): State<Arc<App>>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(app, "Node", None, q)
}

async fn list_pods_everywhere(State(app): State<Arc<App>>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(app, "Pod", None, q)
}

async fn list_pods_in(State(app): State<Arc<App>>, Path(ns): Path<String>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(app, "Pod", Some(ns), q)
}

async fn list_pdbs_everywhere(State(app): State<Arc<App>>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(app, "PodDisruptionBudget", None, q)
}

async fn list_pdbs_in(State(app): State<Arc<App>>, Path(ns): Path<String>, Query(q): Query<ListQuery>) -> Response {
    list_or_watch(app, "PodDisruptionBudget", Some(ns), q)
}

async fn get_node(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match app.cluster().nodes.get(&name) {
        Some(n) => Json(n.clone()).into_response(),
        None => not_found("nodes", &name),
    }
}

/// RFC 7386 JSON merge patch. For what drain patches (`spec.unschedulable`, labels,
/// annotations: no lists) a strategic merge patch means the same.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(fields) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    for (k, v) in fields {
        if v.is_null() {
            if let Some(t) = target.as_object_mut() {
                t.remove(k);
            }
        } else {
            merge_patch(&mut target[k], v);
        }
    }
}

/// Records a node's change of schedulability in the log.
fn log_cordon(cluster: &mut Cluster, name: &str, before: bool, after: bool) {
    if before != after {
        cluster.log.push(format!("{} {name}", if after { "cordon" } else { "uncordon" }));
    }
}

async fn patch_node(State(app): State<Arc<App>>, Path(name): Path<String>, headers: HeaderMap, body: String) -> Response {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if !matches!(content_type, "application/strategic-merge-patch+json" | "application/merge-patch+json") {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            &format!("the double does not take {content_type:?} patches"),
            Value::Null,
        );
    }
    let Ok(patch) = serde_json::from_str::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "the patch is not JSON", Value::Null);
    };
    let mut cluster = app.cluster();
    let Some(mut node) = cluster.nodes.get(&name).cloned() else { return not_found("nodes", &name) };
    let before = node["spec"]["unschedulable"] == true;
    merge_patch(&mut node, &patch);
    node["metadata"]["name"] = json!(name);
    cluster.stamp(&mut node);
    log_cordon(&mut cluster, &name, before, node["spec"]["unschedulable"] == true);
    cluster.nodes.insert(name, node.clone());
    cluster.publish("Node", "MODIFIED", node.clone());
    Json(node).into_response()
}

async fn get_configmap(State(app): State<Arc<App>>, Path((ns, name)): Path<(String, String)>) -> Response {
    match app.cluster().configmaps.get(&(ns, name.clone())) {
        Some(c) => Json(c.clone()).into_response(),
        None => not_found("configmaps", &name),
    }
}

async fn patch_configmap(
    State(app): State<Arc<App>>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if !matches!(content_type, "application/strategic-merge-patch+json" | "application/merge-patch+json") {
        let message = format!("the double does not take {content_type:?} patches");
        return status(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", &message, Value::Null);
    }
    let Ok(patch) = serde_json::from_str::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "the patch is not JSON", Value::Null);
    };
    let mut cluster = app.cluster();
    let key = (ns.clone(), name.clone());
    let Some(mut config) = cluster.configmaps.get(&key).cloned() else { return not_found("configmaps", &name) };
    merge_patch(&mut config, &patch);
    config["metadata"]["name"] = json!(name);
    config["metadata"]["namespace"] = json!(ns);
    cluster.stamp(&mut config);
    cluster.log.push(format!("configmap {ns}/{name}"));
    cluster.configmaps.insert(key, config.clone());
    Json(config).into_response()
}

async fn put_node(State(app): State<Arc<App>>, Path(name): Path<String>, Json(mut node): Json<Value>) -> Response {
    let mut cluster = app.cluster();
    let Some(current) = cluster.nodes.get(&name).cloned() else { return not_found("nodes", &name) };
    if node["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"] {
        let message = format!(
            "Operation cannot be fulfilled on nodes \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
        );
        return status(StatusCode::CONFLICT, "Conflict", &message, Value::Null);
    }
    let before = current["spec"]["unschedulable"] == true;
    node["metadata"]["uid"] = current["metadata"]["uid"].clone();
    node["metadata"]["creationTimestamp"] = current["metadata"]["creationTimestamp"].clone();
    cluster.stamp(&mut node);
    log_cordon(&mut cluster, &name, before, node["spec"]["unschedulable"] == true);
    cluster.nodes.insert(name, node.clone());
    cluster.publish("Node", "MODIFIED", node.clone());
    Json(node).into_response()
}

async fn get_pod(State(app): State<Arc<App>>, Path((ns, name)): Path<(String, String)>) -> Response {
    match app.cluster().pods.get(&(ns, name.clone())) {
        Some(p) => Json(p.clone()).into_response(),
        None => not_found("pods", &name),
    }
}

async fn get_daemonset(State(app): State<Arc<App>>, Path((ns, name)): Path<(String, String)>) -> Response {
    match app.cluster().daemonsets.get(&(ns, name.clone())) {
        Some(d) => Json(d.clone()).into_response(),
        None => not_found("daemonsets.apps", &name),
    }
}

async fn delete_pod(State(app): State<Arc<App>>, Path((ns, name)): Path<(String, String)>) -> Response {
    let key = (ns, name);
    let mut cluster = app.cluster();
    let Some(pod) = cluster.pods.get(&key).cloned() else { return not_found("pods", &key.1) };
    cluster.log.push(format!("delete {}/{}", key.0, key.1));
    let pod = terminate(&app, &mut cluster, pod);
    Json(pod).into_response()
}

async fn evict(State(app): State<Arc<App>>, Path((ns, name)): Path<(String, String)>, Json(eviction): Json<Value>) -> Response {
    // A body without apiVersion and kind is taken as the subresource's own type, as a real
    // server's decoder does (kube-rs sends only `metadata`); a wrong one is refused.
    let api_version = eviction["apiVersion"].as_str().unwrap_or("policy/v1");
    let kind = eviction["kind"].as_str().unwrap_or("Eviction");
    if !matches!(api_version, "policy/v1" | "policy/v1beta1") || kind != "Eviction" {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!("not an Eviction: apiVersion {api_version:?}, kind {kind:?}"),
            Value::Null,
        );
    }
    if eviction["metadata"]["name"].as_str().is_some_and(|n| n != name) {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "name in URL does not match name in Eviction object", Value::Null);
    }
    let key = (ns, name);
    let mut cluster = app.cluster();
    let Some(pod) = cluster.pods.get(&key).cloned() else { return not_found("pods", &key.1) };
    let who = format!("{}/{}", key.0, key.1);
    // A pod already terminating goes on terminating.
    if !pod["metadata"]["deletionTimestamp"].is_null() {
        return status(StatusCode::OK, "", "", Value::Null);
    }
    let budgets = cluster.budgets_for(&pod);
    if budgets.len() > 1 {
        let message = "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.";
        return status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", message, Value::Null);
    }
    if let Some(budget) = budgets.first()
        && let Err(reason) = cluster.budget_allows(budget, &pod)
    {
        cluster.log.push(format!("refuse {who}"));
        let causes = json!([{"reason": "DisruptionBudget", "message": reason}]);
        return status(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            "Cannot evict pod as it would violate the pod's disruption budget.",
            causes,
        );
    }
    cluster.log.push(format!("evict {who}"));
    terminate(&app, &mut cluster, pod);
    status(StatusCode::CREATED, "", "", Value::Null)
}

/// Marks a pod terminating; after the grace period it is gone (and a ReplicaSet's replaced).
fn terminate(app: &Arc<App>, cluster: &mut Cluster, mut pod: Value) -> Value {
    if pod["metadata"]["deletionTimestamp"].is_null() {
        pod["metadata"]["deletionTimestamp"] = json!(now());
        cluster.stamp(&mut pod);
        cluster.pods.insert(key_of(&pod), pod.clone());
        cluster.publish("Pod", "MODIFIED", pod.clone());
        let (app, key, grace) = (app.clone(), key_of(&pod), cluster.grace);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            let replace = {
                let mut cluster = app.cluster();
                let Some(mut gone) = cluster.pods.remove(&key) else { return };
                cluster.log.push(format!("gone {}/{}", key.0, key.1));
                cluster.stamp(&mut gone);
                cluster.publish("Pod", "DELETED", gone.clone());
                cluster.replacement_ready_after.filter(|_| owner_kind(&gone) == Some("ReplicaSet")).map(|after| (gone, after))
            };
            if let Some((gone, after)) = replace {
                replace_pod(&app, gone, after).await;
            }
        });
    }
    pod
}

fn owner_kind(pod: &Value) -> Option<&str> {
    pod["metadata"]["ownerReferences"].as_array()?.iter().find(|o| o["controller"] == true)?["kind"].as_str()
}

/// What a ReplicaSet controller and a kubelet do for a deleted pod: a new pod on another
/// schedulable node, Ready a while later.
async fn replace_pod(app: &Arc<App>, gone: Value, ready_after: Duration) {
    let key = {
        let mut cluster = app.cluster();
        let from = gone["spec"]["nodeName"].clone();
        let Some(node) = cluster.nodes.values().find(|n| n["metadata"]["name"] != from && n["spec"]["unschedulable"] != true).cloned()
        else {
            return;
        };
        let mut pod = json!({"metadata": {"namespace": gone["metadata"]["namespace"], "labels": gone["metadata"]["labels"],
                                          "ownerReferences": gone["metadata"]["ownerReferences"]},
                             "spec": gone["spec"].clone(), "status": {"phase": "Pending", "conditions": [ready_condition(false)]}});
        let base = gone["metadata"]["name"].as_str().unwrap_or("pod");
        pod["metadata"]["name"] = json!(format!("{base}-r{}", cluster.revision));
        pod["spec"]["nodeName"] = node["metadata"]["name"].clone();
        cluster.add_pod(pod.clone());
        key_of(&pod)
    };
    tokio::time::sleep(ready_after).await;
    let mut cluster = app.cluster();
    if let Some(mut pod) = cluster.pods.get(&key).cloned() {
        cluster.log.push(format!("ready {}/{}", key.0, key.1));
        pod["status"] = json!({"phase": "Running", "conditions": [ready_condition(true)]});
        cluster.stamp(&mut pod);
        cluster.pods.insert(key, pod.clone());
        cluster.publish("Pod", "MODIFIED", pod);
    }
}
