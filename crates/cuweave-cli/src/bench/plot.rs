//! The `--plot` SVG: bandwidth against size (log scale), one line per (direction, method).
//!
//! Written by hand: a few dozen elements need no plotting crate.

use std::fmt::Write as _;

use super::report::{BenchReport, size_label};

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 560.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 330.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const PALETTE: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#7f7f7f", "#bcbd22",
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

/// The report as an SVG document.
pub fn svg(report: &BenchReport) -> String {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let sizes: Vec<f64> = report.sizes.iter().map(|&b| (b as f64).log2()).collect();
    let (x_min, x_max) = sizes
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let x_span = if x_max > x_min { x_max - x_min } else { 1.0 };
    let y_max = nice_ceiling(
        report
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.gbps))
            .fold(0.0, f64::max),
    );
    let x = |bytes: usize| LEFT + ((bytes as f64).log2() - x_min) / x_span * plot_w;
    let y = |gbps: f64| TOP + plot_h - gbps / y_max * plot_h;

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">cuweave bench: {} — bandwidth vs copy size</text>"#,
        LEFT + plot_w / 2.0,
        escape(&report.device)
    );
    // Horizontal grid and y labels.
    for i in 0..=5 {
        let v = y_max * f64::from(i) / 5.0;
        let yy = y(v);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            yy + 4.0,
            if y_max >= 10.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        );
    }
    // Vertical ticks at each size.
    for &bytes in &report.sizes {
        let xx = x(bytes);
        let _ = writeln!(
            out,
            r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 18.0,
            size_label(bytes)
        );
    }
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w:.1}" height="{plot_h:.1}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">copy size (log scale)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 18.0
    );
    let _ = writeln!(
        out,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">GB/s</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    for (i, series) in report.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let dash = if series.cuweave {
            ""
        } else {
            r#" stroke-dasharray="6 4""#
        };
        let points: Vec<String> = series
            .points
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.bytes), y(p.gbps)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
            points.join(" ")
        );
        for p in &series.points {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#,
                x(p.bytes),
                y(p.gbps)
            );
        }
        let ly = TOP + 10.0 + 18.0 * i as f64;
        let lx = WIDTH - RIGHT + 20.0;
        let _ = writeln!(
            out,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{} {}</text>"#,
            lx + 28.0,
            lx + 34.0,
            ly + 4.0,
            escape(&series.direction),
            escape(&series.method)
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::tests::sample;

    #[test]
    fn the_plot_has_a_line_and_a_legend_entry_per_series() {
        let svg = svg(&sample());
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("H2D raw pageable") && svg.contains("H2D cuweave staged"));
        assert_eq!(
            svg.matches("stroke-dasharray").count(),
            2,
            "raw series are dashed (line + legend)"
        );
        assert!(svg.contains(">4KiB<") && svg.contains(">1GiB<"));
        assert!(svg.contains(">40<"), "y axis rounds 31.25 up to 40: {svg}");
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
