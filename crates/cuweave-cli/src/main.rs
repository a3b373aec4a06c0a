//! The `cuweave` command: what the CUDA driver and each device offer.
//!
//! `cuweave info` prints the driver version and, for each device, its name, PCI bus id, compute
//! capability, memory, the capabilities cuweave's layers decide on, the stream priority range,
//! and peer access between every pair; `cuweave info --json` prints the same as JSON. On a
//! machine without a usable driver it says so and exits 0; it exits 1 only when the driver
//! initialised but a query failed. Set `RUST_LOG` (e.g. `RUST_LOG=debug`) to see the driver
//! layer's log on stderr.
#![forbid(unsafe_code)]

mod info;
mod render;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Exit status when the report cannot be written (not a GPU problem).
const EXIT_OUTPUT_FAILED: u8 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "cuweave",
    version,
    about = "Inspect the CUDA driver and devices the way cuweave sees them"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the driver version and each device's properties, capabilities and peer access.
    Info {
        /// Print machine-readable JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    match cli.command {
        Command::Info { json } => info_command(json),
    }
}

/// Logs of the driver layer (e.g. errors while freeing in `Drop`) go to stderr, filtered by
/// `RUST_LOG`; warnings and errors by default.
fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    // Fails only if a subscriber is already set, in which case that one keeps logging.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

fn info_command(json: bool) -> ExitCode {
    let report = info::gather();
    let output = if json {
        match render::json(&report) {
            Ok(output) => output,
            Err(error) => {
                complain(&format!("serialising the report failed: {error}"));
                return ExitCode::from(EXIT_OUTPUT_FAILED);
            }
        }
    } else {
        render::text(&report)
    };
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{output}").and_then(|()| stdout.flush()) {
        Ok(()) => {}
        // A reader that stopped early (`cuweave info | head`) is not an error of ours.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(error) => {
            complain(&format!("writing the report failed: {error}"));
            return ExitCode::from(EXIT_OUTPUT_FAILED);
        }
    }
    ExitCode::from(report.status.exit_code())
}

/// Writes `message` to stderr; if even that fails there is nobody left to tell.
fn complain(message: &str) {
    let _ = writeln!(std::io::stderr(), "cuweave: {message}");
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn info_takes_an_optional_json_flag() {
        let cli = Cli::try_parse_from(["cuweave", "info", "--json"]).unwrap();
        assert!(matches!(cli.command, Command::Info { json: true }));
        let cli = Cli::try_parse_from(["cuweave", "info"]).unwrap();
        assert!(matches!(cli.command, Command::Info { json: false }));
        assert!(Cli::try_parse_from(["cuweave"]).is_err());
    }
}
