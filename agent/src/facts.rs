//! Facts about this machine, read from /proc, /sys and /etc: what a scheduler or cluster
//! autoscaler needs to know of its capacity.

use std::path::Path;

use keelson_api::machine::{Disk, Facts, Gpu};

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

/// Reads the facts of the machine whose root is `/`. Unreadable facts are left empty rather
/// than failing: a container or a minimal image may lack some of these files.
pub fn collect() -> Facts {
    Facts {
        cpus: std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(0),
        memory_bytes: read("/proc/meminfo").as_deref().and_then(parse_meminfo_total).unwrap_or(0),
        gpus: gpus(Path::new("/sys/bus/pci/devices")),
        disks: disks(Path::new("/sys/block")),
        os_release: read("/etc/os-release").as_deref().and_then(parse_pretty_name),
        kernel: read("/proc/sys/kernel/osrelease"),
        boot_id: read("/proc/sys/kernel/random/boot_id"),
        arch: Some(std::env::consts::ARCH.to_owned()),
        hostname: read("/proc/sys/kernel/hostname"),
        addresses: addresses(),
    }
}

/// The address an etcd member here advertises: the configured one, else the machine's first.
pub fn etcd_address(configured: Option<std::net::IpAddr>) -> Option<std::net::IpAddr> {
    configured.or_else(|| addresses().iter().find_map(|a| a.parse().ok()))
}

/// The machine's own addresses: every IPv4 and IPv6 address on an interface that is up,
/// except loopback and IPv6 link-local ones, which other machines cannot reach.
pub fn addresses() -> Vec<String> {
    use nix::net::if_::InterfaceFlags;
    let Ok(ifaddrs) = nix::ifaddrs::getifaddrs() else { return Vec::new() };
    let mut out: Vec<std::net::IpAddr> = ifaddrs
        .filter(|i| i.flags.contains(InterfaceFlags::IFF_UP) && !i.flags.contains(InterfaceFlags::IFF_LOOPBACK))
        .filter_map(|i| {
            let a = i.address?;
            if let Some(v4) = a.as_sockaddr_in() {
                return Some(std::net::IpAddr::V4(v4.ip()));
            }
            let v6 = a.as_sockaddr_in6()?.ip();
            // fe80::/10
            ((v6.segments()[0] & 0xffc0) != 0xfe80).then_some(std::net::IpAddr::V6(v6))
        })
        .collect();
    out.sort();
    out.dedup();
    out.into_iter().map(|a| a.to_string()).collect()
}

/// `MemTotal:  24563452 kB` → bytes.
pub fn parse_meminfo_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// PRETTY_NAME from os-release, unquoted.
pub fn parse_pretty_name(os_release: &str) -> Option<String> {
    let value = os_release.lines().find_map(|l| l.strip_prefix("PRETTY_NAME="))?;
    Some(value.trim_matches('"').to_owned())
}

fn disks(sys_block: &Path) -> Vec<Disk> {
    let Ok(entries) = std::fs::read_dir(sys_block) else { return Vec::new() };
    let mut disks: Vec<Disk> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            // Virtual devices (loop, ram, device-mapper) are not capacity.
            if name.starts_with("loop") || name.starts_with("ram") || name.starts_with("dm-") || name.starts_with("zram") {
                return None;
            }
            let dir = e.path();
            let sectors: u64 = std::fs::read_to_string(dir.join("size")).ok()?.trim().parse().ok()?;
            let rotational = std::fs::read_to_string(dir.join("queue/rotational")).is_ok_and(|s| s.trim() == "1");
            let model = std::fs::read_to_string(dir.join("device/model")).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
            Some(Disk { name, size_bytes: sectors * 512, rotational, model })
        })
        .collect();
    disks.sort_by(|a, b| a.name.cmp(&b.name));
    disks
}

/// PCI display controllers (class 0x03xxxx).
fn gpus(pci_devices: &Path) -> Vec<Gpu> {
    let Ok(entries) = std::fs::read_dir(pci_devices) else { return Vec::new() };
    let mut gpus: Vec<Gpu> = entries
        .flatten()
        .filter_map(|e| {
            let dir = e.path();
            let class = std::fs::read_to_string(dir.join("class")).ok()?;
            if !class.trim().starts_with("0x03") {
                return None;
            }
            let vendor = std::fs::read_to_string(dir.join("vendor")).ok()?.trim().to_owned();
            let device = std::fs::read_to_string(dir.join("device")).ok()?.trim().to_owned();
            Some(Gpu { vendor, model: device, pci_address: Some(e.file_name().to_string_lossy().into_owned()) })
        })
        .collect();
    gpus.sort_by(|a, b| a.pci_address.cmp(&b.pci_address));
    gpus
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_meminfo_and_os_release() {
        assert_eq!(parse_meminfo_total("MemTotal:       24563452 kB\nMemFree: 1 kB\n"), Some(24_563_452 * 1024));
        assert_eq!(parse_meminfo_total("MemFree: 1 kB\n"), None);
        let os = "NAME=\"Debian GNU/Linux\"\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n";
        assert_eq!(parse_pretty_name(os).as_deref(), Some("Debian GNU/Linux 12 (bookworm)"));
    }

    #[test]
    fn collects_this_machines_facts() {
        let f = collect();
        assert!(f.cpus >= 1);
        assert!(f.memory_bytes > 0);
        assert!(f.kernel.is_some());
        let parsed: Vec<std::net::IpAddr> = f.addresses.iter().filter_map(|a| a.parse().ok()).collect();
        assert_eq!(parsed.len(), f.addresses.len(), "{:?}", f.addresses);
        assert!(parsed.iter().all(|a| !a.is_loopback()), "{:?}", f.addresses);
    }
}
