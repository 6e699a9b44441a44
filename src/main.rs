//! The `raahi` command: serve, migrate, token, check-config, status.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use raahi::admin::auth;
use raahi::config::{Config, LogFormat};
use raahi::gateway::Gateway;
use raahi::model::{Role, TokenSpec};
use raahi::store::Store;
use raahi::telemetry::access;
use raahi::telemetry::sink::LogSink;

/// jemalloc rather than glibc's malloc. Between requests an idle client connection gives its
/// HTTP buffers back (see `proxy::http1`); glibc keeps such freed memory in the process,
/// fragmented between the small allocations that stay, while jemalloc returns it to the
/// system, and is as fast on the request path.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options: a background thread returns freed pages after 1 s (its default waits
/// 10 s, and only while other allocations happen).
#[export_name = "_rjem_malloc_conf"]
static JEMALLOC_OPTIONS: JemallocOptions =
    JemallocOptions(c"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr());

/// A C string pointer jemalloc reads at start-up, as its `malloc_conf` symbol.
#[repr(transparent)]
struct JemallocOptions(*const std::ffi::c_char);

// SAFETY: the pointer is to a static C string, never written.
unsafe impl Sync for JemallocOptions {}

#[derive(Parser)]
#[command(
    name = "raahi",
    version,
    about = "A Layer-4/7 reverse-proxy gateway fed by service discovery"
)]
struct Cli {
    /// Bootstrap configuration file (default: config/raahi.toml when it exists, else built-in defaults).
    #[arg(long, global = true, env = "RAAHI_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway: proxy listener, admin API and control loop.
    Serve,
    /// Create or upgrade the database schema, then exit.
    Migrate,
    /// Manage admin API tokens.
    Token {
        #[command(subcommand)]
        action: TokenAction,
    },
    /// Validate the configuration file and environment, then exit.
    CheckConfig,
    /// Show a running gateway's discovery sources and targets, read from its admin API.
    Status(StatusArgs),
}

#[derive(Args)]
struct StatusArgs {
    /// Base URL of the gateway's admin API.
    #[arg(long, env = "RAAHI_ADMIN_URL", default_value = "http://127.0.0.1:9080")]
    admin_url: String,
    /// Admin API token (discovery sources need the admin role).
    #[arg(long, env = "RAAHI_ADMIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// `text`: one block per service; `json`: the whole report, for scripts.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    output: OutputFormat,
}

#[derive(Clone, Copy, ValueEnum)]
enum OutputFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum TokenAction {
    /// Create a token and print its secret (shown only this once).
    Create {
        #[arg(long, value_enum)]
        role: RoleArg,
        /// A unique name for the token (default: generated from the role and time).
        #[arg(long)]
        name: Option<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum RoleArg {
    Admin,
    Viewer,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Reads only the admin API: no configuration file or database needed.
    if let Command::Status(args) = &cli.command {
        return status(args);
    }
    let config = match Config::load(cli.config.as_deref()) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("raahi: invalid configuration: {error}");
            return ExitCode::from(2);
        }
    };
    if let Command::CheckConfig = cli.command {
        // The certificate files are part of the configuration: a renewal gone wrong must show
        // here, not at the next start.
        if let Err(error) = raahi::gateway::load_file_certificates(&config.tls) {
            eprintln!("raahi: invalid configuration: {error}");
            return ExitCode::from(2);
        }
        // So is the resources file: a bad edit must show here, not at the next SIGHUP.
        if let Some(path) = &config.resources.file {
            if let Err(error) = raahi::resources::check_file(path) {
                eprintln!("raahi: invalid configuration: {error}");
                return ExitCode::from(2);
            }
        }
        println!("configuration is valid");
        return ExitCode::SUCCESS;
    }
    let _log_sink = match init_logging(&config) {
        Ok(sink) => sink,
        Err(error) => {
            eprintln!("raahi: cannot start the log writer: {error}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match build_runtime() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("raahi: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("raahi: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Tokio's multi-thread scheduler with `TOKIO_WORKER_THREADS` workers (default: one a CPU); with
/// exactly one worker asked for (like nginx's `worker_processes 1`), the current-thread scheduler,
/// which runs the same tasks on one thread without the multi-thread one's work-stealing queues and
/// cross-thread wake-ups.
fn build_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let one_worker = std::env::var("TOKIO_WORKER_THREADS").is_ok_and(|value| value.trim() == "1");
    let mut builder = if one_worker {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    builder.enable_all().build()
}

/// Logs go to stderr through the batching sink (`telemetry::sink`): a request that logs hands
/// its line to its thread's buffer instead of taking the stderr lock, and a writer thread writes
/// the buffers in batches. Under overload lines are dropped (and counted) rather than requests
/// slowed. Access lines bypass tracing; `RUST_LOG` still decides whether they are written.
/// Keep the sink until exit so buffered lines are written.
fn init_logging(config: &Config) -> std::io::Result<LogSink> {
    let sink = LogSink::start(std::io::stderr())?;
    let filter = tracing_subscriber::EnvFilter::new(&config.log.level);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(sink.handle());
    match config.log.format {
        LogFormat::Json => builder.event_format(raahi::telemetry::Json).init(),
        LogFormat::Logfmt => builder.event_format(raahi::telemetry::Logfmt).init(),
        LogFormat::Text => builder.init(),
    }
    raahi::telemetry::install_process_sink(sink.handle());
    if tracing::enabled!(target: access::TARGET, tracing::Level::INFO) {
        // `text` is for people, but an access line is a list of fields either way: logfmt.
        let layout = match config.log.format {
            LogFormat::Json => access::Layout::Json,
            LogFormat::Logfmt | LogFormat::Text => access::Layout::Logfmt,
        };
        access::install(sink.handle(), layout);
    }
    Ok(sink)
}

async fn run(command: Command, config: Config) -> anyhow::Result<()> {
    match command {
        Command::Serve => serve(config).await,
        Command::Migrate => {
            let shown = config.database.shown_url();
            Store::connect_as(
                &config.database.url,
                &config.cluster.instance_id_or_generated(),
            )
            .await
            .with_context(|| format!("migrating {shown}"))?;
            println!("database {shown} is up to date");
            Ok(())
        }
        Command::Token {
            action: TokenAction::Create { role, name },
        } => {
            let store = Store::connect_as(
                &config.database.url,
                &config.cluster.instance_id_or_generated(),
            )
            .await?;
            let role = match role {
                RoleArg::Admin => Role::Admin,
                RoleArg::Viewer => Role::Viewer,
            };
            let name = name.unwrap_or_else(|| {
                format!(
                    "{}-{}",
                    role.as_str(),
                    raahi::clock::now().format("%Y%m%d%H%M%S%3f")
                )
            });
            let (token, secret) = auth::create_token(&store, &TokenSpec { name, role })
                .await
                .context("creating the token")?;
            println!("{secret}");
            eprintln!(
                "created {} token {:?} (id {})",
                role.as_str(),
                token.name,
                token.id
            );
            Ok(())
        }
        Command::CheckConfig | Command::Status(_) => Ok(()),
    }
}

fn status(args: &StatusArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("raahi: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let fetched = runtime.block_on(raahi::status::fetch(&args.admin_url, args.token.as_deref()));
    let report = match fetched {
        Ok(report) => report,
        Err(error) => {
            eprintln!("raahi status: {error}");
            return ExitCode::FAILURE;
        }
    };
    let text = match args.output {
        OutputFormat::Text => raahi::status::render_text(&report),
        OutputFormat::Json => match serde_json::to_string_pretty(&report) {
            Ok(json) => json + "\n",
            Err(error) => {
                eprintln!("raahi status: cannot encode the report: {error}");
                return ExitCode::FAILURE;
            }
        },
    };
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        // `raahi status | head` is not a failure.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("raahi status: cannot write the report: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let gateway = Gateway::start(&config).await?;
    if let Some(token) = &gateway.generated_admin_token {
        println!("Generated the first admin token (shown once, store it now):\n{token}");
    }
    if let Some((file, report)) = &gateway.resources {
        println!("raahi: applied {}: {report}", file.path.display());
    }
    println!(
        "raahi: proxy on {}, admin API on {}",
        gateway.proxy_addr, gateway.admin_addr
    );
    let mut signals = Signals::new();
    signals.next().await;
    tracing::info!("shutting down: draining");
    // A second SIGTERM or SIGINT during the drain delay skips the rest of it.
    gateway.drain(signals.next()).await;
    tracing::info!("shut down");
    Ok(())
}

/// SIGTERM and SIGINT, each received as often as it is sent: both streams are made once, so a
/// signal that arrives while nobody waits (during the withdrawal) is kept for the next wait.
struct Signals {
    terminate: Option<tokio::signal::unix::Signal>,
    interrupt: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn new() -> Signals {
        use tokio::signal::unix::{signal, SignalKind};
        Signals {
            terminate: signal(SignalKind::terminate()).ok(),
            interrupt: signal(SignalKind::interrupt()).ok(),
        }
    }

    async fn next(&mut self) {
        async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) {
            match signal {
                Some(signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            _ = recv(&mut self.terminate) => {}
            _ = recv(&mut self.interrupt) => {}
        }
    }
}
