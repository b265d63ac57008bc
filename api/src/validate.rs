//! Validation past what a field's own type checks: field combinations, uniqueness, and rules
//! that compare a new spec with the one it replaces. Every error names the field path.

use std::collections::BTreeSet;
use std::fmt;

use crate::cluster::{ClusterAccess, KubernetesCluster, read_kubeconfig};
use crate::machine::{Machine, MachineSpec, Role, Source};
use crate::meta::{Name, ObjectMeta};
use crate::pool::MachinePool;
use crate::version::{KubeVersion, ReleaseVersion};

/// One problem with one field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() { f.write_str(&self.message) } else { write!(f, "{}: {}", self.field, self.message) }
    }
}

/// Every problem found in one object; never empty.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationError(pub Vec<FieldError>);

impl ValidationError {
    pub fn single(field: impl Into<String>, message: impl Into<String>) -> Self {
        ValidationError(vec![FieldError { field: field.into(), message: message.into() }])
    }
    /// The path of the first offending field.
    pub fn field(&self) -> &str {
        self.0.first().map(|e| e.field.as_str()).unwrap_or("")
    }
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            e.fmt(f)?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct Errors(Vec<FieldError>);

impl Errors {
    fn add(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError { field: field.into(), message: message.into() });
    }
    fn finish(self) -> Result<(), ValidationError> {
        if self.0.is_empty() { Ok(()) } else { Err(ValidationError(self.0)) }
    }
}

fn check_type(errors: &mut Errors, api_version: &str, kind: &str, want_kind: &str) {
    if api_version != crate::API_VERSION {
        errors.add("apiVersion", format!("{api_version:?} is not served; use {:?}", crate::API_VERSION));
    }
    if kind != want_kind {
        errors.add("kind", format!("{kind:?} where {want_kind:?} was expected"));
    }
}

fn check_meta(errors: &mut Errors, meta: &ObjectMeta) {
    if meta.name.is_none() {
        errors.add("metadata.name", "is required");
    }
    for (k, v) in &meta.labels {
        if let Err(message) = check_label(k, v) {
            errors.add(format!("metadata.labels.{k}"), message);
        }
    }
}

/// Label keys are an optional DNS prefix and a name; values are at most 63 characters of
/// letters, digits, '-', '_' and '.'.
pub fn check_label(key: &str, value: &str) -> Result<(), String> {
    let name = key.rsplit_once('/').map_or(key, |(_, n)| n);
    let part_ok = |s: &str, max: usize| {
        s.len() <= max
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
            && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
    };
    if name.is_empty() || !part_ok(name, 63) || key.len() > 253 {
        return Err(format!("{key:?} is not a valid label key"));
    }
    if !part_ok(value, 63) {
        return Err(format!("{value:?} is not a valid label value"));
    }
    Ok(())
}

pub fn validate_machine(m: &Machine) -> Result<(), ValidationError> {
    let mut errors = Errors::default();
    check_type(&mut errors, &m.api_version, &m.kind, crate::KIND_MACHINE);
    check_meta(&mut errors, &m.metadata);
    check_spec(&mut errors, "spec", &m.spec);
    errors.finish()
}

/// A cluster's type, name and kubeconfig; what the kubeconfig gives access to.
pub fn validate_cluster(c: &KubernetesCluster) -> Result<ClusterAccess, ValidationError> {
    let mut errors = Errors::default();
    check_type(&mut errors, &c.api_version, &c.kind, crate::KIND_CLUSTER);
    check_meta(&mut errors, &c.metadata);
    match read_kubeconfig(&c.spec.kubeconfig, c.spec.context.as_deref()) {
        Ok(access) => errors.finish().map(|()| access),
        Err(e) => {
            errors.0.extend(e.0);
            Err(ValidationError(errors.0))
        }
    }
}

pub fn validate_pool(p: &MachinePool) -> Result<(), ValidationError> {
    let mut errors = Errors::default();
    check_type(&mut errors, &p.api_version, &p.kind, crate::KIND_POOL);
    check_meta(&mut errors, &p.metadata);
    if p.spec.selector.match_labels.is_empty() {
        errors.add("spec.selector.matchLabels", "must name at least one label (an empty selector would take every machine)");
    }
    for (k, v) in &p.spec.selector.match_labels {
        if let Err(message) = check_label(k, v) {
            errors.add(format!("spec.selector.matchLabels.{k}"), message);
        }
    }
    if let Some(name) = &p.metadata.name
        && p.spec.rollout.after.contains(name)
    {
        errors.add("spec.rollout.after", "a pool cannot wait for itself");
    }
    if let Some(label) = &p.spec.rollout.wave_label
        && let Err(message) = check_label(label, "")
    {
        errors.add("spec.rollout.waveLabel", message);
    }
    if p.spec.rollout.max_failures == 0 {
        errors.add("spec.rollout.maxFailures", "must be at least 1");
    }
    if p.spec.rollout.canary.as_ref().is_some_and(|c| c.machines == 0) {
        errors.add("spec.rollout.canary.machines", "must be at least 1");
    }
    for (i, w) in p.spec.rollout.maintenance_windows.iter().enumerate() {
        let at = format!("spec.rollout.maintenanceWindows[{i}]");
        if w.days.is_empty() {
            errors.add(format!("{at}.days"), "must name at least one day (Mon … Sun)");
        }
        if w.start == w.end {
            errors.add(format!("{at}.end"), "must differ from start");
        }
        if let Err(message) = crate::window::check_time_zone(&w.time_zone) {
            errors.add(format!("{at}.timeZone"), message);
        }
    }
    if !(1..=100).contains(&p.spec.rollout.revision_history_limit) {
        errors.add("spec.rollout.revisionHistoryLimit", "must be between 1 and 100");
    }
    if p.spec.template.spec.roles.contains(&Role::Etcd) && p.spec.rollout.max_unavailable != crate::pool::IntOrPercent::Int(1) {
        errors.add("spec.rollout.maxUnavailable", "must be 1 for a pool with role etcd (one member at a time)");
    }
    if let Some(drain) = p.spec.kubernetes.as_ref().and_then(|k| k.drain.as_ref()) {
        let range = crate::pool::MIN_DRAIN_SECONDS..=crate::pool::MAX_DRAIN_SECONDS;
        for (field, value) in [("timeoutSeconds", drain.timeout_seconds), ("retryAfterSeconds", drain.retry_after_seconds)] {
            if !range.contains(&value) {
                errors.add(format!("spec.kubernetes.drain.{field}"), format!("must be between {} and {}", range.start(), range.end()));
            }
        }
    }
    check_spec(&mut errors, "spec.template.spec", &p.spec.template.spec);
    errors.finish()
}

fn check_spec(errors: &mut Errors, at: &str, spec: &MachineSpec) {
    let mut roles = BTreeSet::new();
    for (i, role) in spec.roles.iter().enumerate() {
        if !roles.insert(role) {
            errors.add(format!("{at}.roles[{i}]"), format!("{role} is listed twice"));
        }
    }
    if let Some(os) = &spec.os {
        let mut names = BTreeSet::new();
        for (i, pin) in os.packages.iter().enumerate() {
            if !names.insert(pin.name.as_str()) {
                errors.add(format!("{at}.os.packages[{i}].name"), format!("{} is pinned twice", pin.name));
            }
        }
        let mut repos = BTreeSet::new();
        for (i, repo) in os.repositories.iter().enumerate() {
            let here = format!("{at}.os.repositories[{i}]");
            if !repos.insert(repo.name.as_str()) {
                errors.add(format!("{here}.name"), format!("{} is listed twice", repo.name));
            }
            if repo.uris.is_empty() {
                errors.add(format!("{here}.uris"), "needs at least one URI");
            }
            for (j, uri) in repo.uris.iter().enumerate() {
                if !matches!(uri.scheme(), "http" | "https" | "file") {
                    errors.add(format!("{here}.uris[{j}]"), format!("scheme {:?} is not http, https or file", uri.scheme()));
                }
            }
            if repo.suites.is_empty() {
                errors.add(format!("{here}.suites"), "needs at least one suite");
            }
            if repo.signed_by.is_none() && !repo.trusted {
                errors.add(format!("{here}.signedBy"), "is required unless the repository is marked trusted");
            }
        }
    }
    if let Some(rt) = &spec.container_runtime {
        check_source(errors, &format!("{at}.containerRuntime.source"), &rt.source);
        check_component_version(errors, &format!("{at}.containerRuntime.version"), &rt.version, &rt.source);
    }
    if let Some(k) = &spec.kubelet {
        check_source(errors, &format!("{at}.kubelet.source"), &k.source);
        if !spec.roles.iter().any(|r| matches!(r, Role::Worker | Role::ControlPlane)) {
            errors.add(format!("{at}.kubelet"), "needs role worker or control-plane");
        }
    }
    if let Some(k) = &spec.kubeadm {
        check_source(errors, &format!("{at}.kubeadm.source"), &k.source);
        if !spec.roles.iter().any(|r| matches!(r, Role::Worker | Role::ControlPlane)) {
            errors.add(format!("{at}.kubeadm"), "needs role worker or control-plane");
        }
        // kubeadm upgrades the node's configuration to its own version before the kubelet
        // follows: a kubelet ahead of it would run with a configuration older than itself.
        if let Some(kubelet) = &spec.kubelet
            && kube_minor(&kubelet.version) > kube_minor(&k.version)
        {
            errors.add(
                format!("{at}.kubelet.version"),
                format!("{} is newer than kubeadm {}: upgrade kubeadm to the kubelet's minor first", kubelet.version, k.version),
            );
        }
    }
    match (&spec.etcd, spec.roles.contains(&Role::Etcd)) {
        (Some(etcd), true) => {
            check_source(errors, &format!("{at}.etcd.source"), &etcd.source);
            check_component_version(errors, &format!("{at}.etcd.version"), &etcd.version, &etcd.source);
        }
        (Some(_), false) => errors.add(format!("{at}.etcd"), "is only allowed with role etcd"),
        (None, true) => errors.add(format!("{at}.etcd"), "is required with role etcd"),
        (None, false) => {}
    }
    let mut paths = BTreeSet::new();
    for (i, file) in spec.files.iter().enumerate() {
        let here = format!("{at}.files[{i}].path");
        if !file.path.starts_with('/')
            || file.path.split('/').any(|c| c == ".." || c == ".")
            || file.path.ends_with('/')
            || file.path.contains("//")
        {
            errors.add(&here, format!("{:?} is not a normalised absolute file path", file.path));
        } else if !paths.insert(file.path.as_str()) {
            errors.add(&here, format!("{} is listed twice", file.path));
        }
    }
    let mut scripts = BTreeSet::new();
    for (i, script) in spec.scripts.iter().enumerate() {
        let here = format!("{at}.scripts[{i}]");
        if !scripts.insert(script.name.as_str()) {
            errors.add(format!("{here}.name"), format!("{} is listed twice", script.name));
        }
        if script.run.first().is_none_or(|a| a.is_empty()) {
            errors.add(format!("{here}.run"), "needs a program to run as its first element");
        }
        if !(1..=86_400).contains(&script.timeout_seconds) {
            errors.add(format!("{here}.timeoutSeconds"), "must be between 1 and 86400");
        }
    }
}

fn check_source(errors: &mut Errors, at: &str, source: &Source) {
    match (&source.package, &source.url, &source.sha256) {
        (Some(_), None, None) => {}
        (None, Some(url), Some(_)) => {
            if !matches!(url.scheme(), "https" | "http" | "file") {
                errors.add(format!("{at}.url"), format!("scheme {:?} is not https, http or file", url.scheme()));
            }
        }
        (None, Some(_), None) => errors.add(format!("{at}.sha256"), "is required with a url: artifacts are pinned by digest"),
        (Some(_), Some(_), _) => errors.add(at, "give either package or url, not both"),
        (Some(_), None, Some(_)) => errors.add(format!("{at}.sha256"), "only applies to a url source"),
        (None, None, _) => errors.add(at, "needs a package or a url with its sha256"),
    }
}

fn check_component_version(errors: &mut Errors, at: &str, version: &str, source: &Source) {
    if source.url.is_some() {
        if let Err(e) = version.parse::<ReleaseVersion>() {
            errors.add(at, e.to_string());
        }
    } else if let Err(e) = version.parse::<crate::machine::PackageVersion>() {
        errors.add(at, e);
    }
}

/// Rules that compare a new spec with the one it replaces: the kubelet, kubeadm and etcd move at most
/// one minor version at a time, and etcd is never downgraded across a minor.
pub fn validate_spec_change(at: &str, old: &MachineSpec, new: &MachineSpec) -> Result<(), ValidationError> {
    let mut errors = Errors::default();
    if let (Some(o), Some(n)) = (&old.kubelet, &new.kubelet) {
        check_minor_step(&mut errors, &format!("{at}.kubelet.version"), "kubelet", kube_minor(&o.version), kube_minor(&n.version), false);
    }
    if let (Some(o), Some(n)) = (&old.kubeadm, &new.kubeadm) {
        check_minor_step(&mut errors, &format!("{at}.kubeadm.version"), "kubeadm", kube_minor(&o.version), kube_minor(&n.version), false);
    }
    if let (Some(o), Some(n)) = (&old.etcd, &new.etcd)
        && let (Some(ov), Some(nv)) = (release_minor(&o.version), release_minor(&n.version))
    {
        check_minor_step(&mut errors, &format!("{at}.etcd.version"), "etcd", ov, nv, true);
    }
    errors.finish()
}

fn kube_minor(v: &KubeVersion) -> (u64, u64) {
    (v.major(), v.minor())
}

/// The MAJOR.MINOR of a release version, or of the upstream part of a package version.
fn release_minor(v: &str) -> Option<(u64, u64)> {
    let upstream = v.split_once(':').map_or(v, |(_, r)| r);
    let mut parts = upstream.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn check_minor_step(errors: &mut Errors, at: &str, what: &str, old: (u64, u64), new: (u64, u64), refuse_downgrade: bool) {
    if new.0 != old.0 {
        errors.add(at, format!("{what} cannot change major version ({}.{} to {}.{})", old.0, old.1, new.0, new.1));
    } else if new.1 > old.1 + 1 {
        errors.add(
            at,
            format!(
                "{what} cannot skip a minor version ({}.{} to {}.{}); upgrade to {}.{} first",
                old.0,
                old.1,
                new.0,
                new.1,
                old.0,
                old.1 + 1
            ),
        );
    } else if new.1 + 1 < old.1 || (refuse_downgrade && new.1 < old.1) {
        errors.add(at, format!("{what} cannot be downgraded from {}.{} to {}.{}", old.0, old.1, new.0, new.1));
    }
}

/// Validates a name given outside an object (a path segment, a CLI argument).
pub fn parse_name(field: &str, value: &str) -> Result<Name, ValidationError> {
    value.parse().map_err(|e: crate::meta::NameError| ValidationError::single(field, e.to_string()))
}
