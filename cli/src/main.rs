//! keelson: the operator CLI.

mod client;
mod output;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, anyhow, bail};
use clap::{Parser, Subcommand, ValueEnum};
use keelson_api::cluster::{ClusterSpec, KubernetesCluster};
use keelson_api::decode::{Resource, resources_from_text};
use keelson_api::machine::Machine;
use keelson_api::pool::{MachinePool, PoolRevision};
use keelson_api::token::BootstrapToken;
use keelson_api::validate::{parse_name, validate_cluster};
use keelson_api::wire::{Event, List, TokenCreated, TokenRequest};
use reqwest::Method;

use client::Client;
use output::Format;

#[derive(Parser)]
#[command(name = "keelson", version, about = "Operate a keelson fleet")]
struct Cli {
    /// Credential file (the controller writes one as DATA_DIR/admin.conf).
    #[arg(long, env = "KEELSON_CONFIG", global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or update the resources in a YAML or JSON file ("-" reads standard input).
    Apply {
        #[arg(short = 'f', long = "filename")]
        file: String,
    },
    /// List resources, or show one.
    Get {
        kind: Kind,
        name: Option<String>,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Format,
    },
    /// Show a machine in detail: spec, status, conditions with reasons, recent events.
    Describe { kind: DescribeKind, name: String },
    /// Delete a resource. An enrolled machine is reset by its agent first, then goes.
    Delete {
        kind: Kind,
        name: String,
        /// A machine: delete it at once, without its agent's reset (it is gone for good).
        #[arg(long)]
        force: bool,
        /// A machine running an etcd member: the member leaves its cluster even when that
        /// costs the cluster its quorum, or it is the last member (its data goes with it).
        /// Also for a machine already being deleted whose removal was refused.
        #[arg(long, conflicts_with = "force")]
        force_etcd_leave: bool,
    },
    /// Kubernetes clusters whose nodes are keelson machines.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Bootstrap tokens.
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// A machine's step history: `keelson events machine/NAME`.
    Events {
        target: String,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Format,
    },
    /// A pool's rollout: `keelson rollout status pool/NAME`.
    Rollout {
        #[command(subcommand)]
        command: RolloutCommand,
    },
    /// etcd clusters that keelson runs.
    Etcd {
        #[command(subcommand)]
        command: EtcdCommand,
    },
}

#[derive(Subcommand)]
enum EtcdCommand {
    /// A client certificate for an etcd cluster (for kube-apiserver or etcdctl): the key is
    /// made here and never leaves this machine. Writes ca.crt, client.crt and client.key
    /// (0600) into --out.
    ClientCert {
        /// The pool whose template declares the cluster.
        #[arg(long, required_unless_present = "cluster", conflicts_with = "cluster")]
        pool: Option<String>,
        /// The cluster by name (`spec.etcd.cluster`).
        #[arg(long)]
        cluster: Option<String>,
        #[arg(long)]
        out: PathBuf,
        /// The certificate's common name.
        #[arg(long, default_value = "kube-apiserver")]
        name: String,
    },
    /// The members of an etcd pool's cluster as its machines report them: quorum, leader,
    /// versions, raft indexes, database sizes, alarms, health, client endpoints.
    Members {
        #[arg(long)]
        pool: String,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Format,
    },
}

#[derive(Subcommand)]
enum RolloutCommand {
    /// Progress of the current revision; exits non-zero when the rollout has halted.
    Status {
        target: String,
        /// Follow the rollout until it completes (exit 0) or halts (exit 1).
        #[arg(short, long)]
        watch: bool,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Format,
    },
    /// The pool's kept revisions and what made each.
    History {
        target: String,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Format,
    },
    /// Stop giving machines the current revision (machines mid-update finish).
    Pause { target: String },
    /// Carry on after a pause.
    Resume { target: String },
    /// Roll back to an earlier revision (by default the one before), at the pool's pace.
    Undo {
        target: String,
        #[arg(long)]
        to_revision: Option<u64>,
    },
}

/// `pool/NAME` → NAME, checked.
fn pool_target(target: &str) -> anyhow::Result<&str> {
    let name = target.strip_prefix("pool/").ok_or_else(|| anyhow!("{target:?}: expected pool/NAME"))?;
    parse_name("NAME", name)?;
    Ok(name)
}

async fn rollout(command: &RolloutCommand, connect: impl Fn() -> anyhow::Result<Client>) -> anyhow::Result<()> {
    match command {
        RolloutCommand::Status { target, watch, output } => {
            let name = pool_target(target)?;
            let client = connect()?;
            let path = format!("/v1/pools/{name}");
            let mut last = String::new();
            loop {
                let pool: MachinePool = client.call(Method::GET, &path, None::<&()>).await?;
                let progress = output::rollout_progress(&pool);
                if matches!(output, Format::Json | Format::Yaml) {
                    print!("{}", output::structured(&pool.status, *output)?);
                } else if progress.line != last {
                    println!("{}", progress.line);
                    last = progress.line.clone();
                }
                if let Some(why) = progress.halted {
                    bail!("rollout of pool {name} halted: {why}");
                }
                if progress.complete || !watch {
                    return Ok(());
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
        RolloutCommand::History { target, output } => {
            let name = pool_target(target)?;
            let client = connect()?;
            let history: Vec<PoolRevision> = client.call(Method::GET, &format!("/v1/pools/{name}/revisions"), None::<&()>).await?;
            match output {
                Format::Json | Format::Yaml => print!("{}", output::structured(&history, *output)?),
                _ => print!("{}", output::history_table(&history)),
            }
        }
        RolloutCommand::Pause { target } | RolloutCommand::Resume { target } => {
            let name = pool_target(target)?;
            let verb = if matches!(command, RolloutCommand::Pause { .. }) { "pause" } else { "resume" };
            let client = connect()?;
            let _: MachinePool =
                client.call(Method::POST, &format!("/v1/pools/{name}/rollout/{verb}"), Some(&serde_json::json!({}))).await?;
            println!("pool/{name} {verb}d");
        }
        RolloutCommand::Undo { target, to_revision } => {
            let name = pool_target(target)?;
            let client = connect()?;
            let body = serde_json::json!({"toRevision": to_revision});
            let pool: MachinePool = client.call(Method::POST, &format!("/v1/pools/{name}/rollout/undo"), Some(&body)).await?;
            println!("pool/{name} rolled back: revision {} is rolling out", pool.status.revision);
        }
    }
    Ok(())
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Register a cluster, or replace its kubeconfig. The kubeconfig must embed its CA and
    /// credentials (`kubectl config view --raw --flatten`); it stays on the controller.
    Register {
        name: String,
        #[arg(long)]
        kubeconfig: PathBuf,
        /// The kubeconfig context to use; its current-context by default.
        #[arg(long)]
        context: Option<String>,
    },
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Create a token; the whole token is shown this once.
    Create {
        /// Lifetime: 90s, 30m, 24h, 7d.
        #[arg(long, default_value = "24h")]
        ttl: String,
        /// How many machines may enroll with it.
        #[arg(long)]
        usages: Option<u32>,
        /// Labels for machines that enroll with it: k=v,k2=v2.
        #[arg(long, value_delimiter = ',')]
        labels: Vec<String>,
        /// Allow re-enrolling a machine name that already has an identity.
        #[arg(long)]
        allow_reenroll: bool,
        #[arg(long, default_value = "")]
        description: String,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Format,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    #[value(alias = "machine")]
    Machines,
    #[value(alias = "pool")]
    Pools,
    #[value(alias = "token")]
    Tokens,
    #[value(alias = "cluster")]
    Clusters,
}

#[derive(Clone, Copy, ValueEnum)]
enum DescribeKind {
    Machine,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Machines => "/v1/machines",
            Kind::Pools => "/v1/pools",
            Kind::Tokens => "/v1/tokens",
            Kind::Clusters => "/v1/clusters",
        }
    }
}

async fn apply_cluster(client: &Client, cluster: &KubernetesCluster) -> anyhow::Result<()> {
    let name = cluster.metadata.name_str();
    let stored: KubernetesCluster =
        client.call(Method::PUT, &format!("/v1/clusters/{name}"), Some(cluster)).await.map_err(|e| anyhow!("cluster/{name}: {e}"))?;
    let server = stored.status.server.as_deref().unwrap_or("?");
    let credential = stored.status.credential.as_deref().unwrap_or("?");
    println!("cluster/{name} applied ({server}, {credential})");
    Ok(())
}

fn parse_ttl(text: &str) -> anyhow::Result<u64> {
    let bad = || anyhow!("--ttl {text:?}: expected a duration such as 90s, 30m, 24h or 7d");
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = number.parse().map_err(|_| bad())?;
    let factor = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(factor).filter(|s| *s > 0).ok_or_else(bad)
}

fn parse_labels(items: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    items
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (k, v) = s.split_once('=').ok_or_else(|| anyhow!("--labels {s:?}: expected key=value"))?;
            keelson_api::validate::check_label(k, v).map_err(|e| anyhow!("--labels: {e}"))?;
            Ok((k.to_owned(), v.to_owned()))
        })
        .collect()
}

fn read_input(file: &str) -> anyhow::Result<String> {
    if file == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).context("reading standard input")?;
        Ok(text)
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {file}"))
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    // Everything that can be checked before talking to the controller is.
    let connect = || -> anyhow::Result<Client> { Client::from_file(&client::config_path(cli.config.clone())?) };
    match cli.command {
        Command::Apply { ref file } => {
            let text = read_input(file)?;
            let resources = resources_from_text(&text).map_err(|e| anyhow!("{file}: {e}"))?;
            if let Some(t) = resources.iter().find(|r| matches!(r, Resource::BootstrapToken(_))) {
                bail!("{file}: BootstrapToken {:?}: tokens are made with `keelson token create`, which shows the secret once", t.name());
            }
            let client = connect()?;
            for resource in resources {
                match resource {
                    Resource::Machine(m) => {
                        let name = m.metadata.name_str().to_owned();
                        let stored: Machine = client
                            .call(Method::PUT, &format!("/v1/machines/{name}"), Some(&m))
                            .await
                            .map_err(|e| anyhow!("machine/{name}: {e}"))?;
                        println!("machine/{name} applied (generation {})", stored.metadata.generation);
                    }
                    Resource::MachinePool(p) => {
                        let name = p.metadata.name_str().to_owned();
                        let stored: MachinePool = client
                            .call(Method::PUT, &format!("/v1/pools/{name}"), Some(&p))
                            .await
                            .map_err(|e| anyhow!("pool/{name}: {e}"))?;
                        println!("pool/{name} applied (revision {})", stored.status.revision);
                    }
                    Resource::KubernetesCluster(c) => apply_cluster(&client, &c).await?,
                    Resource::BootstrapToken(_) => unreachable!("refused above"),
                }
            }
        }
        Command::Get { kind, ref name, output } => {
            if let Some(n) = name {
                parse_name("NAME", n)?;
            }
            let client = connect()?;
            let path = match name {
                Some(n) => format!("{}/{n}", kind.path()),
                None => kind.path().to_owned(),
            };
            let text = match kind {
                Kind::Machines => render::<Machine>(&client, &path, name.is_some(), output, output::machines_table).await?,
                Kind::Pools => render::<MachinePool>(&client, &path, name.is_some(), output, output::pools_table).await?,
                Kind::Tokens => {
                    render::<BootstrapToken>(&client, &path, name.is_some(), output, |items, _| output::tokens_table(items)).await?
                }
                Kind::Clusters => {
                    render::<KubernetesCluster>(&client, &path, name.is_some(), output, |items, _| output::clusters_table(items)).await?
                }
            };
            print!("{text}");
        }
        Command::Describe { kind: DescribeKind::Machine, ref name } => {
            parse_name("NAME", name)?;
            let client = connect()?;
            let m: Machine = client.call(Method::GET, &format!("/v1/machines/{name}"), None::<&()>).await?;
            let events: Vec<Event> = client.call(Method::GET, &format!("/v1/machines/{name}/events"), None::<&()>).await?;
            print!("{}", output::describe_machine(&m, &events)?);
        }
        Command::Delete { kind, ref name, force, force_etcd_leave } => {
            parse_name("NAME", name)?;
            let what = match kind {
                Kind::Machines => "machine",
                Kind::Pools => "pool",
                Kind::Tokens => "token",
                Kind::Clusters => "cluster",
            };
            if (force || force_etcd_leave) && !matches!(kind, Kind::Machines) {
                bail!("--force and --force-etcd-leave apply to machines only");
            }
            let client = connect()?;
            let query = match (force, force_etcd_leave) {
                (true, _) => "?force=true",
                (_, true) => "?forceEtcdLeave=true",
                _ => "",
            };
            let status = client.call_empty(Method::DELETE, &format!("{}/{name}{query}", kind.path())).await?;
            if status == reqwest::StatusCode::ACCEPTED {
                println!("{what}/{name} is being deleted: its agent resets the machine, then it goes (keelson events {what}/{name})");
            } else {
                println!("{what}/{name} deleted");
            }
        }
        Command::Cluster { command: ClusterCommand::Register { ref name, ref kubeconfig, ref context } } => {
            let name = parse_name("NAME", name)?;
            let text = std::fs::read_to_string(kubeconfig).with_context(|| format!("reading {}", kubeconfig.display()))?;
            let cluster = KubernetesCluster {
                api_version: keelson_api::API_VERSION.to_owned(),
                kind: keelson_api::KIND_CLUSTER.to_owned(),
                metadata: keelson_api::meta::ObjectMeta { name: Some(name), ..Default::default() },
                spec: ClusterSpec { kubeconfig: text, context: context.clone() },
                status: Default::default(),
            };
            // Checked here first, so that a kubeconfig the controller would refuse never
            // leaves this machine.
            validate_cluster(&cluster).map_err(|e| anyhow!("{}: {e}", kubeconfig.display()))?;
            apply_cluster(&connect()?, &cluster).await?;
        }
        Command::Token { command: TokenCommand::Create { ref ttl, usages, ref labels, allow_reenroll, ref description, output } } => {
            let request = TokenRequest {
                ttl_seconds: Some(parse_ttl(ttl)?),
                usage_limit: match usages {
                    Some(0) => bail!("--usages must be at least 1"),
                    u => u,
                },
                labels: parse_labels(labels)?,
                allow_reenroll,
                description: description.clone(),
            };
            let client = connect()?;
            let created: TokenCreated = client.call(Method::POST, "/v1/tokens", Some(&request)).await?;
            match output {
                Format::Json | Format::Yaml => print!("{}", output::structured(&created, output)?),
                _ => println!("{}", created.token),
            }
        }
        Command::Rollout { ref command } => rollout(command, connect).await?,
        Command::Etcd { command: EtcdCommand::ClientCert { ref pool, ref cluster, ref out, ref name } } => {
            etcd_client_cert(pool.as_deref(), cluster.as_deref(), out, name, connect).await?
        }
        Command::Etcd { command: EtcdCommand::Members { ref pool, output } } => {
            parse_name("--pool", pool)?;
            let client = connect()?;
            let p: MachinePool = client.call(Method::GET, &format!("/v1/pools/{pool}"), None::<&()>).await?;
            let Some(etcd) = p.status.etcd else {
                bail!(
                    "pool {pool} has no etcd cluster in its status (its template has no etcd, or the controller has not summed it up yet)"
                )
            };
            match output {
                Format::Json | Format::Yaml => print!("{}", output::structured(&etcd, output)?),
                _ => print!("{}", output::etcd_members(&etcd)),
            }
        }
        Command::Events { ref target, output } => {
            let name = target.strip_prefix("machine/").ok_or_else(|| anyhow!("{target:?}: expected machine/NAME"))?;
            parse_name("NAME", name)?;
            let client = connect()?;
            let events: Vec<Event> = client.call(Method::GET, &format!("/v1/machines/{name}/events"), None::<&()>).await?;
            match output {
                Format::Json | Format::Yaml => print!("{}", output::structured(&events, output)?),
                _ => print!("{}", output::events_table(&events)),
            }
        }
    }
    Ok(())
}

async fn render<T>(client: &Client, path: &str, one: bool, format: Format, table: impl Fn(&[T], bool) -> String) -> anyhow::Result<String>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    if one {
        let item: T = client.call(Method::GET, path, None::<&()>).await?;
        return match format {
            Format::Json | Format::Yaml => output::structured(&item, format),
            Format::Table | Format::Wide => Ok(table(std::slice::from_ref(&item), format == Format::Wide)),
        };
    }
    let list: List<T> = client.call(Method::GET, path, None::<&()>).await?;
    match format {
        Format::Json | Format::Yaml => output::structured(&list, format),
        Format::Table | Format::Wide => Ok(table(&list.items, format == Format::Wide)),
    }
}

async fn etcd_client_cert(
    pool: Option<&str>,
    cluster: Option<&str>,
    out: &std::path::Path,
    name: &str,
    connect: impl Fn() -> anyhow::Result<Client>,
) -> anyhow::Result<()> {
    let files = ["ca.crt", "client.crt", "client.key"].map(|f| out.join(f));
    if let Some(existing) = files.iter().find(|f| f.exists()) {
        bail!("{} already exists: remove it or choose another --out", existing.display());
    }
    let client = connect()?;
    let cluster = match (pool, cluster) {
        (_, Some(c)) => parse_name("--cluster", c)?.to_string(),
        (Some(p), None) => {
            parse_name("--pool", p)?;
            let pool: MachinePool = client.call(Method::GET, &format!("/v1/pools/{p}"), None::<&()>).await?;
            match pool.spec.template.spec.etcd {
                Some(e) => e.cluster.to_string(),
                None => bail!("pool {p} has no spec.template.spec.etcd: its machines are not etcd members"),
            }
        }
        (None, None) => bail!("--pool or --cluster is required"),
    };
    let key = rcgen::KeyPair::generate()?;
    let csr = rcgen::CertificateParams::new(Vec::<String>::new())?.serialize_request(&key)?.pem()?;
    let request = keelson_api::wire::EtcdCertificateRequest { csr, common_name: Some(name.to_owned()), addresses: vec![] };
    let cert: keelson_api::wire::EtcdCertificate =
        client.call(Method::POST, &format!("/v1/etcd/{cluster}/client-certificates"), Some(&request)).await?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_file(&files[2], key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&files[1], cert.certificate.as_bytes(), 0o644)?;
    write_file(&files[0], cert.ca.as_bytes(), 0o644)?;
    println!("etcd cluster {cluster}: client certificate {name} valid until {} in {}", cert.not_after.date(), out.display());
    Ok(())
}

fn write_file(path: &std::path::Path, contents: &[u8], mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(contents).and_then(|()| f.sync_all()).with_context(|| format!("writing {}", path.display()))
}

fn main() -> ExitCode {
    // reqwest with rustls needs the process-wide crypto provider chosen before any client.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_parsing() {
        assert_eq!(parse_ttl("24h").ok(), Some(86_400));
        assert_eq!(parse_ttl("90").ok(), Some(90));
        assert_eq!(parse_ttl("7d").ok(), Some(604_800));
        assert!(parse_ttl("0s").is_err());
        assert!(parse_ttl("1w").is_err());
        assert!(parse_ttl("h").is_err());
    }
}
