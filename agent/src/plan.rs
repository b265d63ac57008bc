//! The planner: a pure function from the desired spec and the observed machine to an ordered
//! list of idempotent steps, each marked disruptive or not. It never touches the machine.
//!
//! The order: preUpgrade scripts → repositories → OS packages → container runtime → kubeadm
//! (and the node's upgrade with it) → kubelet →
//! etcd member → files → bootstrap scripts → reboot → postUpgrade scripts. preUpgrade and postUpgrade
//! scripts run only when something else changes, so an up-to-date machine has an empty plan;
//! a bootstrap script runs once per machine (the ledger remembers it by name).

use std::collections::BTreeMap;

use keelson_api::machine::{KubeadmSpec, MachineSpec, RebootPolicy, Repository, ScriptSpec, ScriptWhen};
use serde::{Deserialize, Serialize};

use crate::observe::{CONTAINERD_CONFIG, Observed, sha256_hex};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum Action {
    /// Write the managed repositories (or remove them, `None`) and refresh the package lists.
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
    /// Install the runtime (a package, or the binaries of a cached release tarball) and/or
    /// write its configuration and unit, restart it, check it; roll back when it is unhealthy.
    Runtime {
        name: String,
        /// From a release tarball, not a package: nothing to hold.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        tarball: bool,
        package: Option<Pin>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        artifact: Option<RuntimeArtifact>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unit: Option<String>,
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
    /// With `package`, the kubelet comes from that package (the version whose upstream part
    /// is `version`), with the package's own unit; `previous_package` is what to go back to.
    Kubelet {
        artifact: Option<String>,
        version: String,
        unit: Option<String>,
        dropin: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        package: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        previous_package: Option<String>,
    },
    /// Install kubeadm: from `package` (the version whose upstream part is `version`, then
    /// held), or the cached `artifact` (its previous binary kept, put back when the new one is
    /// not `version`). Disrupts nothing: kubeadm does nothing until it is run.
    KubeadmInstall {
        version: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        package: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        artifact: Option<String>,
    },
    /// Upgrade this node with kubeadm to `version`: `kubeadm upgrade apply` or `kubeadm upgrade
    /// node`, as the controller's lease says (a worker without the controller's word: node).
    KubeadmUpgrade {
        version: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        control_plane: bool,
    },
    /// Run an operator's script; a bootstrap script is recorded in the ledger once it succeeds.
    Script {
        name: String,
        when: ScriptWhen,
        run: Vec<String>,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        env: BTreeMap<String, String>,
        timeout_seconds: u32,
    },
    /// This machine's etcd member: install the binary (`package` or the cached tarball
    /// `artifact`), write the unit and settings, then join the cluster (`join`: no member data
    /// here yet) or restart the member carefully (all healthy, snapshot, leadership away) and
    /// wait until it serves `version` and has caught up.
    Etcd {
        cluster: String,
        version: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        package: Option<String>,
        /// The package version installed before (to go back to when `version` fails).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        previous_package: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        artifact: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unit: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        env: Option<String>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        join: bool,
    },
    /// Reboot, and after boot check that `expected_kernel` (when known) is running.
    Reboot {
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeArtifact {
    pub sha256: String,
    pub version: String,
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
    /// This machine's name (an etcd member is named after it).
    pub name: String,
    /// The address an etcd member advertises to its peers and clients.
    pub etcd_address: Option<std::net::IpAddr>,
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
pub fn render_sources(repos: &[Repository]) -> String {
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
    out
}

/// containerd's configuration for the spec: CRI with the runc runtime, and the cgroup driver
/// that must match the kubelet's.
pub fn render_containerd_config(systemd_cgroup: bool) -> String {
    format!(
        "# Managed by keelson-agent: changes are overwritten.\nversion = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n  SystemdCgroup = {systemd_cgroup}\n"
    )
}

fn file_differs(observed: &Observed, path: &str, content: &str, mode: u32) -> bool {
    observed.files.get(path).is_none_or(|f| f.sha256 != sha256_hex(content.as_bytes()) || f.mode != mode)
}

pub fn plan(spec: &MachineSpec, observed: &Observed, ctx: &Context) -> Result<Vec<Step>, PlanError> {
    let mut steps = Vec::new();
    let mut kernel_changes = false;

    let pm = observed.package_manager;
    let same_version = |installed: &str, wanted: &str| pm.same_version(installed, wanted);
    let sources_path = format!("/{}", pm.sources_file());
    match pm.render_sources(spec) {
        Some(content) if file_differs(observed, &sources_path, &content, 0o644) => {
            steps.push(Step {
                description: "write the managed repositories and refresh the package lists".into(),
                disruptive: false,
                action: Action::Repositories { content: Some(content) },
            });
        }
        // Repositories the spec no longer names must stop being sources.
        None if observed.files.contains_key(&sources_path) => {
            steps.push(Step {
                description: "remove the managed repositories and refresh the package lists".into(),
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
        kernel_changes = install.iter().any(|p| pm.is_kernel(&p.name));
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
        let wanted_config = render_containerd_config(rt.config.systemd_cgroup);
        let config = file_differs(observed, &format!("/{CONTAINERD_CONFIG}"), &wanted_config, 0o644).then_some(wanted_config);
        match (&rt.source.package, &rt.source.url, &rt.source.sha256) {
            (_, Some(url), Some(sha256)) => {
                use crate::drivers::containerd::{UNIT, UNIT_CONTENT};
                let sha256 = sha256.to_string();
                let binaries_differ = observed.runtime_artifact.as_deref() != Some(sha256.as_str());
                let unit = file_differs(observed, UNIT, UNIT_CONTENT, 0o644).then(|| UNIT_CONTENT.to_owned());
                if binaries_differ {
                    steps.push(Step {
                        description: format!("fetch containerd {}", rt.version),
                        disruptive: false,
                        action: Action::FetchArtifact { url: url.to_string(), sha256: sha256.clone() },
                    });
                }
                if binaries_differ || unit.is_some() || config.is_some() {
                    let description = if binaries_differ {
                        format!("install containerd {} from its release tarball and restart it", rt.version)
                    } else {
                        "configure containerd and restart it".to_owned()
                    };
                    let artifact = binaries_differ.then(|| RuntimeArtifact { sha256, version: rt.version.clone() });
                    steps.push(Step {
                        description,
                        disruptive: true,
                        action: Action::Runtime {
                            name: "containerd".into(),
                            tarball: true,
                            package: None,
                            artifact,
                            unit,
                            config,
                            previous: None,
                        },
                    });
                }
            }
            (Some(package), _, _) => {
                let name = package.to_string();
                let installed = observed.packages.get(&name);
                let package = match installed {
                    Some(i) if same_version(&i.version, &rt.version) => None,
                    _ => Some(Pin { name: name.clone(), version: rt.version.clone() }),
                };
                let unheld = installed.is_some_and(|i| !i.held) && package.is_none();
                if package.is_some() || config.is_some() {
                    let description = match &package {
                        Some(p) => format!("upgrade {} to {} and restart it", p.name, p.version),
                        None => "configure containerd and restart it".into(),
                    };
                    let previous = installed.map(|i| i.version.clone());
                    steps.push(Step {
                        description,
                        disruptive: true,
                        action: Action::Runtime { name, tarball: false, package, artifact: None, unit: None, config, previous },
                    });
                } else if unheld {
                    steps.push(Step { description: format!("hold {name}"), disruptive: false, action: Action::Hold { names: vec![name] } });
                }
            }
            // Validation requires a package or a url with its digest.
            _ => {
                return Err(PlanError::Unsupported {
                    field: "spec.containerRuntime.source",
                    message: "needs a package, or a url with its sha256".into(),
                });
            }
        }
    }

    if let Some(k) = &spec.kubeadm {
        kubeadm_steps(&mut steps, k, spec.roles.contains(&keelson_api::machine::Role::ControlPlane), observed);
    }

    if let Some(k) = &spec.kubelet {
        let version = k.version.to_string();
        let binary_differs = observed.kubelet_version.as_deref() != Some(version.as_str());
        // A machine without a kubelet runs no pods: its first kubelet disrupts nothing, and
        // takes no lease (fresh machines of a pool, none Ready yet, would each count the others
        // against the budget and wait for ever).
        let kubelet_runs = observed.kubelet_version.is_some();
        if let Some(package) = &k.source.package {
            let name = package.to_string();
            let installed = observed.packages.get(&name);
            if binary_differs {
                steps.push(Step {
                    description: format!("install kubelet {version} from package {name} and restart it"),
                    disruptive: kubelet_runs,
                    action: Action::Kubelet {
                        artifact: None,
                        version,
                        unit: None,
                        dropin: None,
                        package: Some(name),
                        previous_package: installed.map(|i| i.version.clone()),
                    },
                });
            } else if installed.is_some_and(|i| !i.held) {
                steps.push(Step { description: format!("hold {name}"), disruptive: false, action: Action::Hold { names: vec![name] } });
            }
        } else {
            use crate::drivers::kubelet::{DROPIN, UNIT, UNIT_CONTENT, dropin_content};
            let systemd_cgroup = spec.container_runtime.as_ref().is_none_or(|r| r.config.systemd_cgroup);
            let unit = file_differs(observed, UNIT, UNIT_CONTENT, 0o644).then(|| UNIT_CONTENT.to_owned());
            let dropin_wanted = dropin_content(systemd_cgroup);
            let dropin = file_differs(observed, DROPIN, &dropin_wanted, 0o644).then_some(dropin_wanted);
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
                    disruptive: kubelet_runs,
                    action: Action::Kubelet {
                        artifact: binary_differs.then_some(sha256),
                        version,
                        unit,
                        dropin,
                        package: None,
                        previous_package: None,
                    },
                });
            }
        }
    }

    if let Some(e) = &spec.etcd {
        use crate::drivers::etcd as host;
        let Some(address) = ctx.etcd_address else {
            return Err(PlanError::Unsupported {
                field: "spec.etcd",
                message: "this machine has no address to advertise to etcd peers: set etcd_advertise_address in the agent's configuration"
                    .into(),
            });
        };
        let tarball = e.source.url.is_some();
        let version = e.version.trim_start_matches('v').to_owned();
        let binary_differs = observed.etcd_version.as_deref() != Some(version.as_str());
        let unit_wanted = host::unit_content(host::binary(tarball));
        let unit = file_differs(observed, host::UNIT, &unit_wanted, 0o644).then_some(unit_wanted);
        let env_wanted = host::env_content(&ctx.name, address, e.cluster.as_str());
        let env = file_differs(observed, host::ENV_FILE, &env_wanted, 0o644).then_some(env_wanted);
        let join = !observed.etcd_member;
        let sha256 = e.source.sha256.as_ref().map(|d| d.to_string());
        if let (true, true, Some(url), Some(sha)) = (tarball, binary_differs, &e.source.url, &sha256) {
            steps.push(Step {
                description: format!("fetch etcd {version}"),
                disruptive: false,
                action: Action::FetchArtifact { url: url.to_string(), sha256: sha.clone() },
            });
        }
        // A renewed certificate is taken up by a careful restart: etcd does not reliably
        // re-read its files for peers that connect by IP address.
        let renew = observed.etcd_certificate_due.as_ref().filter(|_| !join);
        if binary_differs || unit.is_some() || env.is_some() || join || renew.is_some() {
            let description = if join {
                format!("join etcd cluster {} with etcd {version}", e.cluster)
            } else if binary_differs {
                format!("upgrade the etcd member to {version}")
            } else if let (Some(why), None, None) = (renew, &unit, &env) {
                format!("renew the etcd member certificate ({why}) and restart the member")
            } else {
                "reconfigure the etcd member and restart it".to_owned()
            };
            steps.push(Step {
                description,
                disruptive: true,
                action: Action::Etcd {
                    cluster: e.cluster.to_string(),
                    version,
                    package: e.source.package.as_ref().filter(|_| binary_differs).map(|p| p.to_string()),
                    previous_package: e
                        .source
                        .package
                        .as_ref()
                        .filter(|_| binary_differs && !join)
                        .and_then(|p| observed.packages.get(p.as_str()))
                        .map(|i| i.version.clone()),
                    artifact: sha256.filter(|_| tarball && binary_differs),
                    unit,
                    env,
                    join,
                },
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
    let changes = !steps.is_empty() || reboot_reason.is_some();
    let scripts = |when: ScriptWhen| spec.scripts.iter().filter(move |s| s.when == when);
    if changes {
        let pre: Vec<Step> = scripts(ScriptWhen::PreUpgrade).map(script_step).collect();
        steps.splice(0..0, pre);
    }
    steps.extend(scripts(ScriptWhen::Bootstrap).filter(|s| !observed.bootstrapped.contains(s.name.as_str())).map(script_step));
    if let Some(reason) = reboot_reason {
        steps.push(Step { description: format!("reboot ({reason})"), disruptive: true, action: Action::Reboot { reason } });
    }
    if changes {
        steps.extend(scripts(ScriptWhen::PostUpgrade).map(script_step));
    }
    Ok(steps)
}

/// kubeadm at the spec's version, then — on a node that has joined its cluster and is not
/// there yet — the node upgraded with it, before the kubelet step (kubeadm's own order).
fn kubeadm_steps(steps: &mut Vec<Step>, k: &KubeadmSpec, control_plane: bool, observed: &Observed) {
    let version = k.version.to_string();
    if observed.kubeadm_version.as_deref() != Some(version.as_str()) {
        match &k.source.package {
            Some(package) => steps.push(Step {
                description: format!("install kubeadm {version} from package {package}"),
                disruptive: false,
                action: Action::KubeadmInstall { version: version.clone(), package: Some(package.to_string()), artifact: None },
            }),
            None => {
                let url = k.source.url.as_ref().map(|u| u.to_string()).unwrap_or_default();
                let sha256 = k.source.sha256.as_ref().map(|d| d.to_string()).unwrap_or_default();
                steps.push(Step {
                    description: format!("fetch kubeadm {version}"),
                    disruptive: false,
                    action: Action::FetchArtifact { url, sha256: sha256.clone() },
                });
                steps.push(Step {
                    description: format!("install kubeadm {version}"),
                    disruptive: false,
                    action: Action::KubeadmInstall { version: version.clone(), package: None, artifact: Some(sha256) },
                });
            }
        }
    } else if let Some(name) = k.source.package.as_ref().map(|p| p.to_string())
        && observed.packages.get(&name).is_some_and(|i| !i.held)
    {
        steps.push(Step { description: format!("hold {name}"), disruptive: false, action: Action::Hold { names: vec![name] } });
    }
    if observed.kubeadm_node.as_deref().is_some_and(|at| at != version) {
        steps.push(Step {
            description: format!("upgrade the node with kubeadm {version}"),
            disruptive: true,
            action: Action::KubeadmUpgrade { version, control_plane },
        });
    }
}

fn script_step(s: &ScriptSpec) -> Step {
    let when = match s.when {
        ScriptWhen::PreUpgrade => "preUpgrade",
        ScriptWhen::PostUpgrade => "postUpgrade",
        ScriptWhen::Bootstrap => "bootstrap",
    };
    Step {
        description: format!("run {when} script {}", s.name),
        disruptive: false,
        action: Action::Script {
            name: s.name.to_string(),
            when: s.when,
            run: s.run.clone(),
            env: s.env.clone(),
            timeout_seconds: s.timeout_seconds,
        },
    }
}

/// What the machine looks like after `steps` succeed: the planner's own model of each step,
/// used to check that a plan, once applied, leaves nothing to do.
pub fn apply_model(observed: &Observed, steps: &[Step]) -> Observed {
    let mut o = observed.clone();
    for s in steps {
        match &s.action {
            Action::Repositories { content: Some(content) } => {
                let path = format!("/{}", o.package_manager.sources_file());
                o.files.insert(path, crate::observe::FileState { sha256: sha256_hex(content.as_bytes()), mode: 0o644 });
            }
            Action::Repositories { content: None } => {
                o.files.remove(&format!("/{}", o.package_manager.sources_file()));
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
            Action::Etcd { version, unit, env, .. } => {
                use crate::drivers::etcd as host;
                o.etcd_version = Some(version.clone());
                o.etcd_member = true;
                o.etcd_certificate_due = None;
                for (path, content) in [(host::UNIT, unit), (host::ENV_FILE, env)] {
                    if let Some(c) = content {
                        o.files.insert(path.to_owned(), crate::observe::FileState { sha256: sha256_hex(c.as_bytes()), mode: 0o644 });
                    }
                }
            }
            Action::Runtime { name, tarball, package, artifact, unit, config, .. } => {
                if let Some(p) = package {
                    o.packages.insert(p.name.clone(), crate::observe::Installed { version: p.version.clone(), held: true });
                }
                if let Some(a) = artifact {
                    o.runtime_artifact = Some(a.sha256.clone());
                }
                // The step holds the runtime package whether or not it installed it.
                if !tarball && let Some(i) = o.packages.get_mut(name) {
                    i.held = true;
                }
                if let Some(u) = unit {
                    o.files.insert(
                        crate::drivers::containerd::UNIT.to_owned(),
                        crate::observe::FileState { sha256: sha256_hex(u.as_bytes()), mode: 0o644 },
                    );
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
            Action::Kubelet { version, unit, dropin, package, .. } => {
                o.kubelet_version = Some(version.clone());
                if let Some(p) = package {
                    model_release_package(&mut o, p, version);
                }
                for (path, content) in [(crate::drivers::kubelet::UNIT, unit), (crate::drivers::kubelet::DROPIN, dropin)] {
                    if let Some(c) = content {
                        o.files.insert(path.to_owned(), crate::observe::FileState { sha256: sha256_hex(c.as_bytes()), mode: 0o644 });
                    }
                }
            }
            Action::KubeadmInstall { version, package, .. } => {
                o.kubeadm_version = Some(version.clone());
                if let Some(p) = package {
                    model_release_package(&mut o, p, version);
                }
            }
            Action::KubeadmUpgrade { version, .. } => {
                if o.kubeadm_node.is_some() {
                    o.kubeadm_node = Some(version.clone());
                }
            }
            Action::Script { name, when: ScriptWhen::Bootstrap, .. } => {
                o.bootstrapped.insert(name.clone());
            }
            Action::Script { .. } => {}
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

/// A package installed as a component's release: the exact version is chosen when the step
/// runs, so only its presence and hold matter to the model.
fn model_release_package(o: &mut Observed, package: &str, version: &str) {
    o.packages.entry(package.to_owned()).or_insert_with(|| crate::observe::Installed { version: version.to_owned(), held: true }).held =
        true;
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
        o.files.insert(format!("/{}", crate::observe::SOURCES_FILE), FileState { sha256: sha256_hex(b"old"), mode: 0o644 });
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

    fn spec_from(v: serde_json::Value) -> MachineSpec {
        serde_json::from_value(v).unwrap_or_else(|e| panic!("{e}"))
    }

    fn shape(steps: &[Step]) -> Vec<(bool, &str)> {
        steps.iter().map(|s| (s.disruptive, s.description.as_str())).collect()
    }

    #[test]
    fn an_etcd_member_without_an_address_is_refused_not_guessed() {
        let s = spec_from(
            serde_json::json!({"roles": ["etcd"], "etcd": {"cluster": "main", "version": "3.5.1", "source": {"package": "etcd-server"}}}),
        );
        assert!(matches!(plan(&s, &machine(), &Context::default()), Err(PlanError::Unsupported { field: "spec.etcd", .. })));
    }

    #[test]
    fn an_etcd_member_joins_once_then_upgrades_in_one_careful_step() -> Result<(), PlanError> {
        let sha = "a".repeat(64);
        let tarball = |version: &str| {
            spec_from(serde_json::json!({"roles": ["etcd"], "etcd": {"cluster": "main", "version": version,
                "source": {"url": format!("https://artifacts.example/etcd-v{version}-linux-amd64.tar.gz"), "sha256": sha}}}))
        };
        let ctx = Context { name: "etcd-1".into(), etcd_address: Some([192, 168, 77, 11].into()), ..Context::default() };
        let fresh = machine();
        let s = tarball("3.4.23");
        let steps = plan(&s, &fresh, &ctx)?;
        assert_eq!(shape(&steps), vec![(false, "fetch etcd 3.4.23"), (true, "join etcd cluster main with etcd 3.4.23")]);
        assert!(matches!(&steps[1].action, Action::Etcd { join: true, artifact: Some(_), unit: Some(_), env: Some(_), .. }));
        let member = apply_model(&fresh, &steps);
        assert!(plan(&s, &member, &ctx)?.is_empty());
        // A new version: fetched, then one disruptive step that restarts the member (no join).
        let steps = plan(&tarball("3.5.1"), &member, &ctx)?;
        assert_eq!(shape(&steps), vec![(false, "fetch etcd 3.5.1"), (true, "upgrade the etcd member to 3.5.1")]);
        assert!(matches!(&steps[1].action, Action::Etcd { join: false, unit: None, env: None, .. }));
        // A changed address rewrites the settings and restarts the member.
        let moved = Context { etcd_address: Some([192, 168, 77, 12].into()), ..ctx.clone() };
        assert_eq!(shape(&plan(&s, &member, &moved)?), vec![(true, "reconfigure the etcd member and restart it")]);
        // A certificate near its end: renewed, taken up by a careful restart.
        let due = Observed { etcd_certificate_due: Some("the member certificate ends 2027-01-02".into()), ..member.clone() };
        assert_eq!(
            shape(&plan(&s, &due, &ctx)?),
            vec![(true, "renew the etcd member certificate (the member certificate ends 2027-01-02) and restart the member")]
        );
        // A member whose data is gone joins again.
        let wiped = Observed { etcd_member: false, ..member };
        assert_eq!(shape(&plan(&s, &wiped, &ctx)?), vec![(true, "join etcd cluster main with etcd 3.4.23")]);
        Ok(())
    }

    #[test]
    fn an_etcd_package_upgrade_remembers_the_package_to_go_back_to() -> Result<(), PlanError> {
        let package = |version: &str| {
            spec_from(serde_json::json!({"roles": ["etcd"], "etcd": {"cluster": "main", "version": version,
                "source": {"package": "etcd-server"}}}))
        };
        let ctx = Context { name: "etcd-1".into(), etcd_address: Some([192, 168, 77, 11].into()), ..Context::default() };
        let steps = plan(&package("3.4.23"), &machine(), &ctx)?;
        assert!(
            matches!(&steps[0].action, Action::Etcd { join: true, previous_package: None, .. }),
            "a join has nothing to go back to: {steps:?}"
        );
        let mut member = apply_model(&machine(), &steps);
        member.packages.insert("etcd-server".into(), Installed { version: "3.4.23-4+b4".into(), held: true });
        let steps = plan(&package("3.5.1"), &member, &ctx)?;
        let Action::Etcd { package, previous_package, join: false, .. } = &steps[0].action else { panic!("{steps:?}") };
        assert_eq!((package.as_deref(), previous_package.as_deref()), (Some("etcd-server"), Some("3.4.23-4+b4")));
        Ok(())
    }

    #[test]
    fn scripts_wrap_changes_and_bootstrap_runs_once() -> Result<(), PlanError> {
        let s = spec_from(serde_json::json!({
            "os": {"packages": [{"name": "linux-image-amd64", "version": "6.1.192-3"}]},
            "scripts": [
                {"name": "post", "when": "postUpgrade", "run": ["/bin/true"]},
                {"name": "first", "when": "bootstrap", "run": ["/bin/true"]},
                {"name": "pre", "when": "preUpgrade", "run": ["/bin/true"]},
            ],
        }));
        let steps = plan(&s, &machine(), &Context::default())?;
        assert_eq!(
            shape(&steps),
            vec![
                (false, "run preUpgrade script pre"),
                (false, "install linux-image-amd64=6.1.192-3"),
                (false, "run bootstrap script first"),
                (true, "reboot (new kernel)"),
                (false, "run postUpgrade script post"),
            ]
        );
        let after = apply_model(&machine(), &steps);
        assert!(after.bootstrapped.contains("first"));
        // Up to date: neither the bootstrap script again nor the upgrade scripts.
        let mut done = after.clone();
        done.running_kernel = "6.1.0-41-amd64".into();
        assert!(plan(&s, &done, &Context::default())?.is_empty());
        // Nothing to upgrade but a bootstrap script not yet run: only that.
        let mut fresh = done;
        fresh.bootstrapped.clear();
        assert_eq!(shape(&plan(&s, &fresh, &Context::default())?), vec![(false, "run bootstrap script first")]);
        Ok(())
    }

    #[test]
    fn the_rhel_family_plans_with_rpm_versions_a_repo_file_and_versionlock() -> Result<(), PlanError> {
        use crate::drivers::packages::Manager;
        let s = spec_from(serde_json::json!({"os": {
            "repositories": [{"name": "baseos", "uris": ["https://mirror.example/9/BaseOS/"], "signedBy": "/etc/pki/rpm-gpg/KEY"}],
            "packages": [{"name": "kernel-core", "version": "5.14.0-427.13.1.el9_4"}, {"name": "containerd.io", "version": "1.7.22-3.1.el9"}],
        }}));
        let mut o = Observed { package_manager: Manager::Dnf, running_kernel: "5.14.0-362.8.1.el9_3.x86_64".into(), ..Observed::default() };
        // rpm reports the epoch; the pin leaves it out: the same version, only the lock is missing.
        o.packages.insert("containerd.io".into(), Installed { version: "0:1.7.22-3.1.el9".into(), held: false });
        o.packages.insert("kernel-core".into(), Installed { version: "0:5.14.0-362.8.1.el9_3".into(), held: true });
        let steps = plan(&s, &o, &Context::default())?;
        assert_eq!(
            shape(&steps),
            vec![
                (false, "write the managed repositories and refresh the package lists"),
                (false, "install kernel-core=5.14.0-427.13.1.el9_4"),
                (true, "reboot (new kernel)"),
            ]
        );
        let Action::Repositories { content: Some(repo) } = &steps[0].action else { panic!("{:?}", steps[0]) };
        assert!(repo.contains("[keelson-baseos]\nname=baseos\nbaseurl=https://mirror.example/9/BaseOS/\n"), "{repo}");
        let after = apply_model(&o, &steps);
        assert!(after.files.contains_key("/etc/yum.repos.d/keelson.repo"));
        assert!(after.packages["containerd.io"].held, "every pin is locked after the install");
        Ok(())
    }

    #[test]
    fn containerd_from_a_tarball_fetches_installs_and_then_rests() -> Result<(), PlanError> {
        let sha = "c".repeat(64);
        let s = spec_from(serde_json::json!({"containerRuntime": {"name": "containerd", "version": "1.7.22",
            "source": {"url": "https://mirror.example/containerd-1.7.22-linux-amd64.tar.gz", "sha256": sha}}}));
        let steps = plan(&s, &machine(), &Context::default())?;
        assert_eq!(
            shape(&steps),
            vec![(false, "fetch containerd 1.7.22"), (true, "install containerd 1.7.22 from its release tarball and restart it")]
        );
        let Action::Runtime { tarball, artifact, unit, .. } = &steps[1].action else { panic!("{:?}", steps[1]) };
        assert!(*tarball && unit.is_some());
        assert_eq!(artifact.as_ref().map(|a| a.sha256.as_str()), Some(sha.as_str()));
        let after = apply_model(&machine(), &steps);
        assert!(!after.packages["containerd"].held, "a tarball install leaves the package alone");
        assert!(plan(&s, &after, &Context::default())?.is_empty());
        // The binaries replaced by hand: the ledger no longer vouches for them.
        let mut drifted = after;
        drifted.runtime_artifact = None;
        assert_eq!(plan(&s, &drifted, &Context::default())?.len(), 2);
        Ok(())
    }

    #[test]
    fn a_kubelet_package_is_installed_held_and_restarted() -> Result<(), PlanError> {
        let s = spec_from(serde_json::json!({"roles": ["worker"], "kubelet": {"version": "1.31.0", "source": {"package": "kubelet"}}}));
        let mut o = machine();
        o.kubelet_version = Some("v1.30.4".into());
        o.packages.insert("kubelet".into(), Installed { version: "1.30.4-1.1".into(), held: true });
        let steps = plan(&s, &o, &Context::default())?;
        assert_eq!(shape(&steps), vec![(true, "install kubelet v1.31.0 from package kubelet and restart it")]);
        let Action::Kubelet { previous_package, unit, .. } = &steps[0].action else { panic!("{:?}", steps[0]) };
        assert_eq!((previous_package.as_deref(), unit.as_deref()), (Some("1.30.4-1.1"), None));
        assert!(plan(&s, &apply_model(&o, &steps), &Context::default())?.is_empty());
        // The right version, but someone unheld it.
        let mut unheld = apply_model(&o, &steps);
        unheld.packages.insert("kubelet".into(), Installed { version: "1.31.0-1.1".into(), held: false });
        assert_eq!(shape(&plan(&s, &unheld, &Context::default())?), vec![(false, "hold kubelet")]);
        Ok(())
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
        // The first kubelet of a machine disrupts nothing.
        let fresh = plan(&s, &machine(), &Context::default())?;
        let shape: Vec<(bool, &str)> = fresh.iter().map(|s| (s.disruptive, s.description.as_str())).collect();
        assert_eq!(shape, vec![(false, "fetch kubelet v1.31.0"), (false, "install kubelet v1.31.0 and restart it")]);
        Ok(())
    }

    #[test]
    fn kubeadm_is_installed_then_upgrades_a_joined_node_before_the_kubelet() -> Result<(), PlanError> {
        let s = spec_from(serde_json::json!({"roles": ["worker"],
            "kubeadm": {"version": "1.31.2", "source": {"package": "kubeadm"}},
            "kubelet": {"version": "1.31.2", "source": {"package": "kubelet"}}}));
        let mut o = machine();
        o.kubelet_version = Some("v1.30.4".into());
        o.packages.insert("kubelet".into(), Installed { version: "1.30.4-1.1".into(), held: true });
        o.kubeadm_version = Some("v1.30.4".into());
        o.kubeadm_node = Some("v1.30.4".into());
        assert_eq!(
            shape(&plan(&s, &o, &Context::default())?),
            vec![
                (false, "install kubeadm v1.31.2 from package kubeadm"),
                (true, "upgrade the node with kubeadm v1.31.2"),
                (true, "install kubelet v1.31.2 from package kubelet and restart it"),
            ]
        );
        // A node that has not joined a cluster: kubeadm installed, nothing to upgrade.
        o.kubeadm_node = None;
        assert_eq!(shape(&plan(&s, &o, &Context::default())?)[..1], [(false, "install kubeadm v1.31.2 from package kubeadm")]);
        assert_eq!(plan(&s, &o, &Context::default())?.len(), 2);
        // Upgraded already: only the kubelet is left.
        o.kubeadm_version = Some("v1.31.2".into());
        o.packages.insert("kubeadm".into(), Installed { version: "1.31.2-1.1".into(), held: true });
        o.kubeadm_node = Some("v1.31.2".into());
        assert_eq!(shape(&plan(&s, &o, &Context::default())?), vec![(true, "install kubelet v1.31.2 from package kubelet and restart it")]);
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
            proptest::collection::btree_set("s[0-2]", 0..3),
            proptest::option::of(prop_oneof![Just("a".repeat(64)), Just("b".repeat(64))]),
        )
            .prop_map(|(pkgs, runtime, reboot_required, files, bootstrapped, runtime_artifact)| Observed {
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
                kubeadm_version: None,
                kubeadm_node: None,
                bootstrapped,
                runtime_artifact,
                etcd_version: None,
                etcd_member: false,
                etcd_certificate_due: None,
                package_manager: Default::default(),
            })
    }

    fn arb_script() -> impl Strategy<Value = ScriptSpec> {
        ("s[0-2]", prop_oneof![Just(ScriptWhen::PreUpgrade), Just(ScriptWhen::PostUpgrade), Just(ScriptWhen::Bootstrap)]).prop_map(
            |(name, when)| ScriptSpec {
                name: name.parse().unwrap_or_else(|e| panic!("{e}")),
                when,
                run: vec!["/bin/true".into()],
                timeout_seconds: 60,
                env: BTreeMap::new(),
            },
        )
    }

    fn arb_spec() -> impl Strategy<Value = MachineSpec> {
        (
            proptest::collection::btree_map("[a-d]", arb_version(), 0..4),
            proptest::option::of(arb_version()),
            proptest::collection::btree_map("/etc/f[0-3]", ("[a-c]{0,3}", prop_oneof![Just(0o644u32), Just(0o600)]), 0..3),
            prop_oneof![Just(RebootPolicy::Never), Just(RebootPolicy::IfRequired)],
            proptest::collection::btree_map("s[0-2]", arb_script(), 0..3),
            proptest::option::of(prop_oneof![Just("a".repeat(64)), Just("b".repeat(64))]),
        )
            .prop_map(|(pins, runtime, files, reboot, scripts, tarball)| {
                let pins = pins.into_iter().map(|(n, v)| pin(&format!("pkg-{n}"), &v)).collect();
                let files = files
                    .into_iter()
                    .map(|(path, (content, mode))| FileSpec { path, content, mode: FileMode(mode), owner: None })
                    .collect();
                let mut s = spec(pins, runtime.as_deref(), files, reboot);
                // Unique names, as validation requires.
                s.scripts = scripts
                    .into_iter()
                    .map(|(name, mut script)| {
                        script.name = name.parse().unwrap_or_else(|e| panic!("{e}"));
                        script
                    })
                    .collect();
                if let (Some(rt), Some(sha)) = (&mut s.container_runtime, tarball) {
                    rt.source = Source {
                        package: None,
                        url: Some("https://mirror.example/containerd.tar.gz".parse().unwrap_or_else(|e| panic!("{e}"))),
                        sha256: Some(sha.parse().unwrap_or_else(|e| panic!("{e}"))),
                    };
                }
                s
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
                match &rt.source.sha256 {
                    Some(sha) => {
                        m.runtime_artifact = Some(sha.to_string());
                        let unit = crate::drivers::containerd::UNIT_CONTENT;
                        m.files.insert(crate::drivers::containerd::UNIT.into(), FileState { sha256: sha256_hex(unit.as_bytes()), mode: 0o644 });
                    }
                    None => {
                        m.packages.insert("containerd".into(), Installed { version: rt.version.clone(), held: true });
                    }
                }
                let config = render_containerd_config(rt.config.systemd_cgroup);
                m.files.insert(format!("/{CONTAINERD_CONFIG}"), FileState { sha256: sha256_hex(config.as_bytes()), mode: 0o644 });
            }
            for f in &s.files {
                m.files.insert(f.path.clone(), FileState { sha256: sha256_hex(f.content.as_bytes()), mode: f.mode.0 });
            }
            m.bootstrapped.extend(s.scripts.iter().filter(|s| s.when == ScriptWhen::Bootstrap).map(|s| s.name.to_string()));
            prop_assert_eq!(plan(&s, &m, &Context::default()).map_err(|e| TestCaseError::fail(e.to_string()))?, Vec::<Step>::new());
        }
    }
}
