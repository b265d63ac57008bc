//! Running an external command: argv, a timeout, and an error that names the command and
//! quotes the end of its stderr.

use std::time::Duration;

/// Stderr kept in an error message.
const STDERR_TAIL_BYTES: usize = 2048;

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("{command}: could not start: {message}")]
    Spawn { command: String, message: String },
    #[error("{command}: timed out after {seconds}s")]
    Timeout { command: String, seconds: u64 },
    #[error("{command}: exit status {code}: {stderr}")]
    Failed { command: String, code: i32, stderr: String },
}

pub fn display(argv: &[&str]) -> String {
    argv.join(" ")
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    if text.len() <= STDERR_TAIL_BYTES {
        return text.to_owned();
    }
    let mut start = text.len() - STDERR_TAIL_BYTES;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

/// Runs `argv` with extra environment, returning stdout on success.
pub async fn run(argv: &[&str], env: &[(&str, &str)], timeout: Duration) -> Result<String, CommandError> {
    let command = display(argv);
    let mut cmd = tokio::process::Command::new(argv[0]);
    cmd.args(&argv[1..]).kill_on_drop(true).stdin(std::process::Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.output();
    let output = match tokio::time::timeout(timeout, child).await {
        Err(_) => return Err(CommandError::Timeout { command, seconds: timeout.as_secs() }),
        Ok(Err(e)) => return Err(CommandError::Spawn { command, message: e.to_string() }),
        Ok(Ok(o)) => o,
    };
    if !output.status.success() {
        let stderr = if output.stderr.is_empty() { tail(&output.stdout) } else { tail(&output.stderr) };
        return Err(CommandError::Failed { command, code: output.status.code().unwrap_or(-1), stderr });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn failures_name_the_command_and_quote_stderr() {
        let err = run(&["sh", "-c", "echo boom >&2; exit 3"], &[], Duration::from_secs(5)).await.err().map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("sh -c echo boom >&2; exit 3: exit status 3: boom"));
        let err = run(&["sleep", "5"], &[], Duration::from_millis(100)).await.err().map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("sleep 5: timed out after 0s"));
        assert_eq!(run(&["echo", "hi"], &[], Duration::from_secs(5)).await.ok().as_deref(), Some("hi\n"));
    }
}
