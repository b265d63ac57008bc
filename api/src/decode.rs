//! Decoding resources from JSON (the wire) and YAML (the CLI), with errors that name the
//! field path, followed by validation.

use serde::de::DeserializeOwned;

use crate::cluster::KubernetesCluster;
use crate::machine::Machine;
use crate::pool::MachinePool;
use crate::token::BootstrapToken;
use crate::validate::{ValidationError, validate_cluster, validate_machine, validate_pool};

/// Any keelson resource, as read from a file or a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Resource {
    Machine(Box<Machine>),
    MachinePool(Box<MachinePool>),
    BootstrapToken(Box<BootstrapToken>),
    KubernetesCluster(Box<KubernetesCluster>),
}

impl Resource {
    pub fn kind(&self) -> &'static str {
        match self {
            Resource::Machine(_) => crate::KIND_MACHINE,
            Resource::MachinePool(_) => crate::KIND_POOL,
            Resource::BootstrapToken(_) => crate::KIND_TOKEN,
            Resource::KubernetesCluster(_) => crate::KIND_CLUSTER,
        }
    }
    pub fn name(&self) -> &str {
        match self {
            Resource::Machine(m) => m.metadata.name_str(),
            Resource::MachinePool(p) => p.metadata.name_str(),
            Resource::BootstrapToken(t) => t.metadata.name_str(),
            Resource::KubernetesCluster(c) => c.metadata.name_str(),
        }
    }
}

/// Deserializes a JSON value into `T`, naming the field path of the first error.
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ValidationError> {
    serde_path_to_error::deserialize(value).map_err(path_error)
}

/// Deserializes JSON text into `T`, naming the field path of the first error.
pub fn from_json<T: DeserializeOwned>(text: &[u8]) -> Result<T, ValidationError> {
    let mut de = serde_json::Deserializer::from_slice(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(path_error)?;
    de.end().map_err(|e| ValidationError::single("", format!("malformed JSON: {e}")))?;
    Ok(value)
}

fn path_error(e: serde_path_to_error::Error<serde_json::Error>) -> ValidationError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if inner.is_syntax() || inner.is_eof() {
        return ValidationError::single("", format!("malformed JSON: {inner}"));
    }
    let field = if path == "." { String::new() } else { path };
    ValidationError::single(field, strip_position(&inner.to_string()))
}

/// serde_json appends " at line L column C" to data errors, which means nothing for a
/// value decoded from YAML; the field path says where.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

/// Decodes one resource of any kind from a JSON value and validates it.
pub fn resource_from_value(value: serde_json::Value) -> Result<Resource, ValidationError> {
    let kind = value.get("kind").and_then(|k| k.as_str()).map(str::to_owned);
    match kind.as_deref() {
        Some(crate::KIND_MACHINE) => {
            let m: Machine = from_value(value)?;
            validate_machine(&m)?;
            Ok(Resource::Machine(Box::new(m)))
        }
        Some(crate::KIND_POOL) => {
            let p: MachinePool = from_value(value)?;
            validate_pool(&p)?;
            Ok(Resource::MachinePool(Box::new(p)))
        }
        Some(crate::KIND_TOKEN) => Ok(Resource::BootstrapToken(Box::new(from_value(value)?))),
        Some(crate::KIND_CLUSTER) => {
            let c: KubernetesCluster = from_value(value)?;
            validate_cluster(&c)?;
            Ok(Resource::KubernetesCluster(Box::new(c)))
        }
        Some(other) => Err(ValidationError::single(
            "kind",
            format!("{other:?} is not a keelson kind (Machine, MachinePool, BootstrapToken, KubernetesCluster)"),
        )),
        None => Err(ValidationError::single("kind", "is required")),
    }
}

/// Reads every resource in a YAML or JSON text (YAML documents separated by `---`).
/// Errors name the document (counted from 1) and the field.
pub fn resources_from_text(text: &str) -> Result<Vec<Resource>, ValidationError> {
    let trimmed = text.trim_start();
    let values: Vec<serde_json::Value> = if trimmed.starts_with('{') || trimmed.starts_with('[') {
        match from_json::<serde_json::Value>(text.as_bytes())? {
            serde_json::Value::Array(items) => items,
            one => vec![one],
        }
    } else {
        serde_saphyr::from_multiple(text).map_err(|e| ValidationError::single("", format!("malformed YAML: {e}")))?
    };
    if values.is_empty() {
        return Err(ValidationError::single("", "no resources found"));
    }
    let many = values.len() > 1;
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            resource_from_value(v).map_err(|mut e| {
                if many {
                    for fe in &mut e.0 {
                        fe.field = format!("document {}: {}", i + 1, fe.field);
                    }
                }
                e
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        match resources_from_text(text) {
            Ok(r) => panic!("accepted: {r:?}"),
            Err(e) => e.to_string(),
        }
    }

    const GOOD: &str = r#"
apiVersion: keelson.io/v1alpha1
kind: Machine
metadata: {name: worker-07, labels: {pool: workers, rack: r12}}
spec:
  roles: [worker]
  os:
    packages:
      - {name: linux-image-amd64, version: 6.1.192-3}
    reboot: IfRequired
  containerRuntime:
    name: containerd
    version: 1.6.20~ds1-1+deb12u3
    source: {package: containerd}
    config: {systemdCgroup: true}
  kubelet:
    version: 1.30.4
    source: {url: "https://example.invalid/kubelet", sha256: "0000000000000000000000000000000000000000000000000000000000000000"}
  files: [{path: /etc/motd, content: "hi\n", mode: "0644"}]
---
apiVersion: keelson.io/v1alpha1
kind: MachinePool
metadata: {name: workers}
spec:
  selector: {matchLabels: {pool: workers}}
  template: {spec: {roles: [worker]}}
  rollout: {maxUnavailable: "10%"}
"#;

    #[test]
    fn reads_multi_document_yaml_and_normalises_kubelet_version() {
        let rs = resources_from_text(GOOD).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rs.len(), 2);
        let Resource::Machine(m) = &rs[0] else { panic!("not a machine") };
        assert_eq!(m.spec.kubelet.as_ref().map(|k| k.version.to_string()).as_deref(), Some("v1.30.4"));
        assert_eq!(rs[1].kind(), "MachinePool");
    }

    #[test]
    fn errors_name_the_field_path() {
        let bad_kubelet = GOOD.replacen("version: 1.30.4", "version: 1.3x", 1);
        assert_eq!(err(&bad_kubelet), "document 1: spec.kubelet.version: \"1.3x\" is not a Kubernetes version");
        let unknown = GOOD.replacen("reboot: IfRequired", "reboot: IfRequired\n    rebooot: Always", 1);
        assert!(err(&unknown).starts_with("document 1: spec.os.rebooot: unknown field `rebooot`"), "{}", err(&unknown));
        let no_digest = GOOD.replacen(", sha256: \"0000000000000000000000000000000000000000000000000000000000000000\"", "", 1);
        assert_eq!(err(&no_digest), "document 1: spec.kubelet.source.sha256: is required with a url: artifacts are pinned by digest");
        let bad_digest = GOOD.replacen("\"0000000000000000000000000000000000000000000000000000000000000000\"", "\"abc\"", 1);
        assert!(err(&bad_digest).contains("spec.kubelet.source.sha256: \"abc\" is not a sha256 digest"));
        let bad_name = GOOD.replacen("name: worker-07", "name: Worker_07", 1);
        assert!(err(&bad_name).starts_with("document 1: metadata.name: \"Worker_07\" is not a valid name"));
        let bad_kind = GOOD.replacen("kind: MachinePool", "kind: MachineSet", 1);
        assert!(err(&bad_kind).starts_with("document 2: kind: \"MachineSet\" is not a keelson kind"));
        let bad_api = GOOD.replacen("apiVersion: keelson.io/v1alpha1", "apiVersion: keelson.io/v2", 1);
        assert!(err(&bad_api).starts_with("document 1: apiVersion: \"keelson.io/v2\" is not served"));
        let bad_pkg = GOOD.replacen("version: 6.1.192-3", "version: \"not a version!\"", 1);
        assert!(err(&bad_pkg).contains("spec.os.packages[0].version: \"not a version!\" is not a package version"));
        assert!(err("kind: [").starts_with("malformed YAML"));
        assert!(err("{\"kind\": ").starts_with("malformed JSON"), "{}", err("{\"kind\": "));
    }

    #[test]
    fn cross_field_rules() {
        let etcd_without_role =
            GOOD.replacen("  files:", "  etcd: {cluster: main, version: 3.5.1, source: {package: etcd-server}}\n  files:", 1);
        assert!(err(&etcd_without_role).contains("spec.etcd: is only allowed with role etcd"));
        let dup_file = GOOD.replacen(
            "files: [{path: /etc/motd, content: \"hi\\n\", mode: \"0644\"}]",
            "files: [{path: /etc/motd, content: a}, {path: /etc/motd, content: b}]",
            1,
        );
        assert!(err(&dup_file).contains("spec.files[1].path: /etc/motd is listed twice"), "{}", err(&dup_file));
        let relative = GOOD.replacen("path: /etc/motd", "path: ../etc/motd", 1);
        assert!(err(&relative).contains("spec.files[0].path"));
    }

    #[test]
    fn minor_skips_and_etcd_downgrades_are_refused() {
        use crate::validate::validate_spec_change;
        let spec = |kubelet: &str, etcd: &str| -> crate::machine::MachineSpec {
            serde_json::from_value(serde_json::json!({
                "roles": ["worker", "etcd"],
                "kubelet": {"version": kubelet, "source": {"package": "kubelet"}},
                "etcd": {"cluster": "main", "version": etcd, "source": {"package": "etcd-server"}},
            }))
            .unwrap_or_else(|e| panic!("{e}"))
        };
        assert!(validate_spec_change("spec", &spec("1.29.1", "3.4.23"), &spec("1.30.4", "3.5.1")).is_ok());
        let skip = validate_spec_change("spec", &spec("1.28.1", "3.4.23"), &spec("1.30.4", "3.4.23")).err().map(|e| e.to_string());
        assert_eq!(
            skip.as_deref(),
            Some("spec.kubelet.version: kubelet cannot skip a minor version (1.28 to 1.30); upgrade to 1.29 first")
        );
        let etcd_skip = validate_spec_change("spec", &spec("1.30.4", "3.4.23"), &spec("1.30.4", "3.6.0")).err().map(|e| e.to_string());
        assert!(etcd_skip.is_some_and(|e| e.contains("spec.etcd.version: etcd cannot skip a minor version (3.4 to 3.6)")));
        let etcd_down = validate_spec_change("spec", &spec("1.30.4", "3.5.1"), &spec("1.30.4", "3.4.23")).err().map(|e| e.to_string());
        assert!(etcd_down.is_some_and(|e| e.contains("etcd cannot be downgraded from 3.5 to 3.4")));
    }
}
