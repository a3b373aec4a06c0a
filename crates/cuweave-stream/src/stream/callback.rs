//! Host callbacks that may call CUDA: the driver's thread only hands them to a cuweave worker.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam::channel::{self, Sender};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{StreamError, panic_message};

/// A host callback that panicked: the panic was caught on the worker thread and the later
/// callbacks still ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallbackFailure {
    /// The stream the callback was queued on.
    pub stream: u64,
    /// Its position among the stream's callbacks, from 0.
    pub sequence: u64,
    /// The panic message.
    pub message: String,
}

impl std::fmt::Display for CallbackFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "callback {} on stream {} panicked: {}",
            self.sequence, self.stream, self.message
        )
    }
}

type Job = (u64, Box<dyn FnOnce() + Send + 'static>);

/// How many callback failures a stream keeps (the latest); its panic count stays exact.
pub(crate) const FAILURES_KEPT: usize = 256;

/// What the worker shares with the stream.
#[derive(Debug, Default)]
struct Shared {
    /// The latest [`FAILURES_KEPT`] failures (the count in `panics` stays exact).
    failures: Mutex<std::collections::VecDeque<CallbackFailure>>,
    panics: AtomicU64,
}

/// One stream's callback worker: a thread (started on the first callback) that runs the
/// callbacks the driver's thread hands it, in the order the GPU reached them.
#[derive(Debug)]
pub(crate) struct CallbackWorker {
    stream: u64,
    sender: OnceLock<Sender<Job>>,
    next_sequence: AtomicU64,
    shared: Arc<Shared>,
}

impl CallbackWorker {
    pub(crate) fn new(stream: u64) -> Self {
        Self {
            stream,
            sender: OnceLock::new(),
            next_sequence: AtomicU64::new(0),
            shared: Arc::default(),
        }
    }

    /// The closure to hand to `cuLaunchHostFunc`: it only sends `callback` to the worker (no
    /// CUDA, no blocking: the channel is unbounded).
    pub(crate) fn relay(
        &self,
        callback: Box<dyn FnOnce() + Send + 'static>,
    ) -> Result<impl FnOnce() + Send + 'static, StreamError> {
        let sender = self.sender()?.clone();
        let sequence = self.next_sequence.fetch_add(1, Ordering::Relaxed);
        Ok(move || {
            // The worker outlives every sender; a send fails only if its thread died, which
            // `run` prevents by catching panics.
            if sender.send((sequence, callback)).is_err() {
                tracing::error!(
                    sequence,
                    "the stream's callback worker is gone; callback dropped"
                );
            }
        })
    }

    fn sender(&self) -> Result<&Sender<Job>, StreamError> {
        if let Some(sender) = self.sender.get() {
            return Ok(sender);
        }
        let (sender, receiver) = channel::unbounded::<Job>();
        let shared = Arc::clone(&self.shared);
        let stream = self.stream;
        let name = format!("cuweave-callbacks-{stream}");
        std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                // Ends when the stream and every queued relay have dropped their senders.
                for (sequence, callback) in receiver {
                    run(&shared, stream, sequence, callback);
                }
            })
            .map_err(|error| StreamError::ThreadSpawn {
                operation: "PriorityStream::add_callback",
                thread: name,
                reason: error.to_string(),
            })?;
        // Another thread may have won the race; its worker serves, ours ends at once because
        // its sender is dropped here.
        Ok(self.sender.get_or_init(|| sender))
    }

    pub(crate) fn failures(&self) -> Vec<CallbackFailure> {
        self.shared.failures.lock().iter().cloned().collect()
    }

    pub(crate) fn panics(&self) -> u64 {
        self.shared.panics.load(Ordering::Relaxed)
    }
}

fn run(shared: &Shared, stream: u64, sequence: u64, callback: Box<dyn FnOnce() + Send>) {
    if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(callback)) {
        let message = panic_message(&*payload);
        tracing::error!(stream, sequence, %message, "a stream callback panicked; the panic was caught");
        shared.panics.fetch_add(1, Ordering::Relaxed);
        let mut failures = shared.failures.lock();
        if failures.len() == FAILURES_KEPT {
            failures.pop_front();
        }
        failures.push_back(CallbackFailure {
            stream,
            sequence,
            message,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_stream_keeps_only_its_latest_failures_and_counts_every_panic() {
        let worker = CallbackWorker::new(3);
        let relays: Vec<_> = (0..1_000u32)
            .map(|i| {
                worker
                    .relay(Box::new(move || panic!("callback {i} fails")))
                    .unwrap()
            })
            .collect();
        let quiet = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        std::thread::spawn(move || relays.into_iter().for_each(|relay| relay()))
            .join()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while worker.panics() < 1_000 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::panic::set_hook(quiet);
        assert_eq!(worker.panics(), 1_000);
        let failures = worker.failures();
        assert_eq!(failures.len(), FAILURES_KEPT);
        assert!(
            failures[0]
                .message
                .contains(&format!("callback {} fails", 1_000 - FAILURES_KEPT))
        );
        assert!(
            failures[FAILURES_KEPT - 1]
                .message
                .contains("callback 999 fails")
        );
    }

    #[test]
    fn relayed_callbacks_run_in_order_and_panics_are_reported() {
        let worker = CallbackWorker::new(7);
        let (tx, rx) = mpsc::channel();
        let mut relays = Vec::new();
        for i in 0..4u32 {
            let tx = tx.clone();
            relays.push(
                worker
                    .relay(Box::new(move || {
                        assert!(i != 1, "callback {i} fails");
                        tx.send(i).unwrap();
                    }))
                    .unwrap(),
            );
        }
        // The "driver thread": runs the relays in stream order.
        std::thread::spawn(move || relays.into_iter().for_each(|relay| relay()))
            .join()
            .unwrap();
        let got: Vec<u32> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert_eq!(got, vec![0, 2, 3]);
        assert_eq!(worker.panics(), 1);
        let failures = worker.failures();
        assert_eq!(failures.len(), 1);
        assert_eq!(failures[0].sequence, 1);
        assert_eq!(failures[0].stream, 7);
        assert!(failures[0].message.contains("callback 1 fails"));
    }
}
