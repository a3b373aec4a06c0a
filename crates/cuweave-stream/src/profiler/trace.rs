//! Chrome trace (`chrome://tracing`, Perfetto) JSON of profiled operations, in GPU time.

use serde_json::{Value, json};

use super::report::ProfiledOperation;

/// The trace of `operations` on `device`: one complete (`"ph": "X"`) event per operation, on a
/// track per stream (`pid` = device ordinal, `tid` = stream id), with times in microseconds of
/// GPU time after the profiler's base event, plus metadata naming each track.
pub fn chrome_trace(device: usize, operations: &[ProfiledOperation]) -> Value {
    let mut events = Vec::with_capacity(operations.len() + 8);
    let mut streams: Vec<(u64, String)> = operations
        .iter()
        .map(|op| (op.stream, format!("stream {} ({})", op.stream, op.priority)))
        .collect();
    streams.sort();
    streams.dedup();
    events.push(json!({
        "name": "process_name", "ph": "M", "pid": device, "tid": 0,
        "args": { "name": format!("GPU {device}") },
    }));
    for (stream, name) in streams {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": device, "tid": stream,
            "args": { "name": name },
        }));
    }
    for op in operations {
        events.push(json!({
            "name": op.name,
            "cat": op.kind.name(),
            "ph": "X",
            "pid": device,
            "tid": op.stream,
            "ts": op.start_ns as f64 / 1e3,
            "dur": op.duration_ns as f64 / 1e3,
            "args": { "bytes": op.bytes, "priority": op.priority.to_string() },
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ns" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StreamPriority;
    use crate::stream::OperationKind;

    #[test]
    fn trace_has_a_complete_event_per_operation_on_its_stream_track() {
        let ops = vec![
            ProfiledOperation {
                stream: 4,
                priority: StreamPriority::High,
                name: "spin".into(),
                kind: OperationKind::KernelLaunch,
                bytes: 0,
                start_ns: 1_500,
                duration_ns: 2_000,
            },
            ProfiledOperation {
                stream: 9,
                priority: StreamPriority::Low,
                name: "upload".into(),
                kind: OperationKind::Copy,
                bytes: 64,
                start_ns: 0,
                duration_ns: 500,
            },
        ];
        let trace = chrome_trace(0, &ops);
        let events = trace["traceEvents"].as_array().unwrap();
        let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(complete.len(), 2);
        assert_eq!(complete[0]["tid"], 4);
        assert_eq!(complete[0]["ts"], 1.5);
        assert_eq!(complete[0]["dur"], 2.0);
        assert_eq!(complete[1]["cat"], "copy");
        let names: Vec<&Value> = events
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .collect();
        assert_eq!(names.len(), 2);
        assert_eq!(names[0]["args"]["name"], "stream 4 (high)");
    }
}
