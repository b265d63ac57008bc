//! keelson-agent: argument parsing, logging and signals; the work is in the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use keelson_agent::config::{self, DEFAULT_CONFIG};
use keelson_agent::enroll::{EnrollOptions, default_name, enroll};
use keelson_agent::{daemon, journal, observe, plan};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "keelson-agent", version, about = "keelson node agent: keeps this machine in its declared state")]
struct Cli {
    /// Configuration file; `agent.d/*.toml` beside it are merged in name order.
    #[arg(long, default_value = DEFAULT_CONFIG, global = true)]
    config: PathBuf,
    /// Where the agent keeps its identity and journal (overrides the configuration).
    #[arg(long, global = true)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent (as the systemd service does).
    Run,
    /// Enroll this machine: make a key here, send a CSR with a bootstrap token, keep the certificate.
    Enroll {
        #[arg(long)]
        server: String,
        #[arg(long)]
        ca_file: PathBuf,
        #[arg(long, env = "KEELSON_TOKEN", hide_env_values = true)]
        token: String,
        /// Machine name; the host name by default.
        #[arg(long)]
        name: Option<String>,
    },
    /// Print the steps that would bring this machine to its spec, without acting.
    /// Exit 0: nothing to do; 2: steps pending; 1: error.
    Plan {
        /// A Machine (YAML or JSON) to plan for; without it, the spec is fetched from the controller.
        #[arg(long)]
        spec: Option<PathBuf>,
    },
    /// Show the journal: the generation being applied and how far it got.
    Status,
    /// Undo what keelson put on this machine (kubelet, containerd, holds, repositories, managed
    /// files) and forget its identity, without asking the controller. Deleting the machine
    /// (`keelson delete machine NAME`) makes a running agent do this by itself.
    Reset {
        /// Confirm: this stops the kubelet and containerd and removes them.
        #[arg(long)]
        yes: bool,
    },
}

fn init_logging(level: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::prelude::*;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let journald = std::env::var_os("JOURNAL_STREAM").and_then(|_| tracing_journald::layer().ok());
    let registry = tracing_subscriber::registry().with(filter);
    match journald {
        Some(layer) => registry.with(layer).init(),
        None => {
            registry.with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal())).init()
        }
    }
}

fn load_spec_file(path: &PathBuf) -> anyhow::Result<keelson_api::machine::MachineSpec> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let resources = keelson_api::decode::resources_from_text(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    match resources.into_iter().next() {
        Some(keelson_api::decode::Resource::Machine(m)) => Ok(m.spec),
        _ => anyhow::bail!("{}: expected a Machine", path.display()),
    }
}

async fn plan_command(cli: &Cli, spec: &Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let (generation, spec) = match spec {
        Some(path) => (0, load_spec_file(path)?),
        None => {
            let config = config::load(&cli.config, cli.state_dir.as_deref())?;
            let controller = keelson_agent::client::Controller::from_state(&config.state_dir, &config.servers)?;
            let answer = controller.spec(0, std::time::Duration::from_secs(1)).await?;
            (answer.generation, answer.spec)
        }
    };
    let state_dir = cli.state_dir.clone().unwrap_or_else(|| config::DEFAULT_STATE_DIR.into());
    let ledger = keelson_agent::ledger::Ledger::load(&state_dir)?;
    let observed = observe::observe(std::path::Path::new("/"), &ledger, &spec)?;
    let rebooted_for = journal::Journal::load(&state_dir).ok().flatten().and_then(|j| j.rebooted_for_generation);
    let config = config::load(&cli.config, cli.state_dir.as_deref()).ok();
    let name = match config.as_ref().and_then(|c| c.name.clone()) {
        Some(n) => n,
        None => keelson_agent::enroll::default_name()?,
    };
    let ctx = plan::Context {
        generation,
        rebooted_for_generation: rebooted_for,
        name: name.to_string(),
        etcd_address: keelson_agent::facts::etcd_address(config.as_ref().and_then(|c| c.etcd_advertise_address)),
    };
    let steps = plan::plan(&spec, &observed, &ctx)?;
    if steps.is_empty() {
        println!("nothing to do");
        return Ok(ExitCode::SUCCESS);
    }
    for (i, s) in steps.iter().enumerate() {
        println!("{}/{} {}{}", i + 1, steps.len(), s.description, if s.disruptive { " (disruptive)" } else { "" });
    }
    Ok(ExitCode::from(2))
}

fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("keelson-agent: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: anyhow::Result<ExitCode> = runtime.block_on(async {
        match &cli.command {
            Command::Run => {
                let config = config::load(&cli.config, cli.state_dir.as_deref())?;
                init_logging(&config.log_level);
                let cancel = CancellationToken::new();
                let on_signal = cancel.clone();
                tokio::spawn(async move {
                    use tokio::signal::unix::{SignalKind, signal};
                    if let Ok(mut term) = signal(SignalKind::terminate()) {
                        tokio::select! {
                            _ = term.recv() => {}
                            _ = tokio::signal::ctrl_c() => {}
                        }
                        tracing::info!("stopping: finishing the current step");
                        on_signal.cancel();
                    }
                });
                daemon::run(config, cancel).await?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Enroll { server, ca_file, token, name } => {
                let name = match name {
                    Some(n) => keelson_api::validate::parse_name("--name", n)?,
                    None => default_name()?,
                };
                let state_dir = cli.state_dir.clone().unwrap_or_else(|| config::DEFAULT_STATE_DIR.into());
                let answer =
                    enroll(&EnrollOptions { server: server.clone(), ca_file: ca_file.clone(), token: token.clone(), name, state_dir })
                        .await?;
                println!("{}", answer.name);
                Ok(ExitCode::SUCCESS)
            }
            Command::Plan { spec } => plan_command(&cli, spec).await,
            Command::Reset { yes } => {
                if !yes {
                    anyhow::bail!("reset stops and removes the kubelet and containerd keelson installed and forgets this machine's identity; run it with --yes");
                }
                let state_dir = cli.state_dir.clone().unwrap_or_else(|| config::DEFAULT_STATE_DIR.into());
                let reset = keelson_agent::reset::reset_machine(&state_dir).await;
                keelson_agent::reset::forget_identity(&state_dir)?;
                println!("{}", reset.summary());
                Ok(if reset.failed.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
            }
            Command::Status => {
                let state_dir = cli.state_dir.clone().unwrap_or_else(|| config::DEFAULT_STATE_DIR.into());
                match journal::Journal::load(&state_dir)? {
                    None => println!("no journal: nothing applied yet"),
                    Some(j) => {
                        println!(
                            "generation {}: step {} of {}{}",
                            j.generation,
                            j.next.min(j.steps.len()),
                            j.steps.len(),
                            j.failed.as_ref().map(|f| format!(" — failed: {f}")).unwrap_or_default()
                        );
                        for (i, s) in j.steps.iter().enumerate() {
                            let mark = if i < j.next {
                                "done"
                            } else if i == j.next {
                                "next"
                            } else {
                                ""
                            };
                            println!("  {}/{} {:<4} {}", i + 1, j.steps.len(), mark, s.description);
                        }
                    }
                }
                Ok(ExitCode::SUCCESS)
            }
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keelson-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
