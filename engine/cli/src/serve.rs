//! `spinfer serve`: the OpenAI-compatible server (`spinfer-server`).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use spinfer_engine::config::Config;
use spinfer_server::Server;

#[derive(Args)]
pub struct ServeArgs {
    /// The operator's TOML file (`[model]`, `[server]`, packs…).
    #[arg(short, long)]
    pub config: PathBuf,
    /// Address to bind (overrides `[server] host`).
    #[arg(long)]
    pub host: Option<IpAddr>,
    /// Port (overrides `[server] port`; 0: any free port).
    #[arg(long)]
    pub port: Option<u16>,
    /// Log only errors.
    #[arg(short, long)]
    pub quiet: bool,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let config = Config::load(&a.config)?;
    let server = Server::new(&config).with_context(|| format!("cannot start the server of {}", a.config.display()))?;
    // HTTP work is light (the model runs on the scheduler's own thread and
    // pool): two I/O threads are enough.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let addr = match (a.host, a.port) {
            (None, None) => None,
            (host, port) => {
                let host = host.unwrap_or(config.server.host.parse().context("server.host is not an IP address")?);
                Some(SocketAddr::new(host, port.unwrap_or(config.server.port)))
            }
        };
        let listener = server.bind(addr).await?;
        let local = listener.local_addr()?;
        // The one line of output: where to connect (scripts read it).
        println!("spinfer serve: {} on http://{local}", server.model_name());
        use std::io::Write;
        std::io::stdout().flush()?;
        server.serve(listener, spinfer_server::shutdown_signal()).await?;
        tracing::info!("stopped");
        Ok(())
    })
}
