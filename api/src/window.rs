//! Maintenance windows: when a pool's machines may start something disruptive.
//!
//! A window opens on each of its `days` at `start` (local time in `timeZone`) and lasts until
//! `end`; an `end` at or before `start` means the next day (`22:00`–`04:00`). Local times that
//! a daylight-saving change skips or repeats are resolved the way `jiff` resolves them
//! (compatible: a skipped time moves forward, a repeated one takes the earlier).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::meta::Timestamp;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MaintenanceWindow {
    pub days: Vec<Weekday>,
    pub start: ClockTime,
    pub end: ClockTime,
    /// An IANA time zone such as `Europe/Berlin`; `UTC` when not given.
    #[serde(default = "utc")]
    pub time_zone: String,
}

fn utc() -> String {
    "UTC".into()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Weekday {
    Mon,
    Tue,
    Wed,
    Thu,
    Fri,
    Sat,
    Sun,
}

impl Weekday {
    fn to_jiff(self) -> jiff::civil::Weekday {
        use jiff::civil::Weekday as W;
        match self {
            Weekday::Mon => W::Monday,
            Weekday::Tue => W::Tuesday,
            Weekday::Wed => W::Wednesday,
            Weekday::Thu => W::Thursday,
            Weekday::Fri => W::Friday,
            Weekday::Sat => W::Saturday,
            Weekday::Sun => W::Sunday,
        }
    }
}

/// `HH:MM`, 24-hour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClockTime {
    pub hour: u8,
    pub minute: u8,
}

impl FromStr for ClockTime {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not a time of day such as \"22:00\"");
        let (h, m) = s.split_once(':').ok_or_else(bad)?;
        if h.len() != 2 || m.len() != 2 {
            return Err(bad());
        }
        let (hour, minute): (u8, u8) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
        if hour > 23 || minute > 59 {
            return Err(bad());
        }
        Ok(ClockTime { hour, minute })
    }
}

impl fmt::Display for ClockTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02}:{:02}", self.hour, self.minute)
    }
}

impl Serialize for ClockTime {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ClockTime {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Checks that a time zone name is known.
pub fn check_time_zone(name: &str) -> Result<(), String> {
    jiff::tz::TimeZone::get(name)
        .map(|_| ())
        .map_err(|_| format!("{name:?} is not a known time zone (such as \"Europe/Berlin\" or \"UTC\")"))
}

fn to_jiff(t: Timestamp) -> Option<jiff::Timestamp> {
    jiff::Timestamp::from_nanosecond(t.unix_timestamp_nanos()).ok()
}

impl MaintenanceWindow {
    /// Whether the window is open at `now`. An unknown time zone never opens (validation
    /// refuses one before it is stored).
    pub fn is_open(&self, now: Timestamp) -> bool {
        let (Ok(tz), Some(now)) = (jiff::tz::TimeZone::get(&self.time_zone), to_jiff(now)) else { return false };
        let local = now.to_zoned(tz.clone());
        let today = local.date();
        // A window that crosses midnight may have opened yesterday.
        [today.yesterday().ok(), Some(today)].into_iter().flatten().any(|day| {
            if !self.days.iter().any(|d| d.to_jiff() == day.weekday()) {
                return false;
            }
            let at = |t: ClockTime, date: jiff::civil::Date| date.at(t.hour as i8, t.minute as i8, 0, 0).to_zoned(tz.clone()).ok();
            let end_day = if self.end <= self.start { day.tomorrow().ok() } else { Some(day) };
            match (at(self.start, day), end_day.and_then(|d| at(self.end, d))) {
                (Some(open), Some(close)) => open.timestamp() <= now && now < close.timestamp(),
                _ => false,
            }
        })
    }
}

/// Whether any of `windows` is open; no windows means always.
pub fn any_open(windows: &[MaintenanceWindow], now: Timestamp) -> bool {
    windows.is_empty() || windows.iter().any(|w| w.is_open(now))
}

/// The windows in words, for a message: `Mon,Tue 22:00–04:00 Europe/Berlin`.
pub fn describe(windows: &[MaintenanceWindow]) -> String {
    windows
        .iter()
        .map(|w| {
            let days = w.days.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(",");
            format!("{days} {}–{} {}", w.start, w.end, w.time_zone)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(rfc3339: &str) -> Timestamp {
        Timestamp::parse(rfc3339, &time::format_description::well_known::Rfc3339).unwrap_or_else(|e| panic!("{e}"))
    }

    fn window(days: &[Weekday], start: &str, end: &str, tz: &str) -> MaintenanceWindow {
        MaintenanceWindow {
            days: days.to_vec(),
            start: start.parse().unwrap_or_else(|e| panic!("{e}")),
            end: end.parse().unwrap_or_else(|e| panic!("{e}")),
            time_zone: tz.into(),
        }
    }

    #[test]
    fn a_window_across_midnight_in_a_time_zone() {
        // Tuesday 22:00 to Wednesday 04:00 in Berlin (UTC+1 in December).
        let w = window(&[Weekday::Tue], "22:00", "04:00", "Europe/Berlin");
        assert!(!w.is_open(at("2026-12-01T20:59:00Z")), "Tue 21:59 Berlin");
        assert!(w.is_open(at("2026-12-01T21:00:00Z")), "Tue 22:00 Berlin");
        assert!(w.is_open(at("2026-12-02T02:59:00Z")), "Wed 03:59 Berlin");
        assert!(!w.is_open(at("2026-12-02T03:00:00Z")), "Wed 04:00 Berlin");
        assert!(!w.is_open(at("2026-12-02T21:30:00Z")), "Wed 22:30 Berlin is not a Tuesday");
    }

    #[test]
    fn daylight_saving_moves_the_window_with_local_time() {
        // Sundays 01:00–05:00 in Berlin: on 2026-03-29 clocks go 02:00 → 03:00 (UTC+1 → UTC+2).
        let w = window(&[Weekday::Sun], "01:00", "05:00", "Europe/Berlin");
        assert!(w.is_open(at("2026-03-29T00:00:00Z")), "01:00 CET");
        assert!(w.is_open(at("2026-03-29T02:59:00Z")), "04:59 CEST");
        assert!(!w.is_open(at("2026-03-29T03:00:00Z")), "05:00 CEST");
        assert!(!w.is_open(at("2026-03-22T04:00:00Z")), "05:00 CET a week before");
    }

    #[test]
    fn parsing_and_checks() {
        assert!("24:00".parse::<ClockTime>().is_err());
        assert!("7:00".parse::<ClockTime>().is_err());
        assert_eq!("07:05".parse::<ClockTime>().map(|t| t.to_string()), Ok("07:05".to_owned()));
        assert!(check_time_zone("Europe/Berlin").is_ok());
        assert!(check_time_zone("Mars/Olympus").is_err());
        assert!(any_open(&[], at("2026-12-01T00:00:00Z")));
        assert_eq!(describe(&[window(&[Weekday::Mon, Weekday::Tue], "22:00", "04:00", "UTC")]), "Mon,Tue 22:00–04:00 UTC");
    }
}
