//! The JIT compiler's logs of a module load: two fixed buffers handed to `cuModuleLoadDataEx`
//! and read back, bounded and trimmed, into the error of a failed load. Without them a PTX
//! syntax error reaches the user as a bare `CUDA_ERROR_INVALID_PTX`.

use std::ffi::c_void;

use crate::sys;

/// Bytes of each log buffer (error and info), terminating NUL included: the driver caps its
/// messages at this size, so a failed load's log is at most this long per buffer. 16 KiB holds
/// a few hundred ptxas lines, far past the first error, which is the one that matters.
pub(crate) const JIT_LOG_BYTES: usize = 16 * 1024;

/// The option list `cuModuleLoadDataEx` takes, in the order [`JitLogs::options`] fills it.
const OPTIONS: [sys::CUjit_option; 4] = [
    sys::CUjit_option::CU_JIT_INFO_LOG_BUFFER,
    sys::CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
    sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
    sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
];
const INFO_SIZE: usize = 1;
const ERROR_SIZE: usize = 3;

/// The two zeroed log buffers of one load.
pub(super) struct JitLogs {
    info: Vec<u8>,
    error: Vec<u8>,
}

impl JitLogs {
    pub(super) fn new() -> Self {
        Self {
            info: vec![0; JIT_LOG_BYTES],
            error: vec![0; JIT_LOG_BYTES],
        }
    }

    /// The options and their values for `cuModuleLoadDataEx`: each buffer's address, then its
    /// size carried in the value slot itself (the driver reads an `unsigned int` from the slot,
    /// not through it, and writes back the bytes it filled). The addresses point into `self`'s
    /// heap buffers, which stay put while `self` lives.
    pub(super) fn options(&mut self) -> ([sys::CUjit_option; 4], [*mut c_void; 4]) {
        let values = [
            self.info.as_mut_ptr().cast(),
            std::ptr::without_provenance_mut(self.info.len()),
            self.error.as_mut_ptr().cast(),
            std::ptr::without_provenance_mut(self.error.len()),
        ];
        (OPTIONS, values)
    }

    /// The log after the call: the error log, then the info log on the lines after it, each
    /// cut at the length the driver reported in `values` and trimmed.
    pub(super) fn into_log(self, values: &[*mut c_void; 4]) -> String {
        let error = log_text(&self.error, filled(values[ERROR_SIZE]));
        let info = log_text(&self.info, filled(values[INFO_SIZE]));
        join_logs(error, info)
    }
}

/// The byte count the driver wrote back into a size slot: an `unsigned int`, so only the low
/// 32 bits count (the high ones still hold the size passed in, which fits in 32 bits).
fn filled(value: *mut c_void) -> usize {
    value.addr() as u32 as usize
}

/// The text of one log buffer: at most `reported` bytes (the driver's count, terminating NUL
/// included) and never past the buffer, up to the first NUL, without a multi-byte character cut
/// in half at the end, and trimmed of surrounding whitespace. A count of zero (a driver that
/// left the slot alone would leave the size passed in, not zero; but should one write zero)
/// falls back to the whole buffer, which was zeroed, so only what the driver wrote is read.
pub(super) fn log_text(buffer: &[u8], reported: usize) -> String {
    let bound = if reported == 0 {
        buffer.len()
    } else {
        reported.min(buffer.len())
    };
    let bytes = &buffer[..bound];
    let bytes = bytes
        .iter()
        .position(|&byte| byte == 0)
        .map_or(bytes, |nul| &bytes[..nul]);
    let bytes = match std::str::from_utf8(bytes) {
        // Cut inside a character at the end: drop the partial character, keep the rest.
        Err(error) if error.error_len().is_none() => &bytes[..error.valid_up_to()],
        _ => bytes,
    };
    String::from_utf8_lossy(bytes).trim().to_owned()
}

/// The error log, then the info log after a newline; either alone when the other is empty.
pub(super) fn join_logs(error: String, info: String) -> String {
    match (error.is_empty(), info.is_empty()) {
        (_, true) => error,
        (true, false) => info,
        (false, false) => format!("{error}\n{info}"),
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::nul_terminated_count_includes_the_nul(b"abc\0", 4, "abc")]
    #[case::cut_at_the_reported_length(b"abcdef\0", 3, "abc")]
    #[case::a_count_past_the_buffer_is_clamped(b"abc\0", 1 << 20, "abc")]
    #[case::zero_reads_up_to_the_first_nul(b"abc\0", 0, "abc")]
    #[case::stops_at_the_first_nul(b"abc\0\0\0stale", 64, "abc")]
    #[case::no_nul_at_all(b"abc", 3, "abc")]
    #[case::trailing_newlines_and_spaces(b"line 7; error : x\n\n \0", 64, "line 7; error : x")]
    #[case::empty(b"\0\0\0\0", 4, "")]
    #[case::all_zero_with_zero_count(b"\0\0\0\0", 0, "")]
    #[case::a_character_cut_in_half(b"a\xC3\xA9", 2, "a")]
    #[case::a_whole_character(b"a\xC3\xA9\0", 4, "a\u{e9}")]
    #[case::invalid_bytes_inside_are_replaced(b"a\xFFb\0", 4, "a\u{fffd}b")]
    fn a_log_buffer_is_read_up_to_the_count_and_the_first_nul(
        #[case] buffer: &[u8],
        #[case] reported: usize,
        #[case] expected: &str,
    ) {
        assert_eq!(log_text(buffer, reported), expected);
    }

    /// A driver that fills the whole buffer with no NUL still yields at most the buffer.
    #[test]
    fn a_full_buffer_is_bounded_by_its_size() {
        let buffer = vec![b'x'; JIT_LOG_BYTES];
        let text = log_text(&buffer, usize::MAX);
        assert_eq!(text.len(), JIT_LOG_BYTES);
        assert!(!text.contains('\0'));
    }

    #[rstest]
    #[case::both("error : bad", "info : note", "error : bad\ninfo : note")]
    #[case::error_only("error : bad", "", "error : bad")]
    #[case::info_only("", "info : note", "info : note")]
    #[case::neither("", "", "")]
    fn the_error_log_comes_first(#[case] error: &str, #[case] info: &str, #[case] expected: &str) {
        assert_eq!(join_logs(error.to_owned(), info.to_owned()), expected);
    }

    /// What the driver sees and what is read back: each buffer's address and true size, and
    /// the text the driver wrote, cut at the counts it wrote into the size slots.
    #[test]
    fn the_options_describe_the_buffers_and_the_counts_are_read_back() {
        let mut logs = JitLogs::new();
        let (options, mut values) = logs.options();
        assert_eq!(options, OPTIONS);
        assert_eq!(values[0], logs.info.as_mut_ptr().cast::<c_void>());
        assert_eq!(values[2], logs.error.as_mut_ptr().cast::<c_void>());
        assert_eq!(filled(values[INFO_SIZE]), JIT_LOG_BYTES);
        assert_eq!(filled(values[ERROR_SIZE]), JIT_LOG_BYTES);

        // Play the driver: write both logs and their counts (NUL included) as 32-bit values
        // into the low half of each slot; the high half is not the driver's and is ignored.
        let error = b"ptxas application ptx input, line 7; error   : Unknown symbol\0stale";
        let info = b"ptxas info    : 0 bytes gmem\0";
        logs.error[..error.len()].copy_from_slice(error);
        logs.info[..info.len()].copy_from_slice(info);
        let error_count = error.iter().position(|&b| b == 0).unwrap() + 1;
        values[ERROR_SIZE] = std::ptr::without_provenance_mut((1 << 40) | error_count);
        values[INFO_SIZE] = std::ptr::without_provenance_mut(info.len());
        assert_eq!(
            logs.into_log(&values),
            "ptxas application ptx input, line 7; error   : Unknown symbol\n\
             ptxas info    : 0 bytes gmem"
        );
    }

    /// A slot the driver left alone still holds the buffer size: the text up to the NUL.
    #[test]
    fn an_untouched_count_reads_up_to_the_nul() {
        let mut logs = JitLogs::new();
        let (_, values) = logs.options();
        logs.error[..6].copy_from_slice(b"error\0");
        assert_eq!(logs.into_log(&values), "error");
    }
}
