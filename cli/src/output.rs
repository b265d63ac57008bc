//! Rendering resources for people (tables, describe) and for scripts (json, yaml).

use comfy_table::presets::NOTHING;
use comfy_table::{Cell, Table};
use keelson_api::cluster::KubernetesCluster;
use keelson_api::machine::Machine;
use keelson_api::meta::{ConditionStatus, Timestamp, condition, find_condition};
use keelson_api::pool::{MachinePool, PoolEtcdStatus, PoolRevision};
use keelson_api::token::BootstrapToken;
use keelson_api::wire::Event;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Wide,
    Json,
    Yaml,
}

pub fn structured<T: Serialize>(value: &T, format: Format) -> anyhow::Result<String> {
    Ok(match format {
        Format::Yaml => serde_saphyr::to_string(value)?,
        _ => serde_json::to_string_pretty(value)? + "\n",
    })
}

fn table(headers: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t.set_header(headers.iter().map(Cell::new));
    t
}

/// "3m", "2h", "5d": how long ago, as kubectl shows it.
pub fn age(since: Option<Timestamp>) -> String {
    let Some(t) = since else { return "-".into() };
    let secs = (keelson_api::meta::now() - t).whole_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn status_of(m: &Machine, t: &str) -> String {
    find_condition(&m.status.conditions, t).map_or("Unknown".into(), |c| c.status.to_string())
}

fn opt(s: &Option<String>) -> String {
    s.clone().unwrap_or_else(|| "-".into())
}

pub fn machines_table(machines: &[Machine], wide: bool) -> String {
    let mut headers = vec!["NAME", "POOL", "ROLES", "READY", "UP-TO-DATE", "OS", "RUNTIME", "KUBELET", "ETCD", "AGE"];
    if wide {
        headers.extend(["PHASE", "GENERATION", "OBSERVED", "REACHABLE", "KERNEL", "STEP"]);
    }
    let mut t = table(&headers);
    for m in machines {
        let roles = m.spec.roles.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
        let mut row = vec![
            m.metadata.name_str().to_owned(),
            m.status.pool.as_ref().map_or("-".into(), ToString::to_string),
            if roles.is_empty() { "-".into() } else { roles },
            status_of(m, condition::READY),
            status_of(m, condition::UP_TO_DATE),
            m.status.facts.as_ref().and_then(|f| f.os_release.clone()).unwrap_or_else(|| "-".into()),
            opt(&m.status.versions.container_runtime),
            opt(&m.status.versions.kubelet),
            opt(&m.status.versions.etcd),
            age(m.metadata.creation_timestamp),
        ];
        if wide {
            row.extend([
                m.status.phase.map_or("-".into(), |p| p.to_string()),
                m.metadata.generation.to_string(),
                m.status.observed_generation.to_string(),
                status_of(m, condition::REACHABLE),
                opt(&m.status.versions.kernel),
                m.status.current_step.as_ref().map_or("-".into(), |s| format!("{}/{} {}", s.index, s.total, s.description)),
            ]);
        }
        t.add_row(row);
    }
    t.to_string() + "\n"
}

/// A rollout's progress as one line, and whether it is over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    pub line: String,
    pub complete: bool,
    pub halted: Option<String>,
}

pub fn rollout_progress(pool: &MachinePool) -> Progress {
    const WIDTH: u32 = 20;
    let s = &pool.status;
    let is = |t, st| find_condition(&s.conditions, t).is_some_and(|c| c.status == st);
    let complete = is(condition::ROLLED_OUT, ConditionStatus::True)
        && find_condition(&s.conditions, condition::ROLLED_OUT).is_some_and(|c| c.message == format!("revision {}", s.revision));
    let halted = is(condition::ROLLOUT_HALTED, ConditionStatus::True)
        .then(|| find_condition(&s.conditions, condition::ROLLOUT_HALTED).map(|c| c.message.clone()).unwrap_or_default());
    let filled = (s.updated * WIDTH).checked_div(s.machines).unwrap_or(WIDTH).min(WIDTH);
    let bar = format!("{}{}", "#".repeat(filled as usize), ".".repeat((WIDTH - filled) as usize));
    let mut line = format!(
        "revision {} [{bar}] {}/{} updated, {} updating, {} waiting, {} degraded",
        s.revision, s.updated, s.machines, s.updating, s.waiting, s.degraded
    );
    if let Some(w) = &s.wave {
        line.push_str(&format!("; wave {}", if w.is_empty() { "(unlabelled)" } else { w }));
    }
    if complete {
        line.push_str("; rolled out");
    } else if !s.message.is_empty() {
        line.push_str(&format!("; {}", s.message));
    }
    Progress { line, complete, halted }
}

pub fn history_table(history: &[PoolRevision]) -> String {
    let mut t = table(&["REVISION", "AGE", "CAUSE"]);
    for r in history {
        t.add_row(vec![r.revision.to_string(), age(Some(r.created)), r.cause.clone()]);
    }
    t.to_string() + "\n"
}

pub fn pools_table(pools: &[MachinePool], wide: bool) -> String {
    let mut headers = vec!["NAME", "MACHINES", "UPDATED", "UPDATING", "WAITING", "READY", "DEGRADED", "REVISION", "ROLLOUT", "AGE"];
    if wide {
        headers.extend(["SELECTOR", "MAX-UNAVAILABLE", "PAUSED", "WAVE"]);
    }
    let mut t = table(&headers);
    for p in pools {
        let s = &p.status;
        let mut row = vec![
            p.metadata.name_str().to_owned(),
            s.machines.to_string(),
            s.updated.to_string(),
            s.updating.to_string(),
            s.waiting.to_string(),
            s.ready.to_string(),
            s.degraded.to_string(),
            s.revision.to_string(),
            {
                let progress = rollout_progress(p);
                match (progress.complete, progress.halted.is_some()) {
                    (true, _) => "Complete".to_owned(),
                    (_, true) => "Halted".to_owned(),
                    _ if s.message.is_empty() => "Progressing".to_owned(),
                    _ => s.message.clone(),
                }
            },
            age(p.metadata.creation_timestamp),
        ];
        if wide {
            row.extend([
                p.spec.selector.match_labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","),
                p.spec.rollout.max_unavailable.to_string(),
                p.spec.rollout.paused.to_string(),
                s.wave.clone().unwrap_or_default(),
            ]);
        }
        t.add_row(row);
    }
    t.to_string() + "\n"
}

pub fn tokens_table(tokens: &[BootstrapToken]) -> String {
    let mut t = table(&["ID", "EXPIRES", "USAGES", "LIMIT", "REENROLL", "LABELS", "DESCRIPTION"]);
    for tok in tokens {
        let expires = tok.spec.expires_at.map_or("never".into(), |e| {
            let left = (e - keelson_api::meta::now()).whole_seconds();
            if left <= 0 { "expired".into() } else { format!("in {}", age(Some(keelson_api::meta::now() - time::Duration::seconds(left)))) }
        });
        t.add_row(vec![
            tok.metadata.name_str().to_owned(),
            expires,
            tok.status.usages.to_string(),
            tok.spec.usage_limit.map_or("-".into(), |l| l.to_string()),
            tok.spec.allow_reenroll.to_string(),
            tok.spec.labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","),
            tok.spec.description.clone(),
        ]);
    }
    t.to_string() + "\n"
}

pub fn clusters_table(clusters: &[KubernetesCluster]) -> String {
    let mut t = table(&["NAME", "SERVER", "CONTEXT", "CREDENTIAL", "AGE"]);
    for c in clusters {
        let field = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        t.add_row(vec![
            c.metadata.name_str().to_owned(),
            field(&c.status.server),
            field(&c.status.context),
            field(&c.status.credential),
            age(c.metadata.creation_timestamp),
        ]);
    }
    t.to_string() + "\n"
}

pub fn events_table(events: &[Event]) -> String {
    let mut t = table(&["AGE", "TYPE", "REASON", "SOURCE", "MESSAGE"]);
    for e in events {
        t.add_row(vec![age(Some(e.time)), e.type_.clone(), e.reason.clone(), e.source.clone(), e.message.clone()]);
    }
    t.to_string() + "\n"
}

/// An etcd pool's cluster: a summary line, the members, the client endpoints.
pub fn etcd_members(e: &PoolEtcdStatus) -> String {
    let leader = e.leader.as_ref().map_or("none reported".to_owned(), ToString::to_string);
    let mut out =
        format!("cluster {}: {} voters, {} healthy, quorum {}, leader {leader}\n", e.cluster, e.voters, e.healthy_voters, e.quorum);
    let mut t = table(&["MACHINE", "MEMBER", "VERSION", "ROLE", "HEALTHY", "RAFT-INDEX", "DB-SIZE", "ALARMS", "PEER-URL"]);
    for m in &e.members {
        let s = &m.member;
        let role = match (s.leader, s.learner) {
            (true, _) => "leader",
            (_, true) => "learner",
            _ => "follower",
        };
        t.add_row(vec![
            m.machine.to_string(),
            s.member_id.clone(),
            s.version.clone(),
            role.to_owned(),
            s.healthy.to_string(),
            s.raft_index.to_string(),
            format!("{:.1} MiB", s.db_size_bytes as f64 / (1024.0 * 1024.0)),
            if s.alarms.is_empty() { "-".to_owned() } else { s.alarms.join(",") },
            s.peer_url.clone(),
        ]);
    }
    out += &(t.to_string() + "\n");
    out += &format!("client endpoints: {}\n", e.client_endpoints.join(","));
    out
}

pub fn describe_machine(m: &Machine, events: &[Event]) -> anyhow::Result<String> {
    use std::fmt::Write;
    let mut out = String::new();
    let s = &m.status;
    writeln!(out, "Name:         {}", m.metadata.name_str())?;
    let labels = m.metadata.labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ");
    writeln!(out, "Labels:       {}", if labels.is_empty() { "<none>".into() } else { labels })?;
    writeln!(out, "Pool:         {}", s.pool.as_ref().map_or("<none>".into(), ToString::to_string))?;
    writeln!(out, "Phase:        {}", s.phase.map_or("-".into(), |p| p.to_string()))?;
    writeln!(out, "Generation:   {} (observed {})", m.metadata.generation, s.observed_generation)?;
    writeln!(out, "Created:      {} ago", age(m.metadata.creation_timestamp))?;
    writeln!(out, "Heartbeat:    {}", s.last_heartbeat_time.map_or("never".into(), |t| format!("{} ago", age(Some(t)))))?;
    if let Some(step) = &s.current_step {
        writeln!(out, "Current step: {}/{} {}", step.index, step.total, step.description)?;
    }
    writeln!(out, "Conditions:")?;
    if s.conditions.is_empty() {
        writeln!(out, "  <none>")?;
    } else {
        let mut t = table(&["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"]);
        for c in &s.conditions {
            let marker = if c.type_ == condition::DEGRADED && c.status == ConditionStatus::True { "!" } else { "" };
            t.add_row(vec![
                format!("{marker}{}", c.type_),
                c.status.to_string(),
                c.reason.clone(),
                age(Some(c.last_transition_time)),
                c.message.clone(),
            ]);
        }
        writeln!(out, "{}", indent(&t.to_string()))?;
    }
    writeln!(out, "Versions:")?;
    writeln!(out, "{}", indent(serde_saphyr::to_string(&s.versions)?.trim_end()))?;
    if let Some(e) = &s.etcd {
        writeln!(out, "etcd member:")?;
        writeln!(out, "{}", indent(serde_saphyr::to_string(e)?.trim_end()))?;
    }
    if let Some(f) = &s.facts {
        writeln!(out, "Facts:")?;
        writeln!(out, "{}", indent(serde_saphyr::to_string(f)?.trim_end()))?;
    }
    writeln!(out, "Spec:")?;
    writeln!(out, "{}", indent(serde_saphyr::to_string(&m.spec)?.trim_end()))?;
    writeln!(out, "Events:")?;
    if events.is_empty() {
        writeln!(out, "  <none>")?;
    } else {
        let recent = &events[events.len().saturating_sub(20)..];
        writeln!(out, "{}", indent(events_table(recent).trim_end()))?;
    }
    Ok(out)
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
}
