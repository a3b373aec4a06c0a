//! The `--plot` SVG: bandwidth against size (log scale), one panel per direction (each with its
//! own bandwidth scale, since device-to-device copies run 30 times faster than host copies) and
//! one line per method; raw driver calls dashed, cuweave's methods solid.
//!
//! Written by hand: a few hundred elements need no plotting crate.

use std::fmt::Write as _;

use super::report::{BenchReport, Series, size_label};

const WIDTH: f64 = 960.0;
const PANEL_HEIGHT: f64 = 250.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 330.0;
const TITLE: f64 = 40.0;
const GAP: f64 = 50.0;
const PALETTE: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A round axis maximum at or above `max` (1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power of ten).
fn nice_ceiling(max: f64) -> f64 {
    if max <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(max.log10().floor());
    [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&v| v >= max)
        .unwrap_or(10.0 * magnitude)
}

/// The directions in the order they first appear.
fn directions(report: &BenchReport) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for s in &report.series {
        if !out.contains(&s.direction.as_str()) {
            out.push(&s.direction);
        }
    }
    out
}

/// The report as an SVG document.
pub fn svg(report: &BenchReport) -> String {
    let directions = directions(report);
    let height = TITLE + directions.len() as f64 * (PANEL_HEIGHT + GAP);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">cuweave bench: {} — bandwidth (GB/s) vs copy size, median of {} runs</text>"#,
        WIDTH / 2.0,
        escape(&report.device),
        report.iterations
    );
    for (i, direction) in directions.iter().enumerate() {
        let top = TITLE + i as f64 * (PANEL_HEIGHT + GAP);
        let series: Vec<&Series> = report
            .series
            .iter()
            .filter(|s| s.direction == *direction)
            .collect();
        panel(&mut out, report, direction, &series, top);
    }
    out.push_str("</svg>\n");
    out
}

fn panel(out: &mut String, report: &BenchReport, direction: &str, series: &[&Series], top: f64) {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = PANEL_HEIGHT;
    // A report read back from JSON may name a 0-byte size: drawn where 1 byte would be, so that
    // no coordinate is `log2(0)` (every x would be NaN).
    let log_size = |bytes: usize| (bytes.max(1) as f64).log2();
    let logs: Vec<f64> = report.sizes.iter().map(|&b| log_size(b)).collect();
    let (x_min, x_max) = logs
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let x_span = if x_max > x_min { x_max - x_min } else { 1.0 };
    let y_max = nice_ceiling(
        series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.gbps))
            .fold(0.0, f64::max),
    );
    let x = |bytes: usize| {
        if x_max > x_min {
            LEFT + (log_size(bytes) - x_min) / x_span * plot_w
        } else {
            LEFT + plot_w / 2.0
        }
    };
    let y = |gbps: f64| top + plot_h - gbps / y_max * plot_h;
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="{:.1}" font-size="13" font-weight="bold">{}</text>"#,
        top - 8.0,
        escape(direction)
    );
    for i in 0..=5 {
        let v = y_max * f64::from(i) / 5.0;
        let yy = y(v);
        let label = if y_max >= 10.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        };
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{label}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            yy + 4.0
        );
    }
    for &bytes in &report.sizes {
        let xx = x(bytes);
        let _ = writeln!(
            out,
            r##"<line x1="{xx:.1}" y1="{top:.1}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            top + plot_h,
            top + plot_h + 16.0,
            size_label(bytes)
        );
    }
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{top:.1}" width="{plot_w:.1}" height="{plot_h:.1}" fill="none" stroke="#333"/>"##
    );
    // The bus limit: the best a pinned copy reached in this direction, drawn across the panel
    // so every pageable curve can be read against it.
    let limit = series
        .iter()
        .filter(|s| s.method.starts_with("raw pinned"))
        .flat_map(|s| s.points.iter().map(|p| p.gbps))
        .fold(0.0, f64::max);
    if limit > 0.0 {
        let yy = y(limit);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#000" stroke-dasharray="2 3"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">pinned limit {limit:.1} GB/s</text>"##,
            LEFT + plot_w,
            LEFT + plot_w - 4.0,
            yy - 4.0
        );
    }
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let dash = if s.cuweave {
            ""
        } else {
            r#" stroke-dasharray="6 4""#
        };
        let points: Vec<String> = s
            .points
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.bytes), y(p.gbps)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
            points.join(" ")
        );
        for p in &s.points {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#,
                x(p.bytes),
                y(p.gbps)
            );
        }
        let ly = top + 12.0 + 18.0 * i as f64;
        let lx = WIDTH - RIGHT + 20.0;
        let _ = writeln!(
            out,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 28.0,
            lx + 34.0,
            ly + 4.0,
            escape(&s.method)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::tests::sample;

    #[test]
    fn the_plot_has_a_panel_per_direction_and_a_line_per_series() {
        let mut report = sample();
        let mut d2d = report.series[0].clone();
        d2d.direction = "D2D".to_owned();
        d2d.points[1].gbps = 1400.0;
        report.series.push(d2d);
        let svg = svg(&report);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.contains(">H2D</text>") && svg.contains(">D2D</text>"));
        assert!(svg.contains(">raw pageable<") && svg.contains(">cuweave staged<"));
        // Raw series are dashed: two raw series, line and legend each.
        assert_eq!(svg.matches("stroke-dasharray").count(), 4);
        assert!(svg.contains(">4KiB<") && svg.contains(">1GiB<"));
        // Each panel has its own scale: 31.25 rounds up to 40, 1400 to 1500.
        assert!(svg.contains(">40<") && svg.contains(">1500<"), "{svg}");
    }

    #[test]
    fn the_pinned_limit_is_drawn_across_its_panel() {
        let mut report = sample();
        let mut pinned = report.series[0].clone();
        pinned.method = "raw pinned".to_owned();
        pinned.points[1].gbps = 55.0;
        report.series.push(pinned);
        let svg = svg(&report);
        assert_eq!(svg.matches("pinned limit 55.0 GB/s").count(), 1, "{svg}");
    }

    #[test]
    fn axis_ceilings_are_round() {
        assert_eq!(nice_ceiling(31.25), 40.0);
        assert_eq!(nice_ceiling(390.0), 400.0);
        assert_eq!(nice_ceiling(1400.0), 1500.0);
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert!((nice_ceiling(0.55) - 0.6).abs() < 1e-12);
    }
}
