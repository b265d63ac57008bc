//! keelson-agent: argument parsing and logging; the work is in the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use keelson_agent::enroll::{EnrollOptions, default_name, enroll};

#[derive(Parser)]
#[command(name = "keelson-agent", version, about = "keelson node agent")]
struct Cli {
    /// Where the agent keeps its identity and state.
    #[arg(long, default_value = "/var/lib/keelson", global = true)]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Enroll this machine: make a key here, send a CSR with a bootstrap token, keep the certificate.
    Enroll {
        /// Controller URL, e.g. https://controller:9443
        #[arg(long)]
        server: String,
        /// The controller's CA certificate (DATA_DIR/ca.crt on the controller).
        #[arg(long)]
        ca_file: PathBuf,
        /// Bootstrap token (kst.<id>.<secret>).
        #[arg(long, env = "KEELSON_TOKEN", hide_env_values = true)]
        token: String,
        /// Machine name; the host name by default.
        #[arg(long)]
        name: Option<String>,
    },
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
    let result: anyhow::Result<()> = runtime.block_on(async {
        match cli.command {
            Command::Enroll { server, ca_file, token, name } => {
                let name = match name {
                    Some(n) => keelson_api::validate::parse_name("--name", &n)?,
                    None => default_name()?,
                };
                let answer = enroll(&EnrollOptions { server, ca_file, token, name, state_dir: cli.state_dir }).await?;
                println!("{}", answer.name);
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keelson-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
