//! Operators' scripts: run as argv (no shell unless the script names one), in their own
//! process group so that a timeout kills everything they started, with their output captured
//! and cut to its last few KiB.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};

/// Output kept from each of stdout and stderr: the end, where failures are explained.
pub const OUTPUT_TAIL_BYTES: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptRun {
    /// Exit code; `None` when killed by a signal (including the timeout's).
    pub code: Option<i32>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl ScriptRun {
    pub fn succeeded(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }

    /// One line for an event or a condition: how it ended, then the output tails.
    pub fn summary(&self) -> String {
        let how = match (self.timed_out, self.code) {
            (true, _) => format!("timed out after {}s and was killed", self.elapsed.as_secs()),
            (false, Some(c)) => format!("exit status {c} after {:.1}s", self.elapsed.as_secs_f64()),
            (false, None) => "killed by a signal".to_owned(),
        };
        let mut out = how;
        for (label, text) in [("stdout", &self.stdout), ("stderr", &self.stderr)] {
            if !text.is_empty() {
                out.push_str(&format!("; {label}: {text}"));
            }
        }
        out
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{command}: could not start: {message}")]
pub struct SpawnError {
    pub command: String,
    pub message: String,
}

/// Keeps the last `limit` bytes of a stream, marking a cut with "…".
async fn read_tail(mut r: impl AsyncRead + Unpin, limit: usize) -> String {
    let mut kept: Vec<u8> = Vec::new();
    let mut cut = false;
    let mut buf = [0u8; 8192];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > limit {
                    kept.drain(..kept.len() - limit);
                    cut = true;
                }
            }
        }
    }
    let text = String::from_utf8_lossy(&kept);
    // A cut may fall inside a UTF-8 sequence; drop the replacement character it leaves.
    let text = if cut { format!("…{}", text.trim_start_matches('\u{fffd}')) } else { text.into_owned() };
    text.trim_end().to_owned()
}

/// Runs `argv` with `env` added to the agent's environment, killing its whole process group
/// after `timeout`.
pub async fn run(argv: &[String], env: &BTreeMap<String, String>, timeout: Duration) -> Result<ScriptRun, SpawnError> {
    let command = argv.join(" ");
    let Some((program, args)) = argv.split_first() else {
        return Err(SpawnError { command, message: "empty argv".into() });
    };
    let started = Instant::now();
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .envs(env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| SpawnError { command: command.clone(), message: e.to_string() })?;
    let pgid = child.id().map(|id| Pid::from_raw(id as i32));
    let stdout = tokio::spawn(read_tail(child.stdout.take().expect("stdout is piped"), OUTPUT_TAIL_BYTES));
    let stderr = tokio::spawn(read_tail(child.stderr.take().expect("stderr is piped"), OUTPUT_TAIL_BYTES));
    let (status, timed_out) = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(status) => (status.ok(), false),
        Err(_) => {
            if let Some(pg) = pgid {
                // The group may already be gone; either way nothing of it is left.
                let _ = killpg(pg, Signal::SIGKILL);
            }
            (child.wait().await.ok(), true)
        }
    };
    // Children that outlive the script keep the pipes open: kill what is left of the group
    // so the readers finish.
    if let Some(pg) = pgid {
        let _ = killpg(pg, Signal::SIGKILL);
    }
    Ok(ScriptRun {
        code: status.and_then(|s| s.code()),
        timed_out,
        stdout: stdout.await.unwrap_or_default(),
        stderr: stderr.await.unwrap_or_default(),
        elapsed: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[tokio::test]
    async fn captures_exit_code_output_and_environment() -> anyhow::Result<()> {
        let env = BTreeMap::from([("GREETING".to_owned(), "hello".to_owned())]);
        let r = run(&argv(&["sh", "-c", "echo $GREETING; echo oops >&2; exit 4"]), &env, Duration::from_secs(10)).await?;
        assert_eq!((r.code, r.timed_out, r.stdout.as_str(), r.stderr.as_str()), (Some(4), false, "hello", "oops"));
        assert!(!r.succeeded());
        assert!(r.summary().starts_with("exit status 4 after"), "{}", r.summary());
        assert!(r.summary().ends_with("; stdout: hello; stderr: oops"), "{}", r.summary());
        Ok(())
    }

    #[tokio::test]
    async fn a_timeout_kills_the_whole_group() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let marker = dir.path().join("survived");
        // The background child would write the marker after 2 s if it outlived the kill.
        let script = format!("(sleep 2; touch {}) & sleep 30", marker.display());
        let r = run(&argv(&["sh", "-c", &script]), &BTreeMap::new(), Duration::from_millis(300)).await?;
        assert!(r.timed_out && r.code.is_none(), "{r:?}");
        assert!(r.elapsed < Duration::from_secs(5), "{r:?}");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!marker.exists(), "a child of the timed-out script kept running");
        Ok(())
    }

    #[tokio::test]
    async fn output_is_cut_to_its_tail() -> anyhow::Result<()> {
        let r = run(&argv(&["sh", "-c", "seq 1 20000"]), &BTreeMap::new(), Duration::from_secs(10)).await?;
        assert!(r.succeeded());
        assert!(r.stdout.starts_with('…') && r.stdout.ends_with("19999\n20000"), "{}", &r.stdout[..20]);
        assert!(r.stdout.len() <= OUTPUT_TAIL_BYTES + '…'.len_utf8());
        Ok(())
    }

    #[tokio::test]
    async fn a_missing_program_is_a_spawn_error() {
        let err = run(&argv(&["/nonexistent/tool", "x"]), &BTreeMap::new(), Duration::from_secs(1)).await.err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.starts_with("/nonexistent/tool x: could not start")));
    }
}
