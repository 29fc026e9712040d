//! The `inflight` command line: `serve`, `snapshot` (`--watch`), `show`,
//! `cancel`, `release`, `reap`, `check-config` and `demo`. Commands that take
//! an id take the short id a table shows too ([`ids`]).
//!
//! `main` parses a [`Cli`] and hands it to [`run`], which answers with the
//! process's exit code: 0 on success, 2 for a configuration error, 1 for
//! anything else.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use inflight_server::{self as server, Overrides, ServerSettings};

pub mod client;
pub mod demo;
pub mod ids;
pub mod watch;

/// The default server the client commands talk to.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7878";

/// A ledger of in-flight AI provider calls that cannot drift.
#[derive(Debug, Parser)]
#[command(name = "inflight", version, about, long_about = None)]
pub struct Cli {
    /// How to write logs (to stderr); `RUST_LOG` sets the level. Taken
    /// before or after the command.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true, help_heading = "Logging")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line, for machines.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the ledger as an HTTP server.
    Serve(ServeArgs),
    /// Show a running server's snapshot: lanes, in-flight and reaped records.
    Snapshot(SnapshotArgs),
    /// Ask a running server to reap every record past its bound now.
    Reap(ClientArgs),
    /// Show one record as the server knows it.
    Show(ShowArgs),
    /// Cancel a record: an abort the ledger observes.
    Cancel(CancelArgs),
    /// Release an owner: a clean shutdown that cancels its in-flight records.
    Release(ReleaseArgs),
    /// Validate a configuration file (exit 0 when valid, 2 otherwise).
    CheckConfig(CheckConfigArgs),
    /// Replay the incident that motivated inflight, before and after.
    Demo,
}

/// `inflight serve`'s options. Flags win over the environment, the
/// environment over the file, the file over the defaults.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Configuration file (TOML).
    #[arg(long, env = "INFLIGHT_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:7878].
    #[arg(long, env = "INFLIGHT_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// Store URL: `sqlite://PATH`, `postgres://user@host:port/db` or `memory:` [default: sqlite://inflight.db].
    #[arg(long, env = "INFLIGHT_STORE", value_name = "URL")]
    pub store: Option<String>,
    /// Bearer token required on /v1 routes and /metrics [default: none].
    #[arg(long, env = "INFLIGHT_TOKEN", value_name = "TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Also expose /metrics series per aggregate, with all seven labels
    /// (high cardinality) [default: false].
    #[arg(
        long,
        env = "INFLIGHT_METRICS_AGGREGATES",
        value_name = "BOOL",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub metrics_aggregates: Option<bool>,
    /// Serve HTTPS with this certificate chain (PEM, the server's own
    /// certificate first); needs --tls-key. SIGHUP re-reads both files.
    #[arg(long, env = "INFLIGHT_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "INFLIGHT_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
}

/// Where a client command finds the server.
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The server: a URL, or HOST:PORT for http://HOST:PORT.
    #[arg(
        long,
        env = "INFLIGHT_URL",
        value_name = "URL",
        default_value = DEFAULT_SERVER,
        hide_env_values = true
    )]
    pub server: String,
    /// Bearer token, when the server requires one.
    #[arg(long, env = "INFLIGHT_TOKEN", value_name = "TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM file of the CA that signed an https:// server's certificate
    /// (instead of the system's roots).
    #[arg(long, env = "INFLIGHT_CA_FILE", value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
}

impl ClientArgs {
    /// The client of the server these arguments name.
    fn client(&self) -> Result<client::Client, CliError> {
        client::Client::new(&self.server, self.token.clone(), self.ca_file.as_deref())
    }
}

/// `inflight snapshot`'s options.
#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// Where the server is.
    #[command(flatten)]
    pub client: ClientArgs,
    /// Print the snapshot as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Records listed per section (1 to 10000).
    #[arg(long)]
    pub limit: Option<u32>,
    /// History window: a duration (`24h`) or an RFC 3339 time.
    #[arg(long)]
    pub since: Option<String>,
    /// Redraw the table every `--interval`, like `top`, until interrupted
    /// (Ctrl-C); when not on a terminal, print each snapshot after the last
    /// (with `--json`: one a line).
    #[arg(long)]
    pub watch: bool,
    /// How often `--watch` redraws: a duration, at least 500ms.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = watch::parse_interval, requires = "watch")]
    pub interval: std::time::Duration,
}

/// An activity id: the whole id, or the end of it a table shows.
const ACTIVITY_ID_HELP: &str = "The activity's id, or the short id a table shows (the end of the id)";

/// `inflight show`'s options.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// Where the server is.
    #[command(flatten)]
    pub client: ClientArgs,
    #[arg(value_name = "ID", help = ACTIVITY_ID_HELP)]
    pub id: String,
    /// Print the record as JSON instead of one field a line.
    #[arg(long)]
    pub json: bool,
}

/// `inflight cancel`'s options.
#[derive(Debug, Args)]
pub struct CancelArgs {
    /// Where the server is.
    #[command(flatten)]
    pub client: ClientArgs,
    #[arg(value_name = "ID", help = ACTIVITY_ID_HELP)]
    pub id: String,
    /// Why (kept when it carries no credential, endpoint or path).
    #[arg(long)]
    pub reason: Option<String>,
}

/// `inflight release`'s options.
#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// Where the server is.
    #[command(flatten)]
    pub client: ClientArgs,
    /// The owner's id, or the short id the owners table shows (the end of
    /// the id).
    #[arg(value_name = "OWNER_ID")]
    pub id: String,
}

/// `inflight check-config`'s argument.
#[derive(Debug, Args)]
pub struct CheckConfigArgs {
    /// The configuration file to validate.
    pub file: PathBuf,
    /// Also compare the file with a running server's calls (its snapshot
    /// of the last 24 hours): a lane the file declares that no call uses
    /// next to one a call uses one or two edits away, and classes the
    /// calls use that the file does not configure. Warnings: the exit code
    /// stays 0.
    #[arg(long, value_name = "URL")]
    pub against: Option<String>,
    /// Bearer token for `--against`, when the server requires one.
    // No `requires = "against"`: clap counts a value from the environment
    // as given, so an exported INFLIGHT_TOKEN would refuse a plain
    // check-config. Without --against both are unused.
    #[arg(long, env = "INFLIGHT_TOKEN", value_name = "TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM file of the CA that signed an https:// `--against` server's
    /// certificate.
    #[arg(long, env = "INFLIGHT_CA_FILE", value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
}

/// Why a command failed, and so its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A configuration error: exit code 2.
    #[error("{0}")]
    Config(String),
    /// Anything else: exit code 1.
    #[error("{0}")]
    Failed(String),
}

impl CliError {
    /// The process exit code for it.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            Self::Config(_) => ExitCode::from(2),
            Self::Failed(_) => ExitCode::from(1),
        }
    }
}

impl From<server::ServeError> for CliError {
    fn from(err: server::ServeError) -> Self {
        if err.is_config() {
            Self::Config(err.to_string())
        } else {
            Self::Failed(err.to_string())
        }
    }
}

/// The command line as `main` parses it: [`Cli`], with the logging flags
/// listed once, in the top level's help, instead of in every command's.
pub fn command() -> clap::Command {
    use clap::CommandFactory;

    let command = Cli::command();
    let logging: Vec<clap::Arg> = command
        .get_arguments()
        .filter(|arg| arg.is_global_set())
        .map(|arg| arg.clone().hide(true))
        .collect();
    // A subcommand that has the argument already keeps it (clap propagates a
    // global argument only where it is missing): parsed as before, not shown.
    command.mut_subcommands(|sub| sub.args(logging.iter().cloned()))
}

/// Parses the process's arguments with [`command`], exiting with clap's
/// message (and code 2) on an error, or after `--help` and `--version`.
pub fn parse() -> Cli {
    use clap::FromArgMatches;

    let matches = command().get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit())
}

/// Runs `cli` and returns the exit code, printing any error as one line on
/// stderr.
pub fn run(cli: Cli) -> ExitCode {
    match execute(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("inflight: {err}");
            err.exit_code()
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|err| CliError::Failed(format!("cannot start the async runtime: {err}")))
}

fn execute(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Serve(args) => {
            init_logging(cli.log_format, "info");
            let overrides = Overrides {
                config: args.config,
                listen: args.listen,
                store: args.store,
                token: args.token,
                metrics_aggregates: args.metrics_aggregates,
                tls_cert: args.tls_cert,
                tls_key: args.tls_key,
            };
            let settings = ServerSettings::resolve(&overrides)?;
            runtime()?.block_on(server::serve(settings))?;
            Ok(())
        }
        Command::Snapshot(args) => {
            init_logging(cli.log_format, "warn");
            let client = args.client.client()?;
            let query = inflight_api::SnapshotQuery {
                limit: args.limit,
                since: args.since,
            };
            if args.watch {
                let output = watch::Output::for_stdout(args.json);
                return runtime()?.block_on(watch::watch(&client, &query, args.interval, output));
            }
            let snapshot = runtime()?.block_on(client.snapshot(&query))?;
            if args.json {
                let text = serde_json::to_string_pretty(&snapshot)
                    .map_err(|err| CliError::Failed(format!("cannot print the snapshot: {err}")))?;
                println!("{text}");
            } else {
                print!("{}", snapshot);
            }
            Ok(())
        }
        Command::Reap(args) => {
            init_logging(cli.log_format, "warn");
            let client = args.client()?;
            let counts = runtime()?.block_on(client.reap())?;
            println!(
                "reaped {} abandoned (never started) and {} unsettled (started, never settled)",
                counts.abandoned, counts.unsettled
            );
            Ok(())
        }
        Command::Show(args) => {
            init_logging(cli.log_format, "warn");
            let client = args.client.client()?;
            let record = runtime()?.block_on(async {
                let id = client.resolve(&args.id, ids::Kind::Activity).await?;
                client.activity(&id).await
            })?;
            if args.json {
                let text = serde_json::to_string_pretty(&record)
                    .map_err(|err| CliError::Failed(format!("cannot print the record: {err}")))?;
                println!("{text}");
            } else {
                print!("{}", fields(&record)?);
            }
            Ok(())
        }
        Command::Cancel(args) => {
            init_logging(cli.log_format, "warn");
            let client = args.client.client()?;
            let record = runtime()?.block_on(async {
                let id = client.resolve(&args.id, ids::Kind::Activity).await?;
                client.cancel(&id, args.reason).await
            })?;
            if record.late_settle {
                println!(
                    "activity {} was already reaped ({}); the cancel is kept as a late settle",
                    record.activity_id,
                    record.disposition.map_or("-", |d| d.as_str())
                );
            } else {
                println!("activity {}: {}", record.activity_id, record.state);
            }
            Ok(())
        }
        Command::Release(args) => {
            init_logging(cli.log_format, "warn");
            let client = args.client.client()?;
            let owner = runtime()?.block_on(async {
                let id = client.resolve(&args.id, ids::Kind::Owner).await?;
                client.release_owner(&id).await
            })?;
            println!(
                "owner {} ({}): {}; {} in-flight records cancelled",
                owner.owner_id, owner.name, owner.state, owner.cancelled_records
            );
            Ok(())
        }
        Command::CheckConfig(args) => {
            // The path `serve` takes, so that both refuse the same file alike.
            let overrides = Overrides {
                config: Some(args.file.clone()),
                ..Overrides::default()
            };
            let merged = ServerSettings::resolve(&overrides)?;
            println!("{}: valid", args.file.display());
            println!("{}", describe_settings(&merged));
            for warning in &merged.warnings {
                eprintln!("inflight: warning: {warning}");
            }
            if let Some(url) = &args.against {
                for warning in runtime()?.block_on(against_server(
                    &merged,
                    url,
                    args.token.clone(),
                    args.ca_file.as_deref(),
                ))? {
                    eprintln!("inflight: warning: {warning}");
                }
            }
            Ok(())
        }
        Command::Demo => {
            init_logging(cli.log_format, "warn");
            let replay = runtime()?
                .block_on(crate::demo::replay_incident())
                .map_err(|err| CliError::Failed(format!("the demo failed: {err}")))?;
            print!("{}", demo::render(&replay));
            Ok(())
        }
    }
}

/// A record's fields, one `name: value` a line in the wire's order, names
/// aligned; strings without their quotes, unset fields as `-`.
fn fields(record: &inflight_api::ActivityRecord) -> Result<String, CliError> {
    let text = serde_json::to_string(record)
        .map_err(|err| CliError::Failed(format!("cannot print the record: {err}")))?;
    // Read back as pairs, not a map, which would sort the names.
    let pairs: OrderedFields = serde_json::from_str(&text)
        .map_err(|err| CliError::Failed(format!("cannot print the record: {err}")))?;
    let width = pairs.0.iter().map(|(name, _)| name.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for (name, value) in pairs.0 {
        let value = match value {
            serde_json::Value::String(text) => text,
            serde_json::Value::Null => "-".to_owned(),
            other => other.to_string(),
        };
        out.push_str(&format!("{:<width$} {value}\n", format!("{name}:")));
    }
    Ok(out)
}

/// A JSON object's fields in the order they were written.
struct OrderedFields(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for OrderedFields {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Pairs;

        impl<'de> serde::de::Visitor<'de> for Pairs {
            type Value = OrderedFields;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<OrderedFields, A::Error> {
                let mut pairs = Vec::new();
                while let Some(pair) = map.next_entry()? {
                    pairs.push(pair);
                }
                Ok(OrderedFields(pairs))
            }
        }

        deserializer.deserialize_map(Pairs)
    }
}

/// What the lanes and classes of `settings` and the calls a running server
/// saw (its snapshot) do not match: the snapshot's own rule
/// ([`inflight::domain::warnings`]), applied to the file's configuration.
async fn against_server(
    settings: &ServerSettings,
    url: &str,
    token: Option<String>,
    ca_file: Option<&Path>,
) -> Result<Vec<String>, CliError> {
    let client = client::Client::new(url, token, ca_file)?;
    let snapshot = client.snapshot(&inflight_api::SnapshotQuery::default()).await?;
    let (caps, policy) = (settings.ledger.lanes(), settings.ledger.policy());
    let mut seen = inflight::domain::warnings::Seen::default();
    for aggregate in &snapshot.aggregates {
        let lane = (aggregate.service.as_str(), aggregate.provider.as_str());
        seen.add(policy, true, lane, &aggregate.class, aggregate.calls);
    }
    let since = format!("on {url} since {}", snapshot.since);
    Ok(seen
        .warnings(caps, policy, &since)
        .into_iter()
        .map(|warning| format!("{} ({})", warning.message, warning.code))
        .collect())
}

/// The tokens line of `check-config`: how many of each scope, never a
/// secret.
fn describe_tokens(tokens: &[inflight_server::http::auth::TokenSpec]) -> String {
    use inflight_server::http::auth::Scope;
    if tokens.is_empty() {
        return "token not required".to_owned();
    }
    let each: Vec<String> = tokens
        .iter()
        .map(|token| match (token.scope(), token.services()) {
            (Scope::Read, _) => "read".to_owned(),
            (Scope::Write, None) => "write".to_owned(),
            (Scope::Write, Some(services)) => {
                format!(
                    "write for {}",
                    services.iter().cloned().collect::<Vec<_>>().join(", ")
                )
            }
        })
        .collect();
    format!("token required: {} ({})", tokens.len(), each.join("; "))
}

/// A short summary of what a configuration means, for `check-config`.
pub fn describe_settings(settings: &ServerSettings) -> String {
    let ledger = &settings.ledger;
    let policy = ledger.policy();
    let mut lines = vec![
        format!("listen {}", settings.listen),
        format!("store {}", settings.store),
        describe_tokens(settings.tokens.specs()),
        format!(
            "reap factor {}, interval {}",
            policy.factor(),
            inflight_api::human_duration(
                i64::try_from(ledger.reap_interval().as_millis()).unwrap_or(i64::MAX)
            )
        ),
        format!(
            "server: at most {} connections and {} requests at once, header timeout {}, body timeout {}",
            settings.limits.max_connections(),
            settings.limits.max_requests(),
            inflight_api::human_duration(
                i64::try_from(settings.limits.header_timeout().as_millis()).unwrap_or(i64::MAX)
            ),
            inflight_api::human_duration(
                i64::try_from(settings.limits.body_timeout().as_millis()).unwrap_or(i64::MAX)
            ),
        ),
    ];
    for (name, bounds) in policy.classes() {
        let estimate = bounds
            .tokens()
            .map(|tokens| format!(", an estimate of {tokens} tokens"))
            .unwrap_or_default();
        lines.push(format!(
            "class {name}: deadline {}, max queue wait {}{estimate}",
            inflight_api::human_duration(bounds.deadline_ms()),
            inflight_api::human_duration(bounds.max_queue_wait_ms())
        ));
    }
    for (lane, settings) in ledger.lanes() {
        let mut line = settings
            .cap
            .map_or_else(|| "no cap".to_owned(), |cap| format!("cap {cap}"));
        if let Some(rules) = settings
            .rules(ledger.admission(), None)
            .filter(|_| settings.cap.is_some())
        {
            if let Some(batch_cap) = rules.batch_cap {
                line.push_str(&format!(", batch_cap {batch_cap}"));
            }
            if rules.max_overtakes > 0 {
                line.push_str(&format!(", max_overtakes {}", rules.max_overtakes));
            }
            line.push_str(&format!(
                ", max_cooldown {}",
                inflight_api::human_duration(rules.max_cooldown_ms)
            ));
            if rules.adaptive {
                line.push_str(", adaptive");
            }
        }
        if let Some(budget) = settings.tokens_per_minute {
            line.push_str(&format!(", tokens_per_minute {budget}"));
        }
        lines.push(format!("lane {lane}: {line}"));
    }
    for (provider, budget) in ledger.provider_budgets() {
        lines.push(format!(
            "provider {provider}: tokens_per_minute {budget}, shared by its lanes"
        ));
    }
    for route in settings.proxies.iter() {
        lines.push(format!(
            "proxy /proxy/{}/ -> {}: provider {}, service {} unless a call says, max wait {}, bodies up to {} bytes",
            route.name(),
            route.upstream(),
            route.provider(),
            route.service(),
            inflight_api::human_duration(i64::try_from(route.max_wait().as_millis()).unwrap_or(i64::MAX)),
            route.max_body()
        ));
    }
    if let Some(otel) = &settings.otel {
        let headers: Vec<&str> = otel.headers.keys().map(String::as_str).collect();
        lines.push(format!(
            "otel: spans and GenAI metrics to {} as service {}, timeout {}, queue {}, abandoned held {}{}",
            otel.endpoint
                .as_deref()
                .unwrap_or("the OTEL_EXPORTER_OTLP_* endpoint, else http://localhost:4318"),
            otel.service_name,
            humantime::format_duration(otel.timeout),
            otel.queue,
            humantime::format_duration(otel.hold_abandoned),
            if headers.is_empty() {
                String::new()
            } else {
                format!(", headers {}", headers.join(", "))
            }
        ));
    }
    lines.join("\n")
}

/// Logs to stderr at `default_level` unless `RUST_LOG` says otherwise.
fn init_logging(format: LogFormat, default_level: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).try_init(),
    };
    // A subscriber already set (by an embedding program) is fine.
    drop(result);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
        command().debug_assert();
    }

    #[test]
    fn the_description_names_every_command() {
        let command = command();
        let about = command.get_about().expect("a description").to_string();
        for sub in command.get_subcommands() {
            assert!(about.contains(sub.get_name()), "{}: {about}", sub.get_name());
        }
    }

    #[test]
    fn the_logging_flags_show_in_the_top_level_help_only_and_parse_anywhere() {
        let mut top = command();
        assert!(top.render_long_help().to_string().contains("Logging:"));
        for sub in top.get_subcommands_mut() {
            for help in [sub.render_help(), sub.render_long_help()] {
                assert!(
                    !help.to_string().contains("--log-format"),
                    "{}: {help}",
                    sub.get_name()
                );
            }
        }
        for args in [
            &["inflight", "--log-format", "json", "reap"][..],
            &["inflight", "reap", "--log-format", "json"],
        ] {
            let matches = command().try_get_matches_from(args).unwrap();
            let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap();
            assert_eq!(cli.log_format, LogFormat::Json, "{args:?}");
        }
    }

    #[test]
    fn serve_flags_parse() {
        let cli = Cli::try_parse_from([
            "inflight",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            "memory:",
            "--log-format",
            "json",
        ])
        .unwrap();
        assert_eq!(cli.log_format, LogFormat::Json);
        match cli.command {
            Command::Serve(args) => {
                assert_eq!(args.listen.as_deref(), Some("127.0.0.1:0"));
                assert_eq!(args.store.as_deref(), Some("memory:"));
            }
            other => panic!("parsed {other:?}"),
        }
    }
}
