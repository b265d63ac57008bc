//! dnf and rpm, for the RHEL family: the installed packages from the rpm database, holds as
//! dnf versionlock entries, repositories as a `.repo` file, exact installs.
//!
//! The parsers and the planner's use of them are tested here; the commands follow dnf 4 with
//! the versionlock plugin (`python3-dnf-plugin-versionlock`), which the machine must have.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use keelson_api::machine::Repository;

use super::command::{CommandError, run};
use crate::observe::Installed;
use crate::plan::Pin;

pub const REPO_FILE: &str = "etc/yum.repos.d/keelson.repo";
pub const VERSIONLOCK_LIST: &str = "etc/dnf/plugins/versionlock.list";
/// What `rpm -qa` prints per package, parsed by `parse_rpm_query`.
pub const QUERY_FORMAT: &str = "%{NAME}\t%{EPOCHNUM}:%{VERSION}-%{RELEASE}\n";
const TIMEOUT_SECS: u64 = 1800;

#[derive(Debug, thiserror::Error)]
pub enum DnfError {
    #[error("dnf: version {version} of {name} not found (the repositories offer: {offered})")]
    VersionNotFound { name: String, version: String, offered: String },
    #[error(transparent)]
    Command(#[from] CommandError),
}

/// `rpm -qa --queryformat QUERY_FORMAT`: name → `epoch:version-release`. Several versions of
/// one name (kernels) keep the newest.
pub fn parse_rpm_query(out: &str) -> BTreeMap<String, String> {
    let mut packages: BTreeMap<String, String> = BTreeMap::new();
    for line in out.lines() {
        let Some((name, evr)) = line.split_once('\t') else { continue };
        let (name, evr) = (name.trim(), evr.trim());
        if name.is_empty() || evr.parse::<keelson_api::version::RpmVersion>().is_err() {
            continue;
        }
        let newer = packages.get(name).is_none_or(|old| compare(evr, old).is_gt());
        if newer {
            packages.insert(name.to_owned(), evr.to_owned());
        }
    }
    packages
}

pub fn compare(a: &str, b: &str) -> std::cmp::Ordering {
    match (a.parse::<keelson_api::version::RpmVersion>(), b.parse::<keelson_api::version::RpmVersion>()) {
        (Ok(a), Ok(b)) => a.cmp(&b),
        _ => a.cmp(b),
    }
}

/// Whether two RPM versions are the same; a missing epoch is epoch 0.
pub fn same_version(installed: &str, wanted: &str) -> bool {
    compare(installed, wanted).is_eq()
}

/// The names locked in dnf's versionlock list. Entries look like `name-epoch:version-release.*`
/// (or without the epoch); `!`-entries are exclusions, not locks.
pub fn parse_versionlock(list: &str) -> BTreeSet<String> {
    list.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('!'))
        .filter_map(|l| {
            // name-[epoch:]version-release[.arch]: the name is what precedes the last two dashes.
            let mut parts = l.rsplitn(3, '-');
            let (_release, _version, name) = (parts.next()?, parts.next()?, parts.next()?);
            (!name.is_empty()).then(|| name.to_owned())
        })
        .collect()
}

/// The installed packages, with holds from the versionlock list.
pub fn installed(rpm_query: &str, versionlock: &str) -> BTreeMap<String, Installed> {
    let locked = parse_versionlock(versionlock);
    parse_rpm_query(rpm_query)
        .into_iter()
        .map(|(name, version)| {
            let held = locked.contains(&name);
            (name, Installed { version, held })
        })
        .collect()
}

/// The managed repositories as a dnf `.repo` file; unsigned repositories need `trusted`.
pub fn render_repo_file(repos: &[Repository]) -> String {
    let mut out = String::from("# Managed by keelson-agent: changes are overwritten.\n");
    for r in repos {
        out.push_str(&format!("\n[keelson-{}]\nname={}\n", r.name, r.name));
        out.push_str(&format!("baseurl={}\n", r.uris.iter().map(|u| u.as_str()).collect::<Vec<_>>().join(" ")));
        out.push_str("enabled=1\n");
        match (&r.signed_by, r.trusted) {
            (Some(key), _) => out.push_str(&format!("gpgcheck=1\ngpgkey=file://{key}\n")),
            (None, true) => out.push_str("gpgcheck=0\n"),
            // Checked against the keys rpm already trusts, as apt does without Signed-By.
            (None, false) => out.push_str("gpgcheck=1\n"),
        }
    }
    out
}

/// `dnf list --showduplicates NAME` lines: `name.arch  [epoch:]version-release  repo`.
pub fn parse_dnf_list(out: &str, name: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (pkg, version) = (f.next()?, f.next()?);
            let (n, _arch) = pkg.rsplit_once('.')?;
            (n == name && f.next().is_some()).then(|| version.to_owned())
        })
        .collect()
}

/// dnf's spelling of an exact package: `name-[epoch:]version-release`.
pub fn nevr(p: &Pin) -> String {
    format!("{}-{}", p.name, p.version)
}

pub async fn makecache() -> Result<(), DnfError> {
    run(&["dnf", "makecache", "-y", "-q"], &[], Duration::from_secs(TIMEOUT_SECS)).await?;
    Ok(())
}

/// The versions of `name` the repositories offer (and the installed one).
pub async fn offered(name: &str) -> Result<Vec<String>, DnfError> {
    let out = run(&["dnf", "list", "--showduplicates", "-q", name], &[], Duration::from_secs(TIMEOUT_SECS)).await?;
    Ok(parse_dnf_list(&out, name))
}

pub async fn ensure_available(pins: &[Pin]) -> Result<(), DnfError> {
    for p in pins {
        let offered = offered(&p.name).await?;
        if !offered.iter().any(|v| same_version(v, &p.version)) {
            let offered = if offered.is_empty() { "none".to_owned() } else { offered.join(", ") };
            return Err(DnfError::VersionNotFound { name: p.name.clone(), version: p.version.clone(), offered });
        }
    }
    Ok(())
}

/// Installs exact versions, upgrading or downgrading; a versionlock on a package is lifted
/// for its own change and set again by `hold`.
pub async fn install(pins: &[Pin]) -> Result<(), DnfError> {
    let names: Vec<String> = pins.iter().map(|p| p.name.clone()).collect();
    // Not locked is fine.
    let _ = unhold(&names).await;
    let specs: Vec<String> = pins.iter().map(nevr).collect();
    let mut argv = vec!["dnf", "install", "-y", "-q", "--allowerasing", "--setopt=install_weak_deps=False"];
    argv.extend(specs.iter().map(String::as_str));
    run(&argv, &[], Duration::from_secs(TIMEOUT_SECS)).await?;
    Ok(())
}

/// Runs `command` with the package names appended; nothing to do for none.
async fn for_packages(command: &[&str], names: &[String]) -> Result<(), DnfError> {
    if names.is_empty() {
        return Ok(());
    }
    let mut argv = command.to_vec();
    argv.extend(names.iter().map(String::as_str));
    run(&argv, &[], Duration::from_secs(TIMEOUT_SECS)).await?;
    Ok(())
}

pub async fn hold(names: &[String]) -> Result<(), DnfError> {
    for_packages(&["dnf", "versionlock", "add", "-q"], names).await
}

pub async fn unhold(names: &[String]) -> Result<(), DnfError> {
    for_packages(&["dnf", "versionlock", "delete", "-q"], names).await
}

pub async fn remove(names: &[String]) -> Result<(), DnfError> {
    for_packages(&["dnf", "remove", "-y", "-q"], names).await
}

#[cfg(test)]
mod tests {
    use super::*;

    const RPM_QA: &str = "containerd.io\t0:1.6.28-3.1.el9\nkernel-core\t0:5.14.0-362.8.1.el9_3\nkernel-core\t0:5.14.0-427.13.1.el9_4\nbash\t0:5.1.8-9.el9\ngpg-pubkey\t0:fd431d51-4ae0493b\n(none)\n";
    const VERSIONLOCK: &str =
        "# Added by keelson\ncontainerd.io-0:1.6.28-3.1.el9.*\nkernel-core-5.14.0-427.13.1.el9_4.*\n!bash-0:5.1.8-9.el9.*\n";

    #[test]
    fn parses_the_rpm_database_query() {
        let p = parse_rpm_query(RPM_QA);
        assert_eq!(p["containerd.io"], "0:1.6.28-3.1.el9");
        assert_eq!(p["kernel-core"], "0:5.14.0-427.13.1.el9_4", "the newest of several kernels");
        assert_eq!(p.len(), 4);
    }

    #[test]
    fn versionlock_entries_hold_and_exclusions_do_not() {
        let held = parse_versionlock(VERSIONLOCK);
        assert_eq!(held, BTreeSet::from(["containerd.io".to_owned(), "kernel-core".to_owned()]));
        let installed = installed(RPM_QA, VERSIONLOCK);
        assert!(installed["containerd.io"].held && !installed["bash"].held);
    }

    #[test]
    fn rpm_versions_compare_with_a_default_epoch() {
        assert!(same_version("0:1.6.28-3.1.el9", "1.6.28-3.1.el9"));
        assert!(!same_version("0:1.6.28-3.1.el9", "1:1.6.28-3.1.el9"));
        assert!(!same_version("1.6.28-3.1.el9", "1.6.28-3.2.el9"));
    }

    #[test]
    fn parses_dnf_list_and_renders_repo_files() -> anyhow::Result<()> {
        let out = "Installed Packages\ncontainerd.io.x86_64   1.6.28-3.1.el9   @docker-ce-stable\nAvailable Packages\ncontainerd.io.x86_64   1.6.31-3.1.el9   docker-ce-stable\ncontainerd.io.x86_64   1.7.22-3.1.el9   docker-ce-stable\n";
        assert_eq!(parse_dnf_list(out, "containerd.io"), vec!["1.6.28-3.1.el9", "1.6.31-3.1.el9", "1.7.22-3.1.el9"]);
        let repos: Vec<Repository> = serde_json::from_value(serde_json::json!([
            {"name": "baseos", "uris": ["https://mirror.example/9/BaseOS/x86_64/os/"], "signedBy": "/etc/pki/rpm-gpg/RPM-GPG-KEY"},
            {"name": "local", "uris": ["http://10.0.0.1/repo/"], "trusted": true},
        ]))?;
        assert_eq!(
            render_repo_file(&repos),
            "# Managed by keelson-agent: changes are overwritten.\n\n[keelson-baseos]\nname=baseos\nbaseurl=https://mirror.example/9/BaseOS/x86_64/os/\nenabled=1\ngpgcheck=1\ngpgkey=file:///etc/pki/rpm-gpg/RPM-GPG-KEY\n\n[keelson-local]\nname=local\nbaseurl=http://10.0.0.1/repo/\nenabled=1\ngpgcheck=0\n"
        );
        assert_eq!(nevr(&Pin { name: "containerd.io".into(), version: "1.7.22-3.1.el9".into() }), "containerd.io-1.7.22-3.1.el9");
        Ok(())
    }
}
