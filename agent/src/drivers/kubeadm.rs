//! kubeadm: its binary (from a package, or an artifact installed by rename with the previous
//! one kept), and the node upgrade it performs. The agent never holds cluster credentials of
//! its own: kubeadm uses the node's (`/etc/kubernetes/admin.conf` on a control-plane machine
//! for `upgrade apply`, the kubelet's for `upgrade node`), as an operator running it by hand
//! would.

use std::path::Path;
use std::time::Duration;

use keelson_api::machine::KubeadmUpgrade;

use super::command::{self, CommandError};
use super::files;

pub const BINARY: &str = "/usr/bin/kubeadm";
/// Present once the node has joined a cluster (`kubeadm init` or `kubeadm join` wrote it).
pub const KUBELET_KUBECONFIG: &str = "/etc/kubernetes/kubelet.conf";
/// An upgrade pulls images and restarts the control plane's static pods one by one: minutes.
const UPGRADE_TIMEOUT: Duration = Duration::from_secs(20 * 60);

/// `kubeadm version -o short` prints `v1.31.2`.
pub fn parse_version(out: &str) -> Option<String> {
    let v = out.trim();
    (v.starts_with('v') && v[1..].starts_with(|c: char| c.is_ascii_digit()) && !v.contains(char::is_whitespace)).then(|| v.to_owned())
}

/// The installed kubeadm's version, when there is one.
pub fn installed_version(root: &Path) -> Option<String> {
    let binary = root.join(BINARY.trim_start_matches('/'));
    let out = std::process::Command::new(binary).args(["version", "-o", "short"]).output().ok()?;
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

/// The node has joined a cluster: there is something for `kubeadm upgrade` to upgrade.
pub fn node_joined(root: &Path) -> bool {
    root.join(KUBELET_KUBECONFIG.trim_start_matches('/')).exists()
}

/// Puts `artifact` in place as kubeadm, keeping the current binary as the previous one.
pub fn install_binary(artifact: &Path) -> std::io::Result<()> {
    files::install_executable(artifact, Path::new(BINARY))
}

/// Puts the previous binary back.
pub fn restore_previous() -> std::io::Result<bool> {
    files::restore_previous(Path::new(BINARY))
}

/// The command an upgrade runs: `kubeadm upgrade apply vX.Y.Z --yes` upgrades the cluster's
/// control plane (from its first machine); `kubeadm upgrade node` brings this node to the
/// version the cluster's configuration names.
pub fn upgrade_argv(mode: KubeadmUpgrade, version: &str) -> Vec<&str> {
    match mode {
        KubeadmUpgrade::Apply => vec![BINARY, "upgrade", "apply", version, "--yes"],
        KubeadmUpgrade::Node => vec![BINARY, "upgrade", "node"],
    }
}

pub async fn upgrade(mode: KubeadmUpgrade, version: &str) -> Result<String, CommandError> {
    command::run(&upgrade_argv(mode, version), &[], UPGRADE_TIMEOUT).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_short_version() {
        assert_eq!(parse_version("v1.31.2\n").as_deref(), Some("v1.31.2"));
        assert_eq!(parse_version("kubeadm version: &version.Info{…}"), None);
        assert_eq!(parse_version(""), None);
    }

    #[test]
    fn the_first_control_plane_machine_applies_the_others_upgrade_their_node() {
        assert_eq!(upgrade_argv(KubeadmUpgrade::Apply, "v1.31.2"), ["/usr/bin/kubeadm", "upgrade", "apply", "v1.31.2", "--yes"]);
        assert_eq!(upgrade_argv(KubeadmUpgrade::Node, "v1.31.2"), ["/usr/bin/kubeadm", "upgrade", "node"]);
    }
}
