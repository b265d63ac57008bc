//! The planner: a pure function from the desired spec and the observed machine to an ordered
//! list of idempotent steps — repositories → OS packages → container runtime → files →
//! reboot — each marked disruptive or not. It never touches the machine.

use std::cmp::Ordering;

use keelson_api::machine::{MachineSpec, RebootPolicy};
use keelson_api::version::DebVersion;
use serde::{Deserialize, Serialize};

use crate::observe::{CONTAINERD_CONFIG, Observed, SOURCES_FILE, sha256_hex};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum Action {
    /// Write the managed apt sources (or remove them, `None`) and refresh the package lists.
    Repositories {
        content: Option<String>,
    },
    /// Install exact versions (after checking the repositories have them all), then hold.
    Packages {
        install: Vec<Pin>,
        hold: Vec<String>,
    },
    /// Hold pinned packages that are installed at the right version but not held.
    Hold {
        names: Vec<String>,
    },
    /// Install the runtime package and/or write its configuration, restart it, check it.
    Runtime {
        name: String,
        package: Option<Pin>,
        config: Option<String>,
        previous: Option<String>,
    },
    WriteFile {
        path: String,
        content: String,
        mode: u32,
        owner: Option<String>,
    },
    /// Download an artifact into the cache and check its digest (before any disruption).
    FetchArtifact {
        url: String,
        sha256: String,
    },
    /// Install the kubelet binary from the cached artifact (when `artifact` is set) and/or its
    /// unit and drop-in, restart it, check its health; roll back the binary if it is not healthy.
    Kubelet {
        artifact: Option<String>,
        version: String,
        unit: Option<String>,
        dropin: Option<String>,
    },
    /// Reboot, and after boot check that `expected_kernel` (when known) is running.
    Reboot {
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    pub name: String,
    pub version: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    pub action: Action,
    pub description: String,
    /// Interrupts workloads: needs a disruption lease.
    pub disruptive: bool,
}

/// What the planner needs besides spec and observation.
#[derive(Debug, Clone, Default)]
pub struct Context {
    pub generation: u64,
    /// The generation a `reboot: Always` reboot was last done for.
    pub rebooted_for_generation: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A part of the spec this agent cannot carry out; the machine is left as it is.
    #[error("{field}: {message}")]
    Unsupported { field: &'static str, message: String },
}

/// deb822 sources for the managed repositories.
pub fn render_sources(spec: &MachineSpec) -> Option<String> {
    let repos = &spec.os.as_ref()?.repositories;
    if repos.is_empty() {
        return None;
    }
    let mut out = String::from("# Managed by keelson-agent: changes are overwritten.\n");
    for (i, r) in repos.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&format!("# {}\nTypes: deb\n", r.name));
        out.push_str(&format!("URIs: {}\n", r.uris.iter().map(|u| u.as_str()).collect::<Vec<_>>().join(" ")));
        out.push_str(&format!("Suites: {}\n", r.suites.join(" ")));
        if !r.components.is_empty() {
            out.push_str(&format!("Components: {}\n", r.components.join(" ")));
        }
        if let Some(k) = &r.signed_by {
            out.push_str(&format!("Signed-By: {k}\n"));
        }
        if r.trusted {
            out.push_str("Trusted: yes\n");
        }
    }
    Some(out)
}

/// containerd's configuration for the spec: CRI with the runc runtime, and the cgroup driver
/// that must match the kubelet's.
pub fn render_containerd_config(systemd_cgroup: bool) -> String {
    format!(
        "# Managed by keelson-agent: changes are overwritten.\nversion = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n  SystemdCgroup = {systemd_cgroup}\n"
    )
}

fn same_version(installed: &str, wanted: &str) -> bool {
    match (installed.parse::<DebVersion>(), wanted.parse::<DebVersion>()) {
        (Ok(a), Ok(b)) => a.cmp(&b) == Ordering::Equal,
        _ => installed == wanted,
    }
}

fn file_differs(observed: &Observed, path: &str, content: &str, mode: u32) -> bool {
    observed.files.get(path).is_none_or(|f| f.sha256 != sha256_hex(content.as_bytes()) || f.mode != mode)
}

pub fn plan(spec: &MachineSpec, observed: &Observed, ctx: &Context) -> Result<Vec<Step>, PlanError> {
    if spec.kubelet.as_ref().is_some_and(|k| k.source.url.is_none()) {
        return Err(PlanError::Unsupported {
            field: "spec.kubelet.source",
            message: "this agent installs the kubelet from a url artifact only; packages come later".into(),
        });
    }
    if spec.etcd.is_some() {
        return Err(PlanError::Unsupported { field: "spec.etcd", message: "this agent does not manage etcd members yet".into() });
    }
    if !spec.scripts.is_empty() {
        return Err(PlanError::Unsupported { field: "spec.scripts", message: "this agent does not run scripts yet".into() });
    }
    if spec.container_runtime.as_ref().is_some_and(|r| r.source.package.is_none()) {
        return Err(PlanError::Unsupported {
            field: "spec.containerRuntime.source",
            message: "this agent installs containerd from a package only; url sources come later".into(),
        });
    }
    let mut steps = Vec::new();
    let mut kernel_changes = false;

    let sources_path = format!("/{SOURCES_FILE}");
    match render_sources(spec) {
        Some(content) if file_differs(observed, &sources_path, &content, 0o644) => {
            steps.push(Step {
                description: "write apt sources and update".into(),
                disruptive: false,
                action: Action::Repositories { content: Some(content) },
            });
        }
        // Repositories the spec no longer names must stop being sources.
        None if observed.files.contains_key(&sources_path) => {
            steps.push(Step {
                description: "remove keelson's apt sources and update".into(),
                disruptive: false,
                action: Action::Repositories { content: None },
            });
        }
        _ => {}
    }

    if let Some(os) = &spec.os {
        let install: Vec<Pin> = os
            .packages
            .iter()
            .filter(|p| observed.packages.get(p.name.as_str()).is_none_or(|i| !same_version(&i.version, p.version.as_str())))
            .map(|p| Pin { name: p.name.to_string(), version: p.version.to_string() })
            .collect();
        kernel_changes = install.iter().any(|p| p.name.starts_with("linux-image"));
        let all: Vec<String> = os.packages.iter().map(|p| p.name.to_string()).collect();
        if !install.is_empty() {
            let what = install.iter().map(|p| format!("{}={}", p.name, p.version)).collect::<Vec<_>>().join(" ");
            steps.push(Step { description: format!("install {what}"), disruptive: false, action: Action::Packages { install, hold: all } });
        } else {
            let unheld: Vec<String> = all.into_iter().filter(|n| observed.packages.get(n).is_some_and(|i| !i.held)).collect();
            if !unheld.is_empty() {
                steps.push(Step {
                    description: format!("hold {}", unheld.join(" ")),
                    disruptive: false,
                    action: Action::Hold { names: unheld },
                });
            }
        }
    }

    if let Some(rt) = &spec.container_runtime {
        let name = rt.source.package.as_ref().map(|p| p.to_string()).unwrap_or_default();
        let installed = observed.packages.get(&name);
        let package = match installed {
            Some(i) if same_version(&i.version, &rt.version) => None,
            _ => Some(Pin { name: name.clone(), version: rt.version.clone() }),
        };
        let wanted_config = render_containerd_config(rt.config.systemd_cgroup);
        let config = file_differs(observed, &format!("/{CONTAINERD_CONFIG}"), &wanted_config, 0o644).then_some(wanted_config);
        let unheld = installed.is_some_and(|i| !i.held) && package.is_none();
        if package.is_some() || config.is_some() {
            let description = match &package {
                Some(p) => format!("upgrade {} to {} and restart it", p.name, p.version),
                None => "configure containerd and restart it".into(),
            };
            let previous = installed.map(|i| i.version.clone());
            steps.push(Step { description, disruptive: true, action: Action::Runtime { name, package, config, previous } });
        } else if unheld {
            steps.push(Step { description: format!("hold {name}"), disruptive: false, action: Action::Hold { names: vec![name] } });
        }
    }

    if let Some(k) = &spec.kubelet {
        use crate::drivers::kubelet::{DROPIN, UNIT, UNIT_CONTENT, dropin_content};
        let systemd_cgroup = spec.container_runtime.as_ref().is_none_or(|r| r.config.systemd_cgroup);
        let version = k.version.to_string();
        let unit = file_differs(observed, UNIT, UNIT_CONTENT, 0o644).then(|| UNIT_CONTENT.to_owned());
        let dropin_wanted = dropin_content(systemd_cgroup);
        let dropin = file_differs(observed, DROPIN, &dropin_wanted, 0o644).then_some(dropin_wanted);
        let binary_differs = observed.kubelet_version.as_deref() != Some(version.as_str());
        let (url, sha256) = (
            k.source.url.as_ref().map(|u| u.to_string()).unwrap_or_default(),
            k.source.sha256.as_ref().map(|d| d.to_string()).unwrap_or_default(),
        );
        if binary_differs {
            steps.push(Step {
                description: format!("fetch kubelet {version}"),
                disruptive: false,
                action: Action::FetchArtifact { url, sha256: sha256.clone() },
            });
        }
        if binary_differs || unit.is_some() || dropin.is_some() {
            let description = if binary_differs {
                format!("install kubelet {version} and restart it")
            } else {
                "configure the kubelet and restart it".to_owned()
            };
            steps.push(Step {
                description,
                disruptive: true,
                action: Action::Kubelet { artifact: binary_differs.then_some(sha256), version, unit, dropin },
            });
        }
    }

    for f in &spec.files {
        if file_differs(observed, &f.path, &f.content, f.mode.0) {
            steps.push(Step {
                description: format!("write {}", f.path),
                disruptive: false,
                action: Action::WriteFile { path: f.path.clone(), content: f.content.clone(), mode: f.mode.0, owner: f.owner.clone() },
            });
        }
    }

    let policy = spec.os.as_ref().map(|o| o.reboot).unwrap_or_default();
    let reboot_reason = match policy {
        RebootPolicy::Never => None,
        RebootPolicy::Always if ctx.rebooted_for_generation != Some(ctx.generation) => Some("reboot: Always".to_owned()),
        _ if kernel_changes => Some("new kernel".to_owned()),
        _ if observed.boot_kernel.as_ref().is_some_and(|k| *k != observed.running_kernel) => {
            Some(format!("kernel {} installed, {} running", observed.boot_kernel.clone().unwrap_or_default(), observed.running_kernel))
        }
        _ if observed.reboot_required => Some("/run/reboot-required".to_owned()),
        _ => None,
    };
    if let Some(reason) = reboot_reason {
        steps.push(Step { description: format!("reboot ({reason})"), disruptive: true, action: Action::Reboot { reason } });
    }
    Ok(steps)
}

/// What the machine looks like after `steps` succeed: the planner's own model of each step,
/// used to check that a plan, once applied, leaves nothing to do.
pub fn apply_model(observed: &Observed, steps: &[Step]) -> Observed {
    let mut o = observed.clone();
    for s in steps {
        match &s.action {
            Action::Repositories { content: Some(content) } => {
                o.files
                    .insert(format!("/{SOURCES_FILE}"), crate::observe::FileState { sha256: sha256_hex(content.as_bytes()), mode: 0o644 });
            }
            Action::Repositories { content: None } => {
                o.files.remove(&format!("/{SOURCES_FILE}"));
            }
            Action::Packages { install, hold } => {
                for p in install {
                    o.packages.insert(p.name.clone(), crate::observe::Installed { version: p.version.clone(), held: false });
                }
                for n in hold {
                    if let Some(i) = o.packages.get_mut(n) {
                        i.held = true;
                    }
                }
            }
            Action::Hold { names } => {
                for n in names {
                    if let Some(i) = o.packages.get_mut(n) {
                        i.held = true;
                    }
                }
            }
            Action::Runtime { name, package, config, .. } => {
                if let Some(p) = package {
                    o.packages.insert(p.name.clone(), crate::observe::Installed { version: p.version.clone(), held: true });
                }
                // The step holds the runtime package whether or not it installed it.
                if let Some(i) = o.packages.get_mut(name) {
                    i.held = true;
                }
                if let Some(c) = config {
                    o.files.insert(
                        format!("/{CONTAINERD_CONFIG}"),
                        crate::observe::FileState { sha256: sha256_hex(c.as_bytes()), mode: 0o644 },
                    );
                }
            }
            Action::WriteFile { path, content, mode, .. } => {
                o.files.insert(path.clone(), crate::observe::FileState { sha256: sha256_hex(content.as_bytes()), mode: *mode });
            }
            Action::FetchArtifact { .. } => {}
            Action::Kubelet { version, unit, dropin, .. } => {
                o.kubelet_version = Some(version.clone());
                for (path, content) in [(crate::drivers::kubelet::UNIT, unit), (crate::drivers::kubelet::DROPIN, dropin)] {
                    if let Some(c) = content {
                        o.files.insert(path.to_owned(), crate::observe::FileState { sha256: sha256_hex(c.as_bytes()), mode: 0o644 });
                    }
                }
            }
            Action::Reboot { .. } => {
                o.reboot_required = false;
                if let Some(k) = &o.boot_kernel {
                    o.running_kernel = k.clone();
                }
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::{FileState, Installed};
    use keelson_api::machine::{ContainerRuntimeSpec, FileMode, FileSpec, OsSpec, PackagePin, RuntimeConfig, RuntimeName, Source};
    use proptest::prelude::*;

    fn pin(name: &str, version: &str) -> PackagePin {
        PackagePin { name: name.parse().unwrap_or_else(|e| panic!("{e}")), version: version.parse().unwrap_or_else(|e| panic!("{e}")) }
    }

    fn spec(pins: Vec<PackagePin>, runtime: Option<&str>, files: Vec<FileSpec>, reboot: RebootPolicy) -> MachineSpec {
        MachineSpec {
            os: Some(OsSpec { repositories: Vec::new(), packages: pins, reboot }),
            container_runtime: runtime.map(|v| ContainerRuntimeSpec {
                name: RuntimeName::Containerd,
                version: v.into(),
                source: Source { package: Some("containerd".parse().unwrap_or_else(|e| panic!("{e}"))), url: None, sha256: None },
                config: RuntimeConfig::default(),
            }),
            files,
            ..MachineSpec::default()
        }
    }

    fn machine() -> Observed {
        let mut o = Observed {
            running_kernel: "6.1.0-41-amd64".into(),
            boot_kernel: Some("6.1.0-41-amd64".into()),
            boot_id: "b1".into(),
            ..Observed::default()
        };
        o.packages.insert("containerd".into(), Installed { version: "1.6.20~ds1-1+deb12u2".into(), held: false });
        o.packages.insert("linux-image-amd64".into(), Installed { version: "6.1.176-1".into(), held: false });
        o
    }

    #[test]
    fn a_runtime_upgrade_is_one_disruptive_step() -> Result<(), PlanError> {
        let mut o = machine();
        o.files.insert(
            format!("/{CONTAINERD_CONFIG}"),
            FileState { sha256: sha256_hex(render_containerd_config(true).as_bytes()), mode: 0o644 },
        );
        let steps = plan(&spec(vec![], Some("1.6.20~ds1-1+deb12u3"), vec![], RebootPolicy::IfRequired), &o, &Context::default())?;
        assert_eq!(steps.len(), 1);
        assert!(steps[0].disruptive);
        assert_eq!(steps[0].description, "upgrade containerd to 1.6.20~ds1-1+deb12u3 and restart it");
        Ok(())
    }

    #[test]
    fn a_kernel_pin_brings_a_reboot_last() -> Result<(), PlanError> {
        let s = spec(vec![pin("linux-image-amd64", "6.1.192-3")], None, vec![], RebootPolicy::IfRequired);
        let steps = plan(&s, &machine(), &Context::default())?;
        let kinds: Vec<bool> = steps.iter().map(|s| s.disruptive).collect();
        assert_eq!(kinds, vec![false, true]);
        assert!(matches!(steps[1].action, Action::Reboot { .. }));
        let never = spec(vec![pin("linux-image-amd64", "6.1.192-3")], None, vec![], RebootPolicy::Never);
        assert_eq!(plan(&never, &machine(), &Context::default())?.len(), 1);
        Ok(())
    }

    #[test]
    fn dropped_repositories_are_removed() -> Result<(), PlanError> {
        let mut o = machine();
        o.files.insert(format!("/{SOURCES_FILE}"), FileState { sha256: sha256_hex(b"old"), mode: 0o644 });
        let steps = plan(&MachineSpec::default(), &o, &Context::default())?;
        assert_eq!(steps.iter().map(|s| s.action.clone()).collect::<Vec<_>>(), vec![Action::Repositories { content: None }]);
        assert!(plan(&MachineSpec::default(), &apply_model(&o, &steps), &Context::default())?.is_empty());
        Ok(())
    }

    #[test]
    fn a_booted_but_not_running_kernel_needs_a_reboot() -> Result<(), PlanError> {
        let mut o = machine();
        o.boot_kernel = Some("6.1.0-42-amd64".into());
        let steps = plan(&MachineSpec::default(), &o, &Context::default())?;
        assert!(matches!(steps.as_slice(), [Step { action: Action::Reboot { .. }, .. }]));
        Ok(())
    }

    #[test]
    fn unsupported_parts_are_refused_not_ignored() {
        let s: MachineSpec = serde_json::from_value(
            serde_json::json!({"roles": ["worker"], "kubelet": {"version": "1.30.1", "source": {"package": "kubelet"}}}),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(plan(&s, &machine(), &Context::default()), Err(PlanError::Unsupported { field: "spec.kubelet.source", .. })));
    }

    #[test]
    fn a_kubelet_upgrade_fetches_before_it_disrupts() -> Result<(), PlanError> {
        let s: MachineSpec = serde_json::from_value(serde_json::json!({"roles": ["worker"], "kubelet": {"version": "1.31.0", "source": {"url": "http://10.0.2.2/kubelet", "sha256": "a".repeat(64)}}}))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut o = machine();
        o.kubelet_version = Some("v1.30.4".into());
        let steps = plan(&s, &o, &Context::default())?;
        let shape: Vec<(bool, &str)> = steps.iter().map(|s| (s.disruptive, s.description.as_str())).collect();
        assert_eq!(shape, vec![(false, "fetch kubelet v1.31.0"), (true, "install kubelet v1.31.0 and restart it")]);
        let again = plan(&s, &apply_model(&o, &steps), &Context::default())?;
        assert!(again.is_empty(), "{again:?}");
        Ok(())
    }

    fn arb_version() -> impl Strategy<Value = String> {
        prop_oneof![Just("1.0-1".to_owned()), Just("1.0-2".to_owned()), Just("2.0-1".to_owned()), Just("1:0.9-1".to_owned())]
    }

    fn arb_observed() -> impl Strategy<Value = Observed> {
        (
            proptest::collection::btree_map("[a-d]", (arb_version(), any::<bool>()), 0..4),
            proptest::option::of((arb_version(), any::<bool>())),
            any::<bool>(),
            proptest::collection::btree_map("/etc/f[0-3]", ("[a-c]{0,3}", prop_oneof![Just(0o644u32), Just(0o600)]), 0..3),
        )
            .prop_map(|(pkgs, runtime, reboot_required, files)| Observed {
                packages: pkgs
                    .into_iter()
                    .map(|(n, (v, held))| (format!("pkg-{n}"), Installed { version: v, held }))
                    .chain(runtime.map(|(v, held)| ("containerd".to_owned(), Installed { version: v, held })))
                    .collect(),
                running_kernel: "k1".into(),
                boot_kernel: Some("k1".into()),
                reboot_required,
                boot_id: "b".into(),
                files: files.into_iter().map(|(p, (c, m))| (p, FileState { sha256: sha256_hex(c.as_bytes()), mode: m })).collect(),
                kubelet_version: None,
            })
    }

    fn arb_spec() -> impl Strategy<Value = MachineSpec> {
        (
            proptest::collection::btree_map("[a-d]", arb_version(), 0..4),
            proptest::option::of(arb_version()),
            proptest::collection::btree_map("/etc/f[0-3]", ("[a-c]{0,3}", prop_oneof![Just(0o644u32), Just(0o600)]), 0..3),
            prop_oneof![Just(RebootPolicy::Never), Just(RebootPolicy::IfRequired)],
        )
            .prop_map(|(pins, runtime, files, reboot)| {
                let pins = pins.into_iter().map(|(n, v)| pin(&format!("pkg-{n}"), &v)).collect();
                let files = files
                    .into_iter()
                    .map(|(path, (content, mode))| FileSpec { path, content, mode: FileMode(mode), owner: None })
                    .collect();
                spec(pins, runtime.as_deref(), files, reboot)
            })
    }

    proptest! {
        #[test]
        fn applying_a_plan_then_planning_again_gives_nothing(s in arb_spec(), o in arb_observed()) {
            let ctx = Context::default();
            let steps = plan(&s, &o, &ctx).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let after = apply_model(&o, &steps);
            let again = plan(&s, &after, &ctx).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(again.is_empty(), "left over: {:?}", again);
        }

        #[test]
        fn an_up_to_date_machine_has_an_empty_plan(s in arb_spec(), o in arb_observed()) {
            // A machine built to match the spec directly, not through the planner's model.
            let mut m = o;
            m.reboot_required = false;
            if let Some(os) = &s.os {
                for p in &os.packages {
                    m.packages.insert(p.name.to_string(), Installed { version: p.version.to_string(), held: true });
                }
            }
            if let Some(rt) = &s.container_runtime {
                m.packages.insert("containerd".into(), Installed { version: rt.version.clone(), held: true });
                let config = render_containerd_config(rt.config.systemd_cgroup);
                m.files.insert(format!("/{CONTAINERD_CONFIG}"), FileState { sha256: sha256_hex(config.as_bytes()), mode: 0o644 });
            }
            for f in &s.files {
                m.files.insert(f.path.clone(), FileState { sha256: sha256_hex(f.content.as_bytes()), mode: f.mode.0 });
            }
            prop_assert_eq!(plan(&s, &m, &Context::default()).map_err(|e| TestCaseError::fail(e.to_string()))?, Vec::<Step>::new());
        }
    }
}
