//! The `web` binary: parses the command line and hands over to [`web::cli::main`].

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    web::cli::main(web::cli::Cli::parse()).await
}
