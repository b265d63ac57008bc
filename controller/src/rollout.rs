//! The rollout scheduler: which members of a pool get the pool's current revision now.
//!
//! A pure function of the pool's rollout settings, its members as last reported, the other
//! pools' progress and the persisted rollout state, so that it can be property-tested and a
//! controller restart changes nothing. The registry applies its decisions (see
//! `Registry::reconcile_pools`).
//!
//! The rules, in the order they apply:
//!
//! 1. A machine that joins the pool gets the current revision at once (it serves nothing yet;
//!    its disruptive steps still wait for a lease).
//! 2. Nothing moves while the pool is paused, while a pool named in `after` is not rolled out,
//!    or once `maxFailures` machines of the current revision are Degraded (halted).
//! 3. At most `maxUnavailable` members are unavailable: not Ready, unreachable, or given the
//!    current revision and not yet converged. Only the free slots are filled.
//! 4. Members go in order: `keelson.io/rollout-priority` (higher first), then the wave label's
//!    value, then name. With `canary`, the first K go alone; when they have converged, every
//!    updated machine must stay Ready for `soakSeconds` before the rest start. With
//!    `waveLabel`, a wave starts only when every member before it has converged.

use std::cmp::Reverse;

use keelson_api::meta::Timestamp;
use keelson_api::pool::RolloutSpec;
use serde::{Deserialize, Serialize};

/// A pool member as the scheduler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    pub priority: i64,
    /// The value of the pool's wave label ("" without one).
    pub wave: String,
    /// The pool revision of its spec; `None` for a machine that is joining the pool.
    pub revision: Option<u64>,
    /// Its agent has applied its current generation and reports UpToDate and Ready.
    pub converged: bool,
    /// Ready and reachable.
    pub ready: bool,
    /// Degraded at its current generation: the agent's message.
    pub failed: Option<String>,
}

/// What must survive a controller restart, stored per pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RolloutState {
    pub revision: u64,
    /// Since when every updated machine has been Ready after the canaries converged.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "time::serde::rfc3339::option")]
    pub soak_since: Option<Timestamp>,
    #[serde(default)]
    pub canary_passed: bool,
}

#[derive(Debug, Clone)]
pub struct Input<'a> {
    pub rollout: &'a RolloutSpec,
    pub revision: u64,
    pub members: &'a [Member],
    pub state: RolloutState,
    /// Pools named in `after` (and, for a pool of Kubernetes nodes, its cluster's
    /// control-plane pools) that have not rolled out.
    pub blocked_by: Vec<String>,
    /// Why the pool may not move yet for another reason (the version skew policy).
    pub held: Option<String>,
    pub now: Timestamp,
}

impl Input<'_> {
    /// Whether a maintenance window is open (always, without windows).
    fn window_open(&self) -> bool {
        keelson_api::window::any_open(&self.rollout.maintenance_windows, self.now)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    /// Give these the current revision now.
    pub update: Vec<String>,
    pub state: RolloutState,
    /// Halted: the failed machines and their reasons.
    pub halted: Option<String>,
    /// Every member runs the current revision, converged.
    pub rolled_out: bool,
    /// Why nothing (more) moves, when something holds it back.
    pub message: String,
    pub wave: Option<String>,
    pub counts: Counts,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub machines: u32,
    pub updated: u32,
    pub updating: u32,
    pub waiting: u32,
    pub ready: u32,
    pub degraded: u32,
    pub unavailable: u32,
    pub budget: u32,
}

/// Members in rollout order.
pub fn ordered(members: &[Member]) -> Vec<&Member> {
    let mut order: Vec<&Member> = members.iter().collect();
    order.sort_by(|a, b| (Reverse(a.priority), &a.wave, &a.name).cmp(&(Reverse(b.priority), &b.wave, &b.name)));
    order
}

pub fn schedule(input: Input<'_>) -> Decision {
    let window_open = input.window_open();
    let Input { rollout, revision, members, mut state, blocked_by, held, now } = input;
    if state.revision != revision {
        state = RolloutState { revision, ..RolloutState::default() };
    }
    let current = |m: &Member| m.revision == Some(revision);
    let done = |m: &Member| current(m) && m.converged;
    let order = ordered(members);
    let total = members.len();
    let budget = rollout.max_unavailable.resolve(total);
    let unavailable = members.iter().filter(|m| !m.ready || (current(m) && !m.converged)).count();
    let failed: Vec<&Member> = order.iter().copied().filter(|m| current(m) && m.failed.is_some()).collect();
    let counts = Counts {
        machines: total as u32,
        updated: members.iter().filter(|m| done(m)).count() as u32,
        updating: members.iter().filter(|m| current(m) && !m.converged && m.failed.is_none()).count() as u32,
        waiting: members.iter().filter(|m| !current(m)).count() as u32,
        ready: members.iter().filter(|m| m.ready).count() as u32,
        degraded: members.iter().filter(|m| m.failed.is_some()).count() as u32,
        unavailable: unavailable as u32,
        budget: budget as u32,
    };
    // Joiners get the current revision whatever else holds the rollout back.
    let joiners: Vec<String> = order.iter().filter(|m| m.revision.is_none()).map(|m| m.name.clone()).collect();
    let mut d = Decision { update: joiners, state, counts, ..Decision::default() };

    if members.iter().all(done) {
        d.rolled_out = true;
        return d;
    }
    if failed.len() >= rollout.max_failures as usize {
        let names = failed.iter().map(|m| format!("{}: {}", m.name, m.failed.as_deref().unwrap_or(""))).collect::<Vec<_>>().join("; ");
        d.halted = Some(format!("{} of revision {revision} failed (maxFailures {}): {names}", failed.len(), rollout.max_failures));
        d.message = "halted".into();
        return d;
    }
    if rollout.paused {
        d.message = "paused".into();
        return d;
    }
    if !blocked_by.is_empty() {
        d.message = format!("waiting for pool {} to roll out first", blocked_by.join(", "));
        return d;
    }
    if let Some(why) = held {
        d.message = why;
        return d;
    }
    if !window_open {
        d.message = format!("outside the maintenance windows ({})", keelson_api::window::describe(&rollout.maintenance_windows));
        return d;
    }

    // The candidates: the canaries until they pass, then the current wave.
    let mut candidates: Vec<&Member> = Vec::new();
    match &rollout.canary {
        Some(canary) if !d.state.canary_passed => {
            let canaries: Vec<&Member> = order.iter().copied().take((canary.machines as usize).min(total)).collect();
            if canaries.iter().all(|m| done(m)) {
                if members.iter().filter(|m| current(m)).any(|m| !m.ready) {
                    d.state.soak_since = None;
                    d.message = "canary soak: waiting for every updated machine to be Ready".into();
                    return d;
                }
                let since = *d.state.soak_since.get_or_insert(now);
                let elapsed = (now - since).whole_seconds().max(0) as u64;
                if elapsed < canary.soak_seconds {
                    d.message = format!("canary soak: {}s left", canary.soak_seconds - elapsed);
                    return d;
                }
                d.state.canary_passed = true;
            } else {
                d.message = format!("canary: {} machine(s) first", canaries.len());
                candidates = canaries;
            }
        }
        _ => {}
    }
    if candidates.is_empty() {
        candidates = match &rollout.wave_label {
            Some(_) => {
                let wave = order.iter().find(|m| !done(m)).map(|m| m.wave.clone()).unwrap_or_default();
                d.wave = Some(wave.clone());
                order.iter().copied().filter(|m| m.wave == wave).collect()
            }
            None => order.clone(),
        };
    }
    // A member that is unavailable already (a failed canary being undone, a machine that is
    // down) takes the revision without using a slot: updating it disrupts nothing more.
    let mut slots = budget.saturating_sub(unavailable);
    let mut next: Vec<String> = Vec::new();
    for m in candidates.iter().filter(|m| m.revision.is_some() && !current(m)) {
        if !m.ready {
            next.push(m.name.clone());
        } else if slots > 0 {
            slots -= 1;
            next.push(m.name.clone());
        }
    }
    if next.is_empty() && d.message.is_empty() {
        d.message = if slots == 0 {
            format!("{unavailable} of {budget} allowed unavailable")
        } else {
            "waiting for updated machines to converge".into()
        };
    }
    d.update.extend(next);
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use keelson_api::pool::{CanarySpec, IntOrPercent};
    use proptest::prelude::*;

    fn member(name: &str, revision: Option<u64>) -> Member {
        Member { name: name.into(), priority: 0, wave: String::new(), revision, converged: true, ready: true, failed: None }
    }

    fn t(secs: i64) -> Timestamp {
        time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(1_800_000_000 + secs)
    }

    fn run(rollout: &RolloutSpec, members: &[Member], state: RolloutState, now: i64) -> Decision {
        schedule(Input { rollout, revision: 2, members, state, blocked_by: Vec::new(), held: None, now: t(now) })
    }

    #[test]
    fn one_at_a_time_in_priority_then_wave_then_name_order() {
        let rollout = RolloutSpec { wave_label: Some("rack".into()), ..RolloutSpec::default() };
        let mut ms = vec![member("a", Some(1)), member("b", Some(1)), member("c", Some(1)), member("d", Some(1))];
        ms[0].wave = "r2".into();
        ms[1].wave = "r1".into();
        ms[2].wave = "r2".into();
        ms[3].wave = "r1".into();
        ms[2].priority = 5;
        // c has priority: it goes first, alone in its wave.
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert_eq!((d.update, d.wave.as_deref()), (vec!["c".to_owned()], Some("r2")));
        // c done: wave r1 (b, d) comes before wave r2 (a).
        ms[2].revision = Some(2);
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert_eq!((d.update, d.wave.as_deref()), (vec!["b".to_owned()], Some("r1")));
        // b updating: the budget is used up.
        ms[1].revision = Some(2);
        ms[1].converged = false;
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert!(d.update.is_empty());
        assert_eq!(d.message, "1 of 1 allowed unavailable");
        ms[1].converged = true;
        assert_eq!(run(&rollout, &ms, RolloutState::default(), 0).update, vec!["d"]);
        ms[3].revision = Some(2);
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert_eq!((d.update, d.wave.as_deref()), (vec!["a".to_owned()], Some("r2")));
    }

    #[test]
    fn a_member_that_is_down_takes_the_revision_without_a_slot() {
        // The canary failed the last revision and holds the only slot; the undo must reach it.
        let rollout = RolloutSpec { canary: Some(CanarySpec { machines: 1, soak_seconds: 0 }), ..RolloutSpec::default() };
        let mut ms = vec![member("a", Some(1)), member("b", Some(2)), member("c", Some(2))];
        ms[0].ready = false;
        ms[0].converged = false;
        ms[0].failed = Some("apt: version X of containerd not found".into());
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert_eq!(d.update, vec!["a"]);
        assert!(d.halted.is_none(), "a failure of another revision does not halt this one");
    }

    #[test]
    fn canaries_go_alone_then_soak() {
        let rollout = RolloutSpec {
            canary: Some(CanarySpec { machines: 1, soak_seconds: 60 }),
            max_unavailable: IntOrPercent::Int(2),
            ..RolloutSpec::default()
        };
        let mut ms = vec![member("a", Some(1)), member("b", Some(1)), member("c", Some(1))];
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert_eq!(d.update, vec!["a"], "only the canary, though the budget allows two");
        ms[0].revision = Some(2);
        let d = run(&rollout, &ms, d.state, 10);
        assert!(d.update.is_empty());
        assert_eq!(d.message, "canary soak: 60s left");
        let d = run(&rollout, &ms, d.state, 69);
        assert_eq!(d.message, "canary soak: 1s left");
        // The canary stops being Ready: the soak starts again when it is back.
        ms[0].ready = false;
        let state = run(&rollout, &ms, d.state, 70).state;
        assert_eq!(state.soak_since, None);
        ms[0].ready = true;
        let d = run(&rollout, &ms, state, 80);
        assert_eq!(d.message, "canary soak: 60s left");
        let d = run(&rollout, &ms, d.state, 140);
        assert!(d.state.canary_passed);
        assert_eq!(d.update, vec!["b", "c"]);
    }

    #[test]
    fn halts_at_max_failures_and_joiners_still_get_the_revision() {
        let rollout = RolloutSpec { max_unavailable: IntOrPercent::Int(3), max_failures: 2, ..RolloutSpec::default() };
        let mut ms = vec![member("a", Some(2)), member("b", Some(1)), member("c", Some(1)), member("d", Some(1)), member("new", None)];
        ms[0].converged = false;
        ms[0].ready = false;
        ms[0].failed = Some("apt: version X of containerd not found".into());
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert!(d.halted.is_none(), "one failure of two allowed");
        assert_eq!(d.update, vec!["new", "b", "c"]);
        ms[1].revision = Some(2);
        ms[1].converged = false;
        ms[1].failed = Some("boom".into());
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert_eq!(d.update, vec!["new"]);
        assert_eq!(d.halted.as_deref(), Some("2 of revision 2 failed (maxFailures 2): a: apt: version X of containerd not found; b: boom"));
    }

    #[test]
    fn nothing_starts_outside_the_maintenance_windows() {
        let window: keelson_api::window::MaintenanceWindow =
            serde_json::from_value(serde_json::json!({"days": ["Mon"], "start": "22:00", "end": "23:00"}))
                .unwrap_or_else(|e| panic!("{e}"));
        let rollout = RolloutSpec { maintenance_windows: vec![window], ..RolloutSpec::default() };
        let ms = vec![member("a", Some(1)), member("new", None)];
        // t(0) is 2027-01-15 08:00 UTC, a Friday.
        let d = run(&rollout, &ms, RolloutState::default(), 0);
        assert_eq!(d.update, vec!["new"], "joiners only");
        assert_eq!(d.message, "outside the maintenance windows (Mon 22:00–23:00 UTC)");
        // Monday 2027-01-18 22:30 UTC.
        let monday = (3 * 24 + 14) * 3600 + 30 * 60;
        assert_eq!(run(&rollout, &ms, RolloutState::default(), monday).update, vec!["new", "a"]);
    }

    #[test]
    fn paused_and_blocked_pools_wait() {
        let ms = vec![member("a", Some(1))];
        let paused = RolloutSpec { paused: true, ..RolloutSpec::default() };
        assert_eq!(run(&paused, &ms, RolloutState::default(), 0).message, "paused");
        let d = schedule(Input {
            rollout: &RolloutSpec::default(),
            revision: 2,
            members: &ms,
            state: RolloutState::default(),
            blocked_by: vec!["etcd".into()],
            held: None,
            now: t(0),
        });
        assert_eq!((d.update.len(), d.message.as_str()), (0, "waiting for pool etcd to roll out first"));
    }

    // -----------------------------------------------------------------------------------------
    // Property tests: a simulated pool under arbitrary events, the scheduler run after each.

    #[derive(Debug, Clone)]
    enum Event {
        /// An updating machine converges (or fails, when `fail`).
        Finish { index: usize, fail: bool },
        /// A machine stops being Ready (unreachable, or a component down), or comes back.
        Flap { index: usize, ready: bool },
        /// Time passes.
        Wait { secs: i64 },
        /// The controller restarts: only the persisted state survives (it is all there is).
        Restart,
    }

    fn arb_event(n: usize) -> impl Strategy<Value = Event> {
        prop_oneof![
            4 => (0..n, prop::bool::weighted(0.15)).prop_map(|(index, fail)| Event::Finish { index, fail }),
            2 => (0..n, any::<bool>()).prop_map(|(index, ready)| Event::Flap { index, ready }),
            2 => (1i64..90).prop_map(|secs| Event::Wait { secs }),
            1 => Just(Event::Restart),
        ]
    }

    fn arb_rollout() -> impl Strategy<Value = RolloutSpec> {
        (1u32..4, 1u32..4, proptest::option::of((1u32..3, 0u64..120)), any::<bool>()).prop_map(
            |(max_unavailable, max_failures, canary, waves)| RolloutSpec {
                max_unavailable: IntOrPercent::Int(max_unavailable),
                max_failures,
                canary: canary.map(|(machines, soak_seconds)| CanarySpec { machines, soak_seconds }),
                wave_label: waves.then(|| "rack".to_owned()),
                ..RolloutSpec::default()
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn the_scheduler_keeps_every_promise(
            rollout in arb_rollout(),
            n in 2usize..8,
            events in proptest::collection::vec(arb_event(8), 1..80),
            blocked_for in 0usize..20,
        ) {
            let mut ms: Vec<Member> = (0..n).map(|i| Member { wave: format!("r{}", i % 3), ..member(&format!("m{i}"), Some(1)) }).collect();
            let budget = rollout.max_unavailable.resolve(n);
            let canaries: Vec<String> = ordered(&ms).iter().take(rollout.canary.as_ref().map_or(0, |c| c.machines as usize)).map(|m| m.name.clone()).collect();
            let mut state = RolloutState::default();
            let mut now = 0i64;
            for (step, event) in events.iter().enumerate() {
                match *event {
                    Event::Finish { index, fail } if index < n && ms[index].revision == Some(2) && !ms[index].converged && ms[index].failed.is_none() => {
                        if fail { ms[index].failed = Some("failed".into()); ms[index].ready = false; } else { ms[index].converged = true; ms[index].ready = true; }
                    }
                    Event::Flap { index, ready } if index < n && ms[index].failed.is_none() => ms[index].ready = ready,
                    Event::Wait { secs } => now += secs,
                    Event::Restart => state = serde_json::from_str(&serde_json::to_string(&state).unwrap_or_default()).unwrap_or_default(),
                    _ => {}
                }
                let blocked = step < blocked_for;
                let before_unavailable = ms.iter().filter(|m| !m.ready || (m.revision == Some(2) && !m.converged)).count();
                let failed = ms.iter().filter(|m| m.revision == Some(2) && m.failed.is_some()).count();
                let d = schedule(Input {
                    rollout: &rollout,
                    revision: 2,
                    members: &ms,
                    state: state.clone(),
                    blocked_by: if blocked { vec!["before".into()] } else { Vec::new() },
                    held: None,
                    now: t(now),
                });
                // Never more disrupted than the budget allows because of the scheduler: only
                // machines that are available now become unavailable by being updated.
                let newly = d.update.iter().filter(|n| ms.iter().any(|m| &&m.name == n && m.ready && m.revision.is_some())).count();
                prop_assert!(newly == 0 || before_unavailable + newly <= budget,
                    "{} unavailable + {:?} over budget {budget}", before_unavailable, d.update);
                // Never before the pools it follows.
                prop_assert!(!blocked || d.update.is_empty());
                // Halts exactly at maxFailures.
                if failed >= rollout.max_failures as usize {
                    prop_assert!(d.update.is_empty() && d.halted.is_some());
                } else {
                    prop_assert!(d.halted.is_none());
                }
                // Nothing beyond the canaries before their soak has passed.
                if rollout.canary.is_some() && !d.state.canary_passed {
                    prop_assert!(d.update.iter().all(|name| canaries.contains(name)), "{:?} before the canaries passed", d.update);
                }
                if d.state.canary_passed && !state.canary_passed && let Some(c) = &rollout.canary {
                    let since = d.state.soak_since.map(|s| (t(now) - s).whole_seconds()).unwrap_or(-1);
                    prop_assert!(since >= c.soak_seconds as i64, "soak passed after {since}s of {}", c.soak_seconds);
                }
                for name in &d.update {
                    if let Some(m) = ms.iter_mut().find(|m| &m.name == name) {
                        m.revision = Some(2);
                        m.converged = false;
                    }
                }
                state = d.state;
            }
        }
    }
}
