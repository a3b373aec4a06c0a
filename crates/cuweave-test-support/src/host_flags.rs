//! [`HostFlags`]: `u32` words of mapped pinned memory that kernels store into and gate on while
//! the host reads and opens them.

use std::sync::Arc;

use cuweave_driver::Context;
use cuweave_driver::memory::{HostAllocFlags, HostAllocation};

/// `u32` words of mapped pinned memory: kernels store into them (or spin on them) through
/// [`device`](Self::device), the host reads and writes them with volatile accesses while kernels
/// may run. Dropping it opens every word as a gate (writes 1), so a failing test never leaves a
/// kernel spinning on one.
pub struct HostFlags {
    memory: HostAllocation,
    len: usize,
    device: u64,
}

impl HostFlags {
    /// `len` zeroed words in `context`.
    ///
    /// # Panics
    /// When the driver refuses the allocation (a test helper).
    pub fn new(context: &Arc<Context>, len: usize) -> Self {
        let mut memory =
            HostAllocation::new(context, len * 4, HostAllocFlags::PORTABLE_MAPPED).unwrap();
        memory.as_bytes_mut().fill(0);
        let device = memory.device_ptr().unwrap();
        Self {
            memory,
            len,
            device,
        }
    }

    /// The device address of word `index`.
    pub fn device(&self, index: usize) -> u64 {
        assert!(index < self.len);
        self.device + 4 * index as u64
    }

    /// Word `index` as the host sees it now.
    pub fn read(&self, index: usize) -> u32 {
        assert!(index < self.len);
        // SAFETY: in bounds of a live, 4-byte-aligned allocation; a volatile read of a word a
        // kernel may be storing to (aligned 32-bit stores do not tear).
        unsafe { std::ptr::read_volatile(self.memory.as_ptr().cast::<u32>().add(index)) }
    }

    /// Stores `value` into word `index`, then a full fence.
    pub fn write(&self, index: usize, value: u32) {
        assert!(index < self.len);
        // SAFETY: as `read`; kernels only read these words with volatile loads meanwhile.
        unsafe {
            std::ptr::write_volatile(
                self.memory.as_ptr().cast::<u32>().cast_mut().add(index),
                value,
            )
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for HostFlags {
    fn drop(&mut self) {
        for index in 0..self.len {
            self.write(index, 1);
        }
    }
}
