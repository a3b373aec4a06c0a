//! Adversarial multi-threaded probes of the transfer manager: one manager used by eight threads
//! at once for uploads and downloads of odd sizes (4 KiB .. 64 MiB) to and from buffers of their
//! own, uploads and downloads of one device running together, and async borrowed and owned
//! transfers polled from eight threads. Every byte is checked.

mod common;
use common::block_on;

use std::sync::{Arc, Barrier};

use cuweave_memory::DeviceBuffer;
use cuweave_test_support::{require_gpu, serial};
use cuweave_transfer::TransferManager;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const THREADS: usize = 8;

/// A 64-bit LCG: the same "random" program on every run.
fn next(state: &mut u64) -> usize {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (*state >> 33) as usize
}

/// A byte count between 4 KiB and 64 MiB, mostly small, never a multiple of 4.
fn odd_size(state: &mut u64) -> usize {
    let bytes = match next(state) % 8 {
        0 => 16 * MIB + next(state) % (48 * MIB),
        1 | 2 => MIB + next(state) % (15 * MIB),
        _ => 4 * KIB + next(state) % MIB,
    };
    bytes | 1
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(0x9E37_79B9) ^ seed).rotate_left(7) as u8)
        .collect()
}

/// Eight threads share one manager: each uploads a pageable vector of an odd size into a device
/// buffer of its own, downloads it again, and compares every byte; half the threads also upload
/// a second buffer while downloading the first, so both directions of one device run at once.
#[test]
fn eight_threads_share_one_manager_for_odd_sized_round_trips() {
    const ITERATIONS: usize = 6;
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = Arc::new(TransferManager::new().expect("manager"));
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (manager, start, context) = (manager.clone(), start.clone(), gpu.context.clone());
            std::thread::spawn(move || {
                let mut rng = 0xF00D + thread as u64 * 104_729;
                start.wait();
                for iteration in 0..ITERATIONS {
                    let bytes = odd_size(&mut rng);
                    let data = pattern((thread * 1000 + iteration) as u32, bytes);
                    let mut device = DeviceBuffer::<u8>::new(&context, bytes).expect("device");
                    manager
                        .transfer(data.as_slice(), &mut device)
                        .expect("upload");
                    let mut back = vec![0u8; bytes];
                    if thread % 2 == 0 {
                        // Upload something else to a second buffer while downloading the first.
                        let other = pattern(!(thread as u32), bytes);
                        let mut second = DeviceBuffer::<u8>::new(&context, bytes).expect("second");
                        std::thread::scope(|scope| {
                            let (manager, other) = (&manager, &other);
                            let up = scope.spawn(move || {
                                manager
                                    .transfer(other.as_slice(), &mut second)
                                    .map(|_| second)
                            });
                            manager
                                .transfer(&device, back.as_mut_slice())
                                .expect("download");
                            let second = up.join().expect("upload thread").expect("upload");
                            let mut again = vec![0u8; bytes];
                            manager
                                .transfer(&second, again.as_mut_slice())
                                .expect("download second");
                            assert!(again == *other, "thread {thread}: second buffer wrong");
                        });
                    } else {
                        manager
                            .transfer(&device, back.as_mut_slice())
                            .expect("download");
                    }
                    let bad = data.iter().zip(&back).filter(|(a, b)| a != b).count();
                    assert_eq!(
                        bad, 0,
                        "thread {thread} iteration {iteration}: {bad} of {bytes} bytes wrong"
                    );
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("thread");
    }
    let transfers: u64 = manager
        .stats()
        .snapshot()
        .iter()
        .map(|(_, _, stats)| stats.count)
        .sum();
    let failures: u64 = manager
        .stats()
        .snapshot()
        .iter()
        .map(|(_, _, stats)| stats.failures)
        .sum();
    assert_eq!(failures, 0);
    let expected = (THREADS * ITERATIONS * 2 + THREADS / 2 * ITERATIONS * 2) as u64;
    assert_eq!(transfers, expected, "every transfer counted once");
}

/// Eight threads poll async transfers of one manager at once: borrowed uploads and downloads at
/// an offset, and owned ones whose buffers come back; every byte is checked.
#[test]
fn async_borrowed_and_owned_transfers_from_eight_threads_round_trip() {
    const ITERATIONS: usize = 5;
    let gpu = require_gpu!();
    let _serial = serial();
    let manager = Arc::new(TransferManager::new().expect("manager"));
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (manager, start, context) = (manager.clone(), start.clone(), gpu.context.clone());
            std::thread::spawn(move || {
                let mut rng = 0xCAFE + thread as u64 * 7_919;
                start.wait();
                for iteration in 0..ITERATIONS {
                    let bytes = odd_size(&mut rng).min(24 * MIB) | 1;
                    let offset = 1 + thread;
                    let data = pattern((thread * 7 + iteration) as u32, bytes);
                    if (thread + iteration) % 2 == 0 {
                        let mut device =
                            DeviceBuffer::<u8>::new(&context, bytes + offset).expect("device");
                        block_on(
                            manager
                                .upload_async(&data, &mut device, offset)
                                .expect("upload_async"),
                        )
                        .expect("uploaded");
                        let mut back = vec![0u8; bytes];
                        block_on(
                            manager
                                .download_async(&device, offset, &mut back)
                                .expect("download_async"),
                        )
                        .expect("downloaded");
                        assert!(
                            back == data,
                            "thread {thread} iteration {iteration}: borrowed"
                        );
                    } else {
                        let device = DeviceBuffer::<u8>::new(&context, bytes).expect("device");
                        let owned = block_on(manager.upload_owned(data.clone(), device, 0));
                        owned.result.expect("owned upload");
                        assert!(owned.host == data, "the owned upload hands its host back");
                        let owned =
                            block_on(manager.download_owned(owned.device, 0, vec![0u8; bytes]));
                        owned.result.expect("owned download");
                        assert!(
                            owned.host == data,
                            "thread {thread} iteration {iteration}: owned"
                        );
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("thread");
    }
}
