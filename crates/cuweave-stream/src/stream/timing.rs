//! [`GpuTimer`]: GPU time of a stream's operations, from timing events recorded around them.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cuweave_driver::{Context, Event, EventFlags, Stream};
use parking_lot::Mutex;

use super::metrics::MetricsCounters;
use crate::error::Result;

/// A start event recorded before an operation; [`GpuTimer::end`] records its end.
#[derive(Debug)]
pub(crate) struct TimingToken {
    start: Event,
    end: Event,
}

/// Timing-event pairs around operations, read back once the GPU has passed them.
#[derive(Debug, Default)]
pub(crate) struct GpuTimer {
    enabled: AtomicBool,
    free: Mutex<Vec<(Event, Event)>>,
    pending: Mutex<VecDeque<(Event, Event)>>,
}

impl GpuTimer {
    pub(crate) fn set_enabled(&self, enabled: bool) {
        self.enabled.store(enabled, Ordering::Relaxed);
    }

    pub(crate) fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Records a start event on `stream` when timing is on.
    pub(crate) fn begin(
        &self,
        context: &Arc<Context>,
        stream: &Stream,
    ) -> Result<Option<TimingToken>> {
        if !self.is_enabled() {
            return Ok(None);
        }
        let recycled = self.free.lock().pop();
        let (start, end) = match recycled {
            Some(pair) => pair,
            None => (
                Event::new(context, EventFlags::TIMING)?,
                Event::new(context, EventFlags::TIMING)?,
            ),
        };
        start.record(stream)?;
        Ok(Some(TimingToken { start, end }))
    }

    /// Records the end event of `token` on `stream`; its time is read by [`harvest`](Self::harvest).
    pub(crate) fn end(&self, token: Option<TimingToken>, stream: &Stream) -> Result<()> {
        let Some(TimingToken { start, end }) = token else {
            return Ok(());
        };
        end.record(stream)?;
        self.pending.lock().push_back((start, end));
        Ok(())
    }

    /// Adds the GPU time of every finished timed operation (a prefix, by stream order) to
    /// `counters`, without blocking.
    pub(crate) fn harvest(&self, counters: &MetricsCounters) -> Result<()> {
        loop {
            let front = {
                let mut pending = self.pending.lock();
                match pending.front() {
                    Some((_, end)) if end.query()? => pending.pop_front(),
                    _ => None,
                }
            };
            let Some((start, end)) = front else {
                return Ok(());
            };
            let ms = start.elapsed_ms(&end)?;
            counters.add_gpu_time(1, (f64::from(ms) * 1e6).round() as u64);
            self.free.lock().push((start, end));
        }
    }
}
