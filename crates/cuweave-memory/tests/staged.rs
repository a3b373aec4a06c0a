//! `Buffer::staged_write` / `staged_read`: chunks on several streams, ordered once per stream
//! after the buffer's earlier uses and recorded once per stream at the end.

use std::sync::Arc;

use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::MemoryError;
use cuweave_memory::buffer::{Buffer, DeviceBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const MS: u64 = 1_000_000;

fn streams(context: &Arc<Context>, n: usize) -> Vec<Stream> {
    (0..n)
        .map(|_| Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream"))
        .collect()
}

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

#[test]
fn chunks_on_many_streams_land_after_earlier_uses_and_before_later_ones() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("test kernels");
    let (len, chunk) = (1 << 20, 100_000);
    let old = pattern(len, 1);
    let new = pattern(len, 2);
    let mut buffer = DeviceBuffer::<u32>::zeroed(context, len).unwrap();
    // An earlier write, queued behind a 50 ms spin on another stream: the staged chunks must
    // land after it, although they are queued on streams that never saw it.
    let other = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&other, 50 * MS).unwrap();
    let pending = buffer.copy_from_host_async(old, &other).unwrap();
    let lanes = streams(context, 3);
    buffer
        .staged_write(0, len, &lanes, |staged| {
            assert_eq!((staged.len(), staged.streams()), (len, 3));
            let mut copies = Vec::new();
            for (i, start) in (0..len).step_by(chunk).enumerate() {
                let piece = new[start..(start + chunk).min(len)].to_vec();
                copies.push(staged.copy_in(i % 3, start, piece).unwrap());
            }
            for copy in copies {
                drop(copy.wait().unwrap());
            }
        })
        .unwrap();
    drop(pending.wait().unwrap());
    // The write was recorded on every lane: a blocking read sees every chunk.
    assert_eq!(buffer.to_vec().unwrap(), new);

    // Reads in chunks, behind a 50 ms spin on one lane: the result is in the host sides.
    kernels.spin_ns(&lanes[1], 50 * MS).unwrap();
    let back = buffer
        .staged_read(0, len, &lanes, |staged| {
            let copies: Vec<_> = (0..len)
                .step_by(chunk)
                .enumerate()
                .map(|(i, start)| {
                    let n = chunk.min(len - start);
                    staged.copy_out(i % 3, start, vec![0u32; n]).unwrap()
                })
                .collect();
            copies
                .into_iter()
                .flat_map(|copy| copy.wait().unwrap())
                .collect::<Vec<u32>>()
        })
        .unwrap();
    assert_eq!(back, new);
}

#[test]
fn chunks_outside_the_range_or_the_streams_are_typed_errors() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let mut buffer = DeviceBuffer::<u32>::zeroed(context, 1000).unwrap();
    let lanes = streams(context, 2);
    buffer
        .staged_write(100, 500, &lanes, |staged| {
            assert!(matches!(
                staged.copy_in(2, 0, vec![1u32; 10]),
                Err(MemoryError::OutOfRange { .. })
            ));
            assert!(matches!(
                staged.copy_in(0, 495, vec![1u32; 10]),
                Err(MemoryError::OutOfRange { .. })
            ));
            drop(
                staged
                    .copy_in(1, 490, vec![7u32; 10])
                    .unwrap()
                    .wait()
                    .unwrap(),
            );
        })
        .unwrap();
    let all = buffer.to_vec().unwrap();
    assert!(all[590..600].iter().all(|&x| x == 7));
    assert!(all[..590].iter().chain(&all[600..]).all(|&x| x == 0));
    assert!(matches!(
        buffer.staged_write(900, 200, &lanes, |_| ()),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        buffer.staged_read(0, 0, &lanes, |_| ()),
        Err(MemoryError::ZeroLength { .. })
    ));
}

#[test]
fn marked_chunks_land_in_order_behind_earlier_work_and_wrong_marks_are_refused() {
    use cuweave_driver::memory::{MappedWords, StreamMarks};
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("test kernels");
    let (len, chunk) = (1 << 20, 65_536);
    let data = pattern(len, 3);
    let buffer = DeviceBuffer::<u32>::from_slice(context, &data).unwrap();
    // A 50 ms spin on the marks' stream before the chunks: no chunk may be reported landed
    // before the stream has passed it. (A pageable upload queued on another stream would not
    // do: the driver waits for that stream before it returns.)
    let lanes = streams(context, 2);
    kernels.spin_ns(&lanes[0], 50 * MS).unwrap();
    let words = Arc::new(MappedWords::new(context, 2).unwrap());
    let marks = StreamMarks::new(words.clone(), 0, &lanes[0], 0).unwrap();
    let wrong = StreamMarks::new(words, 1, &lanes[1], 0).unwrap();
    // Pinned host sides: a copy into pageable memory returns only once it has landed.
    let pool = cuweave_memory::PinnedPool::new(context);
    let back = buffer
        .staged_read(0, len, &lanes, |staged| {
            // Marks of lane 1 for a chunk on lane 0: refused before anything is queued.
            assert!(matches!(
                staged.copy_out_marked(0, 0, vec![0u32; chunk], &wrong),
                Err(MemoryError::InvalidStream { .. })
            ));
            assert!(matches!(
                staged.copy_out_marked(0, len - 10, vec![0u32; 20], &marks),
                Err(MemoryError::OutOfRange { .. })
            ));
            let copies: Vec<_> = (0..len)
                .step_by(chunk)
                .map(|start| {
                    let block = pool.get_typed::<u32>(chunk).unwrap();
                    staged.copy_out_marked(0, start, block, &marks).unwrap()
                })
                .collect();
            assert!(
                !copies[0].is_complete(),
                "a chunk landed before the spin ended"
            );
            // Waited for from the back: the last mark covers every chunk before it.
            let mut out: Vec<Vec<u32>> = Vec::new();
            for copy in copies.into_iter().rev() {
                out.push(copy.wait().unwrap().as_slice().to_vec());
            }
            out.into_iter().rev().flatten().collect::<Vec<u32>>()
        })
        .unwrap();
    assert_eq!(back, data);
}

#[test]
fn marked_uploads_of_blocks_filled_in_parts_by_threads_land_whole_and_in_order() {
    use cuweave_driver::memory::{MappedWords, StreamMarks};
    use cuweave_memory::parts::SharedParts;
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("test kernels");
    let (len, chunk, part) = (1 << 20, 1 << 18, 10_000);
    let data = pattern(len, 4);
    let mut buffer = DeviceBuffer::<u32>::zeroed(context, len).unwrap();
    let lanes = streams(context, 2);
    // A 50 ms spin on the marks' stream: no chunk is reported landed before it ends.
    kernels.spin_ns(&lanes[0], 50 * MS).unwrap();
    let words = Arc::new(MappedWords::new(context, 2).unwrap());
    let marks = StreamMarks::new(words.clone(), 0, &lanes[0], 0).unwrap();
    let wrong = StreamMarks::new(words, 1, &lanes[1], 0).unwrap();
    let pool = cuweave_memory::PinnedPool::new(context);
    buffer
        .staged_write(0, len, &lanes, |staged| {
            assert!(matches!(
                staged.copy_in_marked(0, 0, vec![0u32; 16], &wrong),
                Err(MemoryError::InvalidStream { .. })
            ));
            assert!(matches!(
                staged.copy_in_marked(0, len - 10, vec![0u32; 20], &marks),
                Err(MemoryError::OutOfRange { .. })
            ));
            let copies: Vec<_> = (0..len)
                .step_by(chunk)
                .map(|start| {
                    // Four threads fill one pinned block in parts, then it goes as one copy.
                    let parts = SharedParts::new(pool.get_typed::<u32>(chunk).unwrap(), part);
                    std::thread::scope(|scope| {
                        for t in 0..4 {
                            let (parts, data) = (&parts, &data);
                            scope.spawn(move || {
                                for i in (t..parts.count()).step_by(4) {
                                    let range = parts.range(i).unwrap();
                                    parts.take(i).unwrap().copy_from_slice(
                                        &data[start + range.start..start + range.end],
                                    );
                                }
                            });
                        }
                    });
                    staged
                        .copy_in_marked(0, start, parts.into_inner(), &marks)
                        .unwrap()
                })
                .collect();
            assert!(
                !copies[0].is_complete(),
                "a chunk landed before the spin ended"
            );
            for copy in copies.into_iter().rev() {
                drop(copy.wait().unwrap());
            }
        })
        .unwrap();
    // Recorded on the lanes: a blocking read sees every chunk.
    assert_eq!(buffer.to_vec().unwrap(), data);
}
