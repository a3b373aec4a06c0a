//! [`SharedLog`]: a log sink a test reads back (a `LoggingAdaptor`'s writer). Included by the
//! test binaries that use it (`#[path = "common/shared_log.rs"] mod shared_log;`).

use std::sync::{Arc, Mutex};

/// A log sink the test reads back.
#[derive(Clone, Default)]
pub struct SharedLog(Arc<Mutex<Vec<u8>>>);

impl SharedLog {
    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).expect("the log is UTF-8")
    }
}

impl std::io::Write for SharedLog {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
