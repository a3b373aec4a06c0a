//! The `cuweave` command: what the CUDA driver and each device offer.
//!
//! `cuweave info` prints the driver version and, for each device, its name, PCI bus id, compute
//! capability, memory, the capabilities cuweave's layers decide on, the stream priority range,
//! and peer access between every pair; `cuweave info --json` prints the same as JSON. On a
//! machine without a usable driver it says so and exits 0; it exits 1 only when the driver
//! initialised but a query failed. Set `RUST_LOG` (e.g. `RUST_LOG=debug`) to see the driver
//! layer's log on stderr.
//!
//! `cuweave bench` measures host-to-device, device-to-host, device-to-device and (with two
//! devices) peer-to-peer bandwidth over a sweep of sizes, pinned, pageable and through cuweave's
//! transfer manager, plus copy latency; it shows a progress bar while it runs, then a table, or
//! JSON with `--json`, and writes an SVG plot with `--plot FILE.svg`. Sizes that do not fit free
//! memory are refused (exit 2); without a driver it says so and exits 0.
#![forbid(unsafe_code)]

mod bench;
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
    /// Measure copy bandwidth and latency: raw driver calls beside cuweave's transfer methods.
    Bench {
        /// Print machine-readable JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Also write bandwidth against size as an SVG plot to this file.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<std::path::PathBuf>,
        /// Sizes to measure, comma-separated (e.g. 4K,1M,256M,1G), each at least 4 bytes; 4 KiB to
        /// 1 GiB by default.
        #[arg(long, value_delimiter = ',', value_parser = bench::parse_size)]
        sizes: Vec<usize>,
        /// Timed copies per point (the median is reported, after one warm-up copy).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..))]
        iterations: u16,
        /// Also calibrate the transfer manager and save the table as JSON to this file.
        #[arg(long, value_name = "FILE.json")]
        save_calibration: Option<std::path::PathBuf>,
        /// Measure nothing: show (and --plot) a report saved earlier with --json.
        #[arg(
            long,
            value_name = "FILE.json",
            conflicts_with_all = ["sizes", "iterations", "save_calibration"]
        )]
        from_json: Option<std::path::PathBuf>,
    },
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    match cli.command {
        Command::Info { json } => info_command(json),
        Command::Bench {
            json,
            plot,
            sizes,
            iterations,
            save_calibration,
            from_json,
        } => match from_json {
            Some(path) => replay(&path, json, plot),
            None => bench_command(json, plot, sizes, iterations.into(), save_calibration),
        },
    }
}

fn bench_command(
    json: bool,
    plot: Option<std::path::PathBuf>,
    mut sizes: Vec<usize>,
    iterations: usize,
    save_calibration: Option<std::path::PathBuf>,
) -> ExitCode {
    if sizes.is_empty() {
        sizes = bench::DEFAULT_SIZES.to_vec();
    }
    sizes.sort_unstable();
    sizes.dedup();
    let devices = cuweave::driver::Device::count().unwrap_or(0);
    let bar = indicatif::ProgressBar::new(bench::measure::steps(sizes.len(), devices));
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40.cyan/blue} {pos}/{len} {elapsed} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let outcome = bench::measure::run(&sizes, iterations, |step| {
        bar.set_message(step);
        bar.inc(1);
    });
    bar.finish_and_clear();
    let report = match outcome {
        Ok(report) => report,
        Err(bench::BenchError::NoGpu(why)) => {
            // `--json` answers in JSON, as `info --json` does: a reader must be able to parse it.
            if json {
                let answer = serde_json::json!({ "error": format!("nothing to measure: {why}") });
                println!("{answer:#}");
            } else {
                println!("cuweave bench: nothing to measure: {why}");
            }
            return ExitCode::SUCCESS;
        }
        Err(bench::BenchError::DoesNotFit(why)) => {
            complain(&why);
            return ExitCode::from(EXIT_OUTPUT_FAILED);
        }
        Err(bench::BenchError::Failed(why)) => {
            complain(&format!("bench failed: {why}"));
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &save_calibration {
        let table =
            cuweave::transfer::TransferManager::new().and_then(|manager| manager.calibrate());
        let table = match table {
            Ok(table) => table,
            Err(error) => {
                complain(&format!("calibration: {error}"));
                return ExitCode::FAILURE;
            }
        };
        // Not written, like an unwritable plot: the report cannot be delivered.
        if let Err(error) = table.save(path) {
            complain(&format!("calibration: {error}"));
            return ExitCode::from(EXIT_OUTPUT_FAILED);
        }
    }
    show(&report, json, plot)
}

/// `cuweave bench --from-json FILE`: a saved report shown (and plotted) again.
fn replay(path: &std::path::Path, json: bool, plot: Option<std::path::PathBuf>) -> ExitCode {
    let report = std::fs::read_to_string(path)
        .map_err(|error| error.to_string())
        .and_then(|text| {
            serde_json::from_str::<bench::report::BenchReport>(&text)
                .map_err(|error| error.to_string())
        })
        .and_then(|report| report.check().map(|()| report));
    match report {
        Ok(report) => show(&report, json, plot),
        Err(error) => {
            complain(&format!("reading {}: {error}", path.display()));
            ExitCode::from(EXIT_OUTPUT_FAILED)
        }
    }
}

/// Writes the plot (if asked) and prints the report as a table or JSON.
fn show(
    report: &bench::report::BenchReport,
    json: bool,
    plot: Option<std::path::PathBuf>,
) -> ExitCode {
    if let Some(path) = &plot
        && let Err(error) = std::fs::write(path, bench::plot::svg(report))
    {
        complain(&format!("writing {}: {error}", path.display()));
        return ExitCode::from(EXIT_OUTPUT_FAILED);
    }
    let output = if json {
        serde_json::to_string_pretty(report)
            .unwrap_or_else(|error| format!("{{\"error\": \"{error}\"}}"))
    } else {
        report.text()
    };
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{output}").and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(error) => {
            complain(&format!("writing the report failed: {error}"));
            ExitCode::from(EXIT_OUTPUT_FAILED)
        }
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

    #[test]
    fn bench_parses_sizes_plot_and_json() {
        let cli = Cli::try_parse_from([
            "cuweave", "bench", "--sizes", "4K,1M", "--plot", "out.svg", "--json",
        ])
        .unwrap();
        match cli.command {
            Command::Bench {
                json,
                plot,
                sizes,
                iterations,
                ..
            } => {
                assert!(json);
                assert_eq!(plot.as_deref(), Some(std::path::Path::new("out.svg")));
                assert_eq!(sizes, vec![4096, 1 << 20]);
                assert_eq!(iterations, 5);
            }
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["cuweave", "bench", "--sizes", "12Q"]).is_err());
        assert!(Cli::try_parse_from(["cuweave", "bench", "--iterations", "0"]).is_err());
    }
}
