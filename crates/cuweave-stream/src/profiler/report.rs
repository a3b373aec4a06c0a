//! [`ProfileReport`]: per-stream and combined summaries of profiled operations, in GPU time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::priority::StreamPriority;
use crate::stream::OperationKind;

/// One profiled operation, timed on the GPU relative to the profiler's base event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfiledOperation {
    /// The stream's id.
    pub stream: u64,
    /// The stream's priority level.
    pub priority: StreamPriority,
    /// The name given when profiling.
    pub name: String,
    /// What kind of operation it was.
    pub kind: OperationKind,
    /// Bytes it moved (0 for kernels).
    pub bytes: u64,
    /// GPU start, nanoseconds after the base event.
    pub start_ns: u64,
    /// GPU duration in nanoseconds (timing-event resolution is about 0.5 µs).
    pub duration_ns: u64,
}

impl ProfiledOperation {
    /// GPU end, nanoseconds after the base event (saturating: a record loaded from a file may
    /// hold any figures).
    pub fn end_ns(&self) -> u64 {
        self.start_ns.saturating_add(self.duration_ns)
    }
}

/// Totals of one named operation on a stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedTotal {
    /// The operation name.
    pub name: String,
    /// How many times it ran.
    pub count: u64,
    /// Its GPU time in all, in nanoseconds.
    pub total_ns: u64,
}

/// What one stream did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamReport {
    /// The stream's id.
    pub stream: u64,
    /// Its priority level.
    pub priority: StreamPriority,
    /// Operations profiled.
    pub operations: u64,
    /// Copies among them.
    pub copies: u64,
    /// Kernel launches among them.
    pub kernel_launches: u64,
    /// Graph launches among them.
    pub graph_launches: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Sum of their GPU durations.
    pub gpu_time_ns: u64,
    /// First start and last end, after the base event.
    pub span_ns: (u64, u64),
    /// Totals per operation name, by name.
    pub by_name: Vec<NamedTotal>,
}

/// All streams together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CombinedReport {
    /// Streams that ran profiled work.
    pub streams: usize,
    /// Operations profiled.
    pub operations: u64,
    /// Copies.
    pub copies: u64,
    /// Kernel launches.
    pub kernel_launches: u64,
    /// Graph launches among them.
    pub graph_launches: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Sum of every operation's GPU duration.
    pub gpu_time_ns: u64,
    /// GPU time during which at least one profiled operation ran (the union of the intervals).
    pub busy_ns: u64,
    /// `gpu_time_ns - busy_ns`: time saved by operations overlapping.
    pub overlap_ns: u64,
    /// First start to last end.
    pub span_ns: (u64, u64),
}

/// Per-stream and combined summaries of a [`StreamProfiler`](super::StreamProfiler)'s operations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileReport {
    /// One entry per stream, by id.
    pub streams: Vec<StreamReport>,
    /// Everything together.
    pub combined: CombinedReport,
}

impl ProfileReport {
    /// Summarizes `operations`.
    pub fn from_operations(operations: &[ProfiledOperation]) -> Self {
        let mut by_stream: BTreeMap<u64, Vec<&ProfiledOperation>> = BTreeMap::new();
        for op in operations {
            by_stream.entry(op.stream).or_default().push(op);
        }
        let streams = by_stream
            .into_iter()
            .map(|(stream, ops)| {
                let mut names: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
                for op in &ops {
                    let entry = names.entry(op.name.as_str()).or_default();
                    entry.0 += 1;
                    entry.1 = entry.1.saturating_add(op.duration_ns);
                }
                StreamReport {
                    stream,
                    priority: ops[0].priority,
                    operations: ops.len() as u64,
                    copies: count(&ops, OperationKind::Copy),
                    kernel_launches: count(&ops, OperationKind::KernelLaunch),
                    graph_launches: count(&ops, OperationKind::GraphLaunch),
                    bytes: saturating_sum(ops.iter().map(|op| op.bytes)),
                    gpu_time_ns: saturating_sum(ops.iter().map(|op| op.duration_ns)),
                    span_ns: span(ops.iter().copied()),
                    by_name: names
                        .into_iter()
                        .map(|(name, (count, total_ns))| NamedTotal {
                            name: name.to_string(),
                            count,
                            total_ns,
                        })
                        .collect(),
                }
            })
            .collect::<Vec<_>>();
        let all: Vec<&ProfiledOperation> = operations.iter().collect();
        let gpu_time_ns = saturating_sum(all.iter().map(|op| op.duration_ns));
        let busy_ns = union_length(all.iter().map(|op| (op.start_ns, op.end_ns())));
        let combined = CombinedReport {
            streams: streams.len(),
            operations: all.len() as u64,
            copies: count(&all, OperationKind::Copy),
            kernel_launches: count(&all, OperationKind::KernelLaunch),
            graph_launches: count(&all, OperationKind::GraphLaunch),
            bytes: saturating_sum(all.iter().map(|op| op.bytes)),
            gpu_time_ns,
            busy_ns,
            overlap_ns: gpu_time_ns.saturating_sub(busy_ns),
            span_ns: span(all.iter().copied()),
        };
        Self { streams, combined }
    }
}

/// The sum of `values`, at most `u64::MAX`: reports are also made of records loaded from files.
fn saturating_sum(values: impl Iterator<Item = u64>) -> u64 {
    values.fold(0, u64::saturating_add)
}

fn count(ops: &[&ProfiledOperation], kind: OperationKind) -> u64 {
    ops.iter().filter(|op| op.kind == kind).count() as u64
}

fn span<'a>(ops: impl Iterator<Item = &'a ProfiledOperation>) -> (u64, u64) {
    ops.fold(None, |acc: Option<(u64, u64)>, op| {
        Some(match acc {
            None => (op.start_ns, op.end_ns()),
            Some((s, e)) => (s.min(op.start_ns), e.max(op.end_ns())),
        })
    })
    .unwrap_or((0, 0))
}

/// Total length covered by the half-open intervals `[start, end)`.
pub(crate) fn union_length(intervals: impl Iterator<Item = (u64, u64)>) -> u64 {
    let mut intervals: Vec<(u64, u64)> = intervals.filter(|(s, e)| e > s).collect();
    intervals.sort_unstable();
    let mut total = 0;
    let mut current: Option<(u64, u64)> = None;
    for (start, end) in intervals {
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                total = u64::saturating_add(total, e - s);
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    total.saturating_add(current.map_or(0, |(s, e)| e - s))
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl std::fmt::Display for ProfileReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:>8} {:>8} {:>6} {:>7} {:>9} {:>14} {:>12}",
            "stream", "priority", "ops", "copies", "launches", "bytes", "GPU ms"
        )?;
        for s in &self.streams {
            writeln!(
                f,
                "{:>8} {:>8} {:>6} {:>7} {:>9} {:>14} {:>12.3}",
                s.stream,
                s.priority.to_string(),
                s.operations,
                s.copies,
                s.kernel_launches,
                s.bytes,
                ms(s.gpu_time_ns)
            )?;
            for named in &s.by_name {
                writeln!(
                    f,
                    "{:>17} {:<24} x{:<6} {:>12.3}",
                    "",
                    named.name,
                    named.count,
                    ms(named.total_ns)
                )?;
            }
        }
        let c = &self.combined;
        write!(
            f,
            "all {} streams: {} ops, {} copies, {} launches, {} bytes; GPU time {:.3} ms, busy {:.3} ms, overlap {:.3} ms, span {:.3}..{:.3} ms",
            c.streams,
            c.operations,
            c.copies,
            c.kernel_launches,
            c.bytes,
            ms(c.gpu_time_ns),
            ms(c.busy_ns),
            ms(c.overlap_ns),
            ms(c.span_ns.0),
            ms(c.span_ns.1)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(&[], 0)]
    #[case(&[(0, 10)], 10)]
    #[case(&[(0, 10), (5, 15)], 15)]
    #[case(&[(0, 10), (10, 20)], 20)]
    #[case(&[(0, 10), (20, 30), (2, 3)], 20)]
    #[case(&[(5, 5)], 0)]
    fn union_length_merges_overlaps(#[case] intervals: &[(u64, u64)], #[case] expected: u64) {
        assert_eq!(union_length(intervals.iter().copied()), expected);
    }

    fn op(
        stream: u64,
        name: &str,
        kind: OperationKind,
        start: u64,
        duration: u64,
    ) -> ProfiledOperation {
        ProfiledOperation {
            stream,
            priority: StreamPriority::Normal,
            name: name.to_string(),
            kind,
            bytes: if kind == OperationKind::Copy { 100 } else { 0 },
            start_ns: start,
            duration_ns: duration,
        }
    }

    #[test]
    fn reports_split_by_stream_and_measure_overlap() {
        let ops = [
            op(1, "spin", OperationKind::KernelLaunch, 0, 1_000),
            op(1, "copy", OperationKind::Copy, 1_000, 500),
            op(2, "spin", OperationKind::KernelLaunch, 200, 1_000),
        ];
        let report = ProfileReport::from_operations(&ops);
        assert_eq!(report.streams.len(), 2);
        assert_eq!(report.streams[0].operations, 2);
        assert_eq!(report.streams[0].span_ns, (0, 1_500));
        assert_eq!(report.streams[0].by_name.len(), 2);
        assert_eq!(report.combined.gpu_time_ns, 2_500);
        assert_eq!(report.combined.busy_ns, 1_500);
        assert_eq!(report.combined.overlap_ns, 1_000);
        assert_eq!(report.combined.copies, 1);
        assert_eq!(report.combined.bytes, 100);
        let text = report.to_string();
        assert!(text.contains("overlap 0.001 ms"), "{text}");
        let json = serde_json::to_string(&report).unwrap();
        let back: ProfileReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back, report);
    }
}
