//! What `cuweave bench` measured ([`BenchReport`]), as plain data, and its text table.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// Everything one `cuweave bench` run measured; serialised as the `--json` output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// The device measured (device 0), e.g. `NVIDIA H100 80GB HBM3`.
    pub device: String,
    /// The sizes swept, in bytes.
    pub sizes: Vec<usize>,
    /// Repetitions per point (the median is reported, after one warm-up).
    pub iterations: usize,
    /// One line of the plot per (direction, method).
    pub series: Vec<Series>,
    /// Copy latencies.
    pub latency: Vec<Latency>,
    /// The staging configuration cuweave's pipelined copies ran with at the largest size.
    pub staging: Staging,
    /// Transfers run at the same time from several host threads (absent in older reports).
    #[serde(default)]
    pub concurrent: Vec<Concurrent>,
}

/// Several transfers at once on several host threads: the raw driver calls and cuweave, each
/// as the total bandwidth of all of them together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Concurrent {
    /// What ran, e.g. `1GiB up + 1GiB down, 2 threads`.
    pub case: String,
    /// The raw calls and their memory, e.g. `raw pinned`.
    pub raw: String,
    /// Their bandwidth together, GB/s.
    pub raw_gbps: f64,
    /// cuweave's bandwidth together (from pageable memory), GB/s.
    pub cuweave_gbps: f64,
}

/// The pipelined-copy configuration, as reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staging {
    /// Bytes per chunk.
    pub chunk_bytes: usize,
    /// Blocks in flight per worker.
    pub depth: usize,
    /// Host threads.
    pub threads: usize,
}

/// Bandwidth of one method in one direction across the sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Series {
    /// `H2D`, `D2H`, `D2D` or `P2P 0->1`.
    pub direction: String,
    /// What ran, e.g. `raw pageable (cuMemcpyHtoD)` or `cuweave staged`.
    pub method: String,
    /// Whether this is one of cuweave's methods (drawn solid) or a raw driver call (dashed).
    pub cuweave: bool,
    /// `(bytes, GB/s)` per size measured.
    pub points: Vec<Point>,
}

/// One measurement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// Bytes per copy.
    pub bytes: usize,
    /// Median bandwidth, GB/s (10^9 bytes per second).
    pub gbps: f64,
}

/// A latency figure: the median host-observed time of a 4-byte copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// What was copied how.
    pub name: String,
    /// Median microseconds.
    pub micros: f64,
}

/// `4KiB`, `64KiB`, `1MiB`, `1GiB`.
pub fn size_label(bytes: usize) -> String {
    const KIB: usize = 1 << 10;
    const MIB: usize = 1 << 20;
    const GIB: usize = 1 << 30;
    match bytes {
        b if b >= GIB && b % GIB == 0 => format!("{}GiB", b / GIB),
        b if b >= MIB && b % MIB == 0 => format!("{}MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{}KiB", b / KIB),
        b => format!("{b}B"),
    }
}

/// Parses `4K`, `64KiB`, `1M`, `256MiB`, `1G`, `4096`.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let value: usize = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a size (e.g. 4K, 64KiB, 1M, 1G)"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("`{text}`: unknown unit `{unit}` (use K, M or G)")),
    };
    let bytes = value
        .checked_mul(1 << shift)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("`{text}` is zero or too large"))?;
    // The latency rows move 4 bytes and the four-thread case a quarter of the largest size.
    if bytes < MIN_SIZE {
        return Err(format!(
            "`{text}` is under {MIN_SIZE} bytes, the smallest size the bench measures"
        ));
    }
    Ok(bytes)
}

/// The smallest size `--sizes` takes.
pub const MIN_SIZE: usize = 4;

impl BenchReport {
    /// Checks a report read back from JSON (`--from-json`) for figures no run can measure: no
    /// iterations, sizes under [`MIN_SIZE`], and bandwidths or latencies that are negative (the
    /// JSON cannot hold a NaN or an infinity), so that a bad file is refused as the calibration
    /// loader refuses one, rather than printed and plotted.
    ///
    /// # Errors
    /// What is wrong, and where.
    pub fn check(&self) -> Result<(), String> {
        if self.iterations == 0 {
            return Err("`iterations` is 0: a report holds the median of at least one run".into());
        }
        let sizes = self.sizes.iter().copied().chain(
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.bytes)),
        );
        for bytes in sizes {
            if bytes < MIN_SIZE {
                return Err(format!(
                    "a size of {bytes} bytes: the bench measures sizes from {MIN_SIZE} bytes"
                ));
            }
        }
        let figure = |value: f64, what: &dyn Fn() -> String| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(format!("{}: {value} is not a measured figure", what()))
            }
        };
        for series in &self.series {
            for point in &series.points {
                figure(point.gbps, &|| {
                    format!(
                        "{} {} at {} bytes, GB/s",
                        series.direction, series.method, point.bytes
                    )
                })?;
            }
        }
        for latency in &self.latency {
            figure(latency.micros, &|| format!("latency {}, µs", latency.name))?;
        }
        for case in &self.concurrent {
            figure(case.raw_gbps, &|| {
                format!("{}, {} GB/s", case.case, case.raw)
            })?;
            figure(case.cuweave_gbps, &|| {
                format!("{}, cuweave GB/s", case.case)
            })?;
        }
        Ok(())
    }

    /// The report as text: a table per direction (sizes down, methods across, GB/s), then the
    /// latencies.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "cuweave bench: {} (median of {} runs; GB/s = 10^9 bytes/s)",
            self.device, self.iterations
        );
        let _ = writeln!(
            out,
            "staging: {} chunks, depth {}, {} threads",
            size_label(self.staging.chunk_bytes),
            self.staging.depth,
            self.staging.threads
        );
        let mut directions: Vec<&str> = Vec::new();
        for s in &self.series {
            if !directions.contains(&s.direction.as_str()) {
                directions.push(&s.direction);
            }
        }
        for direction in directions {
            let series: Vec<&Series> = self
                .series
                .iter()
                .filter(|s| s.direction == direction)
                .collect();
            let _ = writeln!(out, "\n{direction}");
            let widths: Vec<usize> = series.iter().map(|s| s.method.len().max(8)).collect();
            let _ = write!(out, "  {:>8}", "size");
            for (s, w) in series.iter().zip(&widths) {
                let _ = write!(out, "  {:>w$}", s.method);
            }
            out.push('\n');
            for &bytes in &self.sizes {
                let _ = write!(out, "  {:>8}", size_label(bytes));
                for (s, w) in series.iter().zip(&widths) {
                    match s.points.iter().find(|p| p.bytes == bytes) {
                        Some(p) => {
                            let _ = write!(out, "  {:>w$.2}", p.gbps);
                        }
                        None => {
                            let _ = write!(out, "  {:>w$}", "-");
                        }
                    }
                }
                out.push('\n');
            }
        }
        if !self.concurrent.is_empty() {
            out.push_str("\nconcurrent transfers (GB/s, all threads together)\n");
            for c in &self.concurrent {
                let _ = writeln!(
                    out,
                    "  {:<40} {} {:>7.2}, cuweave pageable {:>7.2}",
                    c.case, c.raw, c.raw_gbps, c.cuweave_gbps
                );
            }
        }
        if !self.latency.is_empty() {
            out.push_str("\nlatency (4-byte copy, host-observed, median)\n");
            for l in &self.latency {
                let _ = writeln!(out, "  {:<48} {:>8.2} us", l.name, l.micros);
            }
        }
        out.pop();
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> BenchReport {
        BenchReport {
            device: "NVIDIA H100 80GB HBM3".to_owned(),
            sizes: vec![4096, 1 << 30],
            iterations: 5,
            series: vec![
                Series {
                    direction: "H2D".to_owned(),
                    method: "raw pageable".to_owned(),
                    cuweave: false,
                    points: vec![
                        Point {
                            bytes: 4096,
                            gbps: 0.5,
                        },
                        Point {
                            bytes: 1 << 30,
                            gbps: 7.0,
                        },
                    ],
                },
                Series {
                    direction: "H2D".to_owned(),
                    method: "cuweave staged".to_owned(),
                    cuweave: true,
                    points: vec![Point {
                        bytes: 1 << 30,
                        gbps: 31.25,
                    }],
                },
            ],
            latency: vec![Latency {
                name: "H2D raw pinned".to_owned(),
                micros: 5.5,
            }],
            concurrent: vec![Concurrent {
                case: "1GiB up + 1GiB down, 2 threads".to_owned(),
                raw: "raw pinned".to_owned(),
                raw_gbps: 90.0,
                cuweave_gbps: 80.5,
            }],
            staging: Staging {
                chunk_bytes: 4 << 20,
                depth: 2,
                threads: 12,
            },
        }
    }

    #[test]
    fn a_sample_report_passes_its_check_and_bad_figures_fail_it() {
        let good = sample();
        assert_eq!(good.check(), Ok(()));
        let mut negative = sample();
        negative.series[0].points[0].gbps = -1.0;
        assert!(negative.check().unwrap_err().contains("-1"));
        let mut latency = sample();
        latency.latency[0].micros = -0.5;
        assert!(latency.check().unwrap_err().contains("latency"));
        let mut tiny = sample();
        tiny.sizes[0] = 0;
        assert!(tiny.check().unwrap_err().contains("0 bytes"));
        let mut none = sample();
        none.iterations = 0;
        assert!(none.check().is_err());
    }

    #[test]
    fn reports_round_trip_through_json_for_from_json() {
        let report = sample();
        let json = serde_json::to_string(&report).unwrap();
        assert_eq!(serde_json::from_str::<BenchReport>(&json).unwrap(), report);
    }

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert_eq!(parse_size("4"), Ok(4));
        for tiny in ["1", "2", "3b"] {
            assert!(parse_size(tiny).is_err(), "{tiny}");
        }
        assert!(parse_size("1T").is_err());
        assert!(parse_size("abc").is_err());
        assert_eq!(size_label(4096), "4KiB");
        assert_eq!(size_label(256 << 20), "256MiB");
        assert_eq!(size_label((1 << 20) + 3), "1048579B");
    }

    #[test]
    fn the_table_has_a_row_per_size_and_a_column_per_method() {
        let text = sample().text();
        let expected = "\
H2D
      size  raw pageable  cuweave staged
      4KiB          0.50               -
      1GiB          7.00           31.25

concurrent transfers (GB/s, all threads together)
  1GiB up + 1GiB down, 2 threads           raw pinned   90.00, cuweave pageable   80.50

latency (4-byte copy, host-observed, median)
  H2D raw pinned                                       5.50 us";
        assert!(text.ends_with(expected), "{text}");
        assert!(text.starts_with("cuweave bench: NVIDIA H100 80GB HBM3 (median of 5 runs"));
    }
}
