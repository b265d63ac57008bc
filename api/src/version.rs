//! Typed versions: Debian package versions (dpkg ordering), RPM versions (rpmvercmp),
//! Kubernetes versions (a `v` prefix tolerated and normalised) and semantic release versions.
//!
//! Each type parses from a string, keeps the text the operator wrote (normalised where the
//! type says so), and orders itself by the rules of the tool that will install it, so that
//! "is this an upgrade?" is answered the way dpkg, rpm or Kubernetes would answer it.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A version string that failed to parse; the message says which kind of version was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not {expected}")]
pub struct VersionError {
    pub input: String,
    pub expected: &'static str,
}

fn version_error(input: &str, expected: &'static str) -> VersionError {
    VersionError { input: input.to_owned(), expected }
}

/// Serde for a version type goes through its `FromStr`/`Display`, so a bad value is reported
/// with the field path by `serde_path_to_error`.
macro_rules! serde_via_str {
    ($ty:ty) => {
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = String::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Debian

/// A Debian package version, `[epoch:]upstream[-revision]`, ordered as `dpkg --compare-versions`.
#[derive(Debug, Clone)]
pub struct DebVersion {
    text: String,
    epoch: u32,
    upstream: String,
    revision: String,
}

impl DebVersion {
    pub fn epoch(&self) -> u32 {
        self.epoch
    }
    pub fn upstream(&self) -> &str {
        &self.upstream
    }
    pub fn revision(&self) -> &str {
        &self.revision
    }
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl FromStr for DebVersion {
    type Err = VersionError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        const EXPECTED: &str = "a Debian package version";
        let bad = || version_error(input, EXPECTED);
        if input.is_empty() || input.chars().any(|c| c.is_whitespace()) {
            return Err(bad());
        }
        let (epoch, rest) = match input.split_once(':') {
            Some((e, rest)) => {
                if e.is_empty() || !e.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                (e.parse::<u32>().map_err(|_| bad())?, rest)
            }
            None => (0, input),
        };
        let (upstream, revision) = match rest.rsplit_once('-') {
            Some((u, r)) => (u, r),
            None => (rest, ""),
        };
        let has_revision = rest.contains('-');
        if upstream.is_empty() || !upstream.as_bytes()[0].is_ascii_digit() {
            return Err(bad());
        }
        let upstream_ok = upstream.bytes().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(b, b'.' | b'+' | b'~')
                || (b == b'-' && has_revision)
                || (b == b':' && epoch_present(input))
        });
        if !upstream_ok || (has_revision && revision.is_empty()) {
            return Err(bad());
        }
        if !revision.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'~')) {
            return Err(bad());
        }
        Ok(DebVersion { text: input.to_owned(), epoch, upstream: upstream.to_owned(), revision: revision.to_owned() })
    }
}

fn epoch_present(input: &str) -> bool {
    input.contains(':')
}

/// dpkg's character weight: `~` sorts before everything, even the end of the string;
/// letters before other symbols.
fn dpkg_order(c: Option<u8>) -> i32 {
    match c {
        None => 0,
        Some(c) if c.is_ascii_digit() => 0,
        Some(c) if c.is_ascii_alphabetic() => i32::from(c),
        Some(b'~') => -1,
        Some(c) => i32::from(c) + 256,
    }
}

/// Compares one part (upstream or revision) the way dpkg's `verrevcmp` does.
fn dpkg_part_cmp(a: &str, b: &str) -> Ordering {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        while (i < a.len() && !a[i].is_ascii_digit()) || (j < b.len() && !b[j].is_ascii_digit()) {
            let ac = dpkg_order(a.get(i).copied());
            let bc = dpkg_order(b.get(j).copied());
            if ac != bc {
                return ac.cmp(&bc);
            }
            i += 1;
            j += 1;
        }
        while i < a.len() && a[i] == b'0' {
            i += 1;
        }
        while j < b.len() && b[j] == b'0' {
            j += 1;
        }
        let mut first_diff = Ordering::Equal;
        while i < a.len() && a[i].is_ascii_digit() && j < b.len() && b[j].is_ascii_digit() {
            if first_diff == Ordering::Equal {
                first_diff = a[i].cmp(&b[j]);
            }
            i += 1;
            j += 1;
        }
        if i < a.len() && a[i].is_ascii_digit() {
            return Ordering::Greater;
        }
        if j < b.len() && b[j].is_ascii_digit() {
            return Ordering::Less;
        }
        if first_diff != Ordering::Equal {
            return first_diff;
        }
    }
    Ordering::Equal
}

impl Ord for DebVersion {
    fn cmp(&self, other: &Self) -> Ordering {
        self.epoch
            .cmp(&other.epoch)
            .then_with(|| dpkg_part_cmp(&self.upstream, &other.upstream))
            .then_with(|| dpkg_part_cmp(&self.revision, &other.revision))
    }
}
impl PartialOrd for DebVersion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for DebVersion {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for DebVersion {}
impl fmt::Display for DebVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}
serde_via_str!(DebVersion);

// ---------------------------------------------------------------------------------------------
// RPM

/// An RPM `[epoch:]version[-release]`, ordered by epoch, then rpmvercmp on version and release.
#[derive(Debug, Clone)]
pub struct RpmVersion {
    text: String,
    epoch: u32,
    version: String,
    release: String,
}

impl RpmVersion {
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl FromStr for RpmVersion {
    type Err = VersionError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        const EXPECTED: &str = "an RPM version";
        let bad = || version_error(input, EXPECTED);
        let allowed = |s: &str| s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'+' | b'~' | b'^'));
        let (epoch, rest) = match input.split_once(':') {
            Some((e, rest)) => (e.parse::<u32>().map_err(|_| bad())?, rest),
            None => (0, input),
        };
        let (version, release) = rest.rsplit_once('-').unwrap_or((rest, ""));
        if version.is_empty() || (rest.contains('-') && release.is_empty()) || !allowed(version) || !allowed(release) {
            return Err(bad());
        }
        Ok(RpmVersion { text: input.to_owned(), epoch, version: version.to_owned(), release: release.to_owned() })
    }
}

/// rpm's `rpmvercmp`: alternating runs of digits and letters, separators ignored, `~` sorts
/// before anything and `^` after the base version but before any further segment.
pub fn rpmvercmp(a: &str, b: &str) -> Ordering {
    if a == b {
        return Ordering::Equal;
    }
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    let is_sep = |c: u8| !c.is_ascii_alphanumeric() && c != b'~' && c != b'^';
    loop {
        while i < a.len() && is_sep(a[i]) {
            i += 1;
        }
        while j < b.len() && is_sep(b[j]) {
            j += 1;
        }
        let (ca, cb) = (a.get(i).copied(), b.get(j).copied());
        if ca == Some(b'~') || cb == Some(b'~') {
            if ca != Some(b'~') {
                return Ordering::Greater;
            }
            if cb != Some(b'~') {
                return Ordering::Less;
            }
            i += 1;
            j += 1;
            continue;
        }
        if ca == Some(b'^') || cb == Some(b'^') {
            if ca.is_none() {
                return Ordering::Less;
            }
            if cb.is_none() {
                return Ordering::Greater;
            }
            if ca != Some(b'^') {
                return Ordering::Greater;
            }
            if cb != Some(b'^') {
                return Ordering::Less;
            }
            i += 1;
            j += 1;
            continue;
        }
        if ca.is_none() || cb.is_none() {
            break;
        }
        let numeric = a[i].is_ascii_digit();
        let take = |s: &[u8], mut k: usize| {
            let start = k;
            while k < s.len() && if numeric { s[k].is_ascii_digit() } else { s[k].is_ascii_alphabetic() } {
                k += 1;
            }
            (start, k)
        };
        let (sa, ea) = take(a, i);
        let (sb, eb) = take(b, j);
        i = ea;
        j = eb;
        if sb == eb {
            // Segments of different kinds: a number is newer than letters.
            return if numeric { Ordering::Greater } else { Ordering::Less };
        }
        let (mut seg_a, mut seg_b) = (&a[sa..ea], &b[sb..eb]);
        let ord = if numeric {
            while seg_a.first() == Some(&b'0') {
                seg_a = &seg_a[1..];
            }
            while seg_b.first() == Some(&b'0') {
                seg_b = &seg_b[1..];
            }
            seg_a.len().cmp(&seg_b.len()).then_with(|| seg_a.cmp(seg_b))
        } else {
            seg_a.cmp(seg_b)
        };
        if ord != Ordering::Equal {
            return ord;
        }
    }
    match (i >= a.len(), j >= b.len()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        _ => Ordering::Greater,
    }
}

impl Ord for RpmVersion {
    fn cmp(&self, other: &Self) -> Ordering {
        self.epoch
            .cmp(&other.epoch)
            .then_with(|| rpmvercmp(&self.version, &other.version))
            .then_with(|| rpmvercmp(&self.release, &other.release))
    }
}
impl PartialOrd for RpmVersion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for RpmVersion {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for RpmVersion {}
impl fmt::Display for RpmVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}
serde_via_str!(RpmVersion);

// ---------------------------------------------------------------------------------------------
// Kubernetes and release versions

/// A Kubernetes version, `vMAJOR.MINOR.PATCH[-pre]`; a missing `v` is added.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KubeVersion(semver::Version);

impl KubeVersion {
    pub fn major(&self) -> u64 {
        self.0.major
    }
    pub fn minor(&self) -> u64 {
        self.0.minor
    }
}

impl FromStr for KubeVersion {
    type Err = VersionError;
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let bare = input.strip_prefix('v').unwrap_or(input);
        semver::Version::parse(bare)
            .ok()
            .filter(|v| v.build.is_empty())
            .map(KubeVersion)
            .ok_or_else(|| version_error(input, "a Kubernetes version"))
    }
}
impl fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}
serde_via_str!(KubeVersion);

/// A release version as etcd and containerd publish them, `MAJOR.MINOR.PATCH`; a `v` prefix
/// is tolerated and dropped.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReleaseVersion(semver::Version);

impl ReleaseVersion {
    pub fn major(&self) -> u64 {
        self.0.major
    }
    pub fn minor(&self) -> u64 {
        self.0.minor
    }
}

impl FromStr for ReleaseVersion {
    type Err = VersionError;
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let bare = input.strip_prefix('v').unwrap_or(input);
        semver::Version::parse(bare).map(ReleaseVersion).map_err(|_| version_error(input, "a release version (MAJOR.MINOR.PATCH)"))
    }
}
impl fmt::Display for ReleaseVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
serde_via_str!(ReleaseVersion);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn deb(s: &str) -> DebVersion {
        s.parse().unwrap_or_else(|e| panic!("{e}"))
    }
    fn rpm(s: &str) -> RpmVersion {
        s.parse().unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn dpkg_known_orderings() {
        let ascending = ["1.0~rc1", "1.0", "1.0-1", "1.0-1+b1", "1.0a", "1.0.1", "1:0.1"];
        for pair in ascending.windows(2) {
            assert!(deb(pair[0]) < deb(pair[1]), "{} < {}", pair[0], pair[1]);
        }
        assert!(deb("1.6.20~ds1-1+deb12u2") < deb("1.6.20~ds1-1+deb12u3"));
        assert!(deb("6.1.176-1") < deb("6.1.192-3"));
        assert!(deb("3.0.17-1~deb12u2") < deb("3.0.22-1~deb12u2"));
        assert_eq!(deb("1.01"), deb("1.1"));
        assert_eq!(deb("0:1.0"), deb("1.0"));
    }

    #[test]
    fn dpkg_rejects_malformed() {
        for bad in ["", "a1.0", "1.0-", "x:1.0", "1.0 2", "1.0-a_b", "-1"] {
            assert!(bad.parse::<DebVersion>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn rpm_known_orderings() {
        let cases = [
            ("1.0", "1.0", Ordering::Equal),
            ("1.0", "2.0", Ordering::Less),
            ("2.0.1", "2.0", Ordering::Greater),
            ("2.0.1a", "2.0.1", Ordering::Greater),
            ("5.5p1", "5.5p10", Ordering::Less),
            ("10xyz", "10.1xyz", Ordering::Less),
            ("xyz10", "xyz10.1", Ordering::Less),
            ("1.0~rc1", "1.0", Ordering::Less),
            ("1.0^", "1.0", Ordering::Greater),
            ("1.0^git1", "1.0.1", Ordering::Less),
            ("a", "1", Ordering::Less),
            ("001", "1", Ordering::Equal),
            ("1.0a", "1.0.a", Ordering::Equal),
        ];
        for (a, b, want) in cases {
            assert_eq!(rpmvercmp(a, b), want, "rpmvercmp({a}, {b})");
        }
        assert!(rpm("1:1.0-1") > rpm("2.0-1"));
        assert!(rpm("1.6.20-1.el9") < rpm("1.6.20-2.el9"));
    }

    #[test]
    fn kube_versions_normalise_the_v_prefix() {
        let v: KubeVersion = "1.30.4".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v.to_string(), "v1.30.4");
        assert_eq!(v, "v1.30.4".parse().unwrap_or_else(|e| panic!("{e}")));
        let err = "1.3x".parse::<KubeVersion>().err().map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("\"1.3x\" is not a Kubernetes version"));
        assert!("v1.30".parse::<KubeVersion>().is_err());
    }

    fn deb_strategy() -> impl Strategy<Value = String> {
        (proptest::option::of(0u32..3), "[0-9][0-9a-z.+~]{0,8}", proptest::option::of("[0-9a-z][0-9a-z.+~]{0,5}")).prop_map(
            |(epoch, upstream, revision)| {
                let mut s = String::new();
                if let Some(e) = epoch {
                    s.push_str(&format!("{e}:"));
                }
                s.push_str(&upstream);
                if let Some(r) = revision {
                    s.push('-');
                    s.push_str(&r);
                }
                s
            },
        )
    }

    proptest! {
        #[test]
        fn dpkg_order_is_antisymmetric_and_transitive(a in deb_strategy(), b in deb_strategy(), c in deb_strategy()) {
            let (a, b, c) = (deb(&a), deb(&b), deb(&c));
            prop_assert_eq!(a.cmp(&b), b.cmp(&a).reverse());
            if a <= b && b <= c {
                prop_assert!(a <= c);
            }
        }

        #[test]
        fn dpkg_tilde_sorts_before_release(base in "[0-9]{1,3}(\\.[0-9]{1,3}){0,2}", pre in "[a-z0-9]{1,4}") {
            let release = deb(&base);
            let prerelease = deb(&format!("{base}~{pre}"));
            prop_assert!(prerelease < release);
        }

        #[test]
        fn dpkg_numeric_segments_compare_as_numbers(x in 0u32..100_000, y in 0u32..100_000) {
            prop_assert_eq!(deb(&format!("1.{x}")).cmp(&deb(&format!("1.{y}"))), x.cmp(&y));
        }

        #[test]
        fn rpm_order_is_antisymmetric_and_transitive(a in "[0-9a-z.~^]{1,8}", b in "[0-9a-z.~^]{1,8}", c in "[0-9a-z.~^]{1,8}") {
            prop_assert_eq!(rpmvercmp(&a, &b), rpmvercmp(&b, &a).reverse());
            if rpmvercmp(&a, &b) != Ordering::Greater && rpmvercmp(&b, &c) != Ordering::Greater {
                prop_assert!(rpmvercmp(&a, &c) != Ordering::Greater);
            }
        }

        #[test]
        fn rpm_numeric_segments_compare_as_numbers(x in 0u64..10_000_000, y in 0u64..10_000_000) {
            prop_assert_eq!(rpmvercmp(&format!("2.{x}"), &format!("2.{y}")), x.cmp(&y));
        }

        #[test]
        fn kube_versions_round_trip(major in 0u64..3, minor in 0u64..40, patch in 0u64..30, v in any::<bool>()) {
            let text = format!("{}{major}.{minor}.{patch}", if v { "v" } else { "" });
            let parsed: KubeVersion = text.parse().map_err(|e: VersionError| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(parsed.to_string(), format!("v{major}.{minor}.{patch}"));
        }
    }

    /// Checks our ordering against the real `dpkg --compare-versions` when dpkg is installed
    /// (it is on every Debian build machine); elsewhere there is nothing to compare with.
    #[test]
    fn dpkg_agrees_with_real_dpkg() {
        use proptest::test_runner::{Config, TestRunner};
        if std::process::Command::new("dpkg").arg("--version").output().is_err() {
            eprintln!("dpkg not installed: skipping the comparison with the real dpkg");
            return;
        }
        let mut runner = TestRunner::new(Config { cases: 200, ..Config::default() });
        let result = runner.run(&(deb_strategy(), deb_strategy()), |(a, b)| {
            let ours = deb(&a).cmp(&deb(&b));
            let real_lt = std::process::Command::new("dpkg")
                .args(["--compare-versions", &a, "lt", &b])
                .status()
                .map_err(|e| TestCaseError::fail(e.to_string()))?
                .success();
            let real_eq = std::process::Command::new("dpkg")
                .args(["--compare-versions", &a, "eq", &b])
                .status()
                .map_err(|e| TestCaseError::fail(e.to_string()))?
                .success();
            let real = if real_lt {
                Ordering::Less
            } else if real_eq {
                Ordering::Equal
            } else {
                Ordering::Greater
            };
            prop_assert_eq!(ours, real, "{} vs {}", a, b);
            Ok(())
        });
        if let Err(e) = result {
            panic!("{e}");
        }
    }
}
