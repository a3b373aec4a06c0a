//! Times every poll of borrowed 1 GiB async transfers ([`TransferManager::upload_async`] /
//! [`TransferManager::download_async`]) on device 0, beside the host's own jitter: the same
//! number of copies of one poll's bytes ([`POLL_BYTES`](cuweave_transfer::POLL_BYTES)) with no
//! GPU work, each timed alike. Prints, per direction and round, the longest poll, the 99.9th
//! percentile and how many polls took over 50 µs.
//!
//! `cargo run --release -p cuweave-transfer --example async_polls [ROUNDS]` (default 3).
//! `ASYNC_PARTS=1` then times, alone, each step a poll of an upload is made of (a `POLL_BYTES`
//! streaming copy into a pinned block, queueing the chunk's copy, queueing its completion word,
//! polling the word, taking the landed block back), over as many 1 MiB chunks: the longest of
//! each and how many took over 50 µs, to tell which step a slow poll spent its time in.

use std::sync::Arc;
use std::task::{Context as TaskContext, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use cuweave_driver::{Context, Device, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, PinnedPool, copy_streaming};
use cuweave_transfer::TransferManager;

const GIB: usize = 1 << 30;
const SLOW: Duration = Duration::from_micros(50);

struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `future` to completion on this thread, parking until woken; every poll's duration.
fn timed_block_on<F: Future + Unpin>(mut future: F) -> (F::Output, Vec<Duration>) {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = TaskContext::from_waker(&waker);
    let mut polls = Vec::with_capacity(1 << 15);
    loop {
        let start = Instant::now();
        let outcome = std::pin::Pin::new(&mut future).poll(&mut cx);
        polls.push(start.elapsed());
        if let Poll::Ready(output) = outcome {
            return (output, polls);
        }
        std::thread::park();
    }
}

fn summary(what: &str, mut times: Vec<Duration>, elapsed: Option<Duration>) {
    times.sort_unstable();
    let n = times.len();
    let at = |q: f64| times[((n as f64 * q) as usize).min(n - 1)];
    let slow = times.iter().filter(|t| **t > SLOW).count();
    let top: Vec<String> = times
        .iter()
        .rev()
        .take(5)
        .map(|t| format!("{:.0}", t.as_secs_f64() * 1e6))
        .collect();
    let rate = elapsed.map_or(String::new(), |e| {
        format!(", {:.2} GB/s", GIB as f64 / e.as_secs_f64() / 1e9)
    });
    println!(
        "  {what:<22} {n:>6} polls: longest {:>7.1} us, p99.9 {:>6.1}, p99 {:>6.1}, median {:>5.1}, over 50 us: {slow:>3} (top {}){rate}",
        times[n - 1].as_secs_f64() * 1e6,
        at(0.999).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        at(0.5).as_secs_f64() * 1e6,
        top.join(" "),
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !cuweave_driver::is_available() {
        println!("no CUDA driver: nothing to measure");
        return Ok(());
    }
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let context = Context::primary(Device::get(0)?)?;
    let manager = TransferManager::new()?;
    let mut host: Vec<u8> = (0..GIB).map(|i| (i % 251) as u8).collect();
    let mut device = DeviceBuffer::<u8>::zeroed(&context, GIB)?;

    // The host's jitter: copies of what a poll copies at most, no GPU work.
    let poll_bytes = cuweave_transfer::POLL_BYTES;
    let mut from = vec![1u8; poll_bytes];
    let mut to = vec![0u8; poll_bytes];
    let mut times = Vec::with_capacity(40_000);
    for i in 0..40_000 {
        from[i % poll_bytes] = i as u8;
        let start = Instant::now();
        copy_streaming(&mut to, &from)?;
        times.push(start.elapsed());
    }
    summary(
        &format!("host {} KiB copies", poll_bytes >> 10),
        times,
        None,
    );

    // Warm the lane, the pinned pool and the waiter.
    let (warm, _) = timed_block_on(manager.upload_async(&host, &mut device, 0)?);
    warm?;
    for round in 0..rounds {
        let start = Instant::now();
        let (report, polls) = timed_block_on(manager.upload_async(&host, &mut device, 0)?);
        report?;
        summary(
            &format!("round {round} upload"),
            polls,
            Some(start.elapsed()),
        );
        let start = Instant::now();
        let (report, polls) = timed_block_on(manager.download_async(&device, 0, &mut host)?);
        report?;
        summary(
            &format!("round {round} download"),
            polls,
            Some(start.elapsed()),
        );
    }
    assert!(host.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    if std::env::var_os("ASYNC_PARTS").is_some() {
        for round in 0..rounds {
            parts(round, &context, &host, &mut device)?;
        }
    }
    Ok(())
}

/// The longest time each step of a borrowed upload's polls takes, timed one by one: `depth`
/// 1 MiB blocks in flight on one stream, as [`TransferManager::upload_async`] runs them.
fn parts(
    round: usize,
    context: &Arc<Context>,
    host: &[u8],
    device: &mut DeviceBuffer<u8>,
) -> Result<(), Box<dyn std::error::Error>> {
    const CHUNK: usize = 1 << 20;
    const PIECE: usize = cuweave_transfer::POLL_BYTES;
    const DEPTH: usize = 4;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING)?;
    let pool = PinnedPool::new(context);
    let mut free: Vec<_> = (0..DEPTH)
        .map(|_| pool.get_typed::<u8>(CHUNK))
        .collect::<Result<_, _>>()?;
    let names = [
        "fill a poll's bytes",
        "queue copy",
        "queue word",
        "poll word",
        "take block",
    ];
    let mut times: Vec<Vec<Duration>> = names.iter().map(|_| Vec::new()).collect();
    let waker = Waker::noop();
    let mut cx = TaskContext::from_waker(waker);
    let mut in_flight = std::collections::VecDeque::new();
    let timed = |times: &mut Vec<Duration>, start: Instant| times.push(start.elapsed());
    for (index, chunk) in host.chunks(CHUNK).enumerate() {
        let mut block = loop {
            if let Some(block) = free.pop() {
                break block;
            }
            let (copy, mut word): (_, cuweave_event::WaitFuture) =
                in_flight.pop_front().expect("a block is out");
            loop {
                let start = Instant::now();
                let polled = std::pin::Pin::new(&mut word).poll(&mut cx);
                timed(&mut times[3], start);
                if let Poll::Ready(done) = polled {
                    done?;
                    break;
                }
                std::thread::yield_now();
            }
            let start = Instant::now();
            let block = cuweave_memory::buffer::PendingCopy::wait(copy)?;
            timed(&mut times[4], start);
            free.push(block);
        };
        for (to, from) in block
            .as_mut_slice()
            .chunks_mut(PIECE)
            .zip(chunk.chunks(PIECE))
        {
            let start = Instant::now();
            copy_streaming(to, from)?;
            timed(&mut times[0], start);
        }
        let start = Instant::now();
        let copy = device.copy_range_from_host_async(index * CHUNK, block, &stream)?;
        timed(&mut times[1], start);
        let start = Instant::now();
        let word = cuweave_event::stream_idle(&stream)?;
        timed(&mut times[2], start);
        in_flight.push_back((copy, word));
    }
    for (copy, word) in in_flight {
        timed_block_on(word).0?;
        drop(cuweave_memory::buffer::PendingCopy::wait(copy)?);
    }
    for (name, times) in names.iter().zip(times) {
        if !times.is_empty() {
            summary(&format!("parts {round}: {name}"), times, None);
        }
    }
    Ok(())
}
