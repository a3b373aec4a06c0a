//! [`WeakStream`]: a handle on a stream that does not keep it, for a layer that must reach the
//! stream something was made for (to free memory there, or to order another stream after it)
//! while that stream's handle lives, and wait for the handle's end once it is gone.
//!
//! The weak handle and the [`Stream`] share one small state: a flag under a read-write lock, a
//! non-owning twin of the handle (same context, raw `CUstream` and [`Stream::id`]) and the
//! handle's [`StreamEnd`]. [`WeakStream::with`] runs a closure on the twin under the read lock
//! while the flag says the handle lives; the handle's drop takes the lock for writing (so it
//! waits for the closures running), records its end, clears the flag and only then destroys the
//! stream. A closure therefore never sees a destroyed stream, and whoever finds the handle gone
//! finds its end recorded: every piece of work queued through the handle (and through every
//! closure) is before that end.
//!
//! A handle nobody downgraded pays nothing: the state is made by the first
//! [`Stream::downgrade`], and the drop of a handle without it checks one `OnceLock`.

use std::sync::{Arc, OnceLock, Weak};

use parking_lot::{RwLock, RwLockWriteGuard};

use super::{Stream, StreamEnd};

/// What a [`Stream`] holds of its weak handles: the state they share, or, for the twin those
/// handles lend out, a link back to it.
#[derive(Debug)]
pub(super) enum Slot {
    /// The handle's own state, made by its first [`Stream::downgrade`].
    Own(Arc<Shared>),
    /// This handle is the twin of `of`'s handle: it lends the state out again (a downgrade of
    /// the twin is a downgrade of the handle) and keys caches as that handle does.
    Twin {
        of: Weak<Shared>,
        /// Whether the handle is borrowed ([`Stream::is_borrowed`]).
        borrowed: bool,
    },
}

/// The state a handle shares with its weak handles.
#[derive(Debug)]
pub(super) struct Shared {
    /// `true` while the handle lives. Read-locked by [`WeakStream::with`] for the duration of its
    /// closure; the handle's drop takes it for writing.
    alive: RwLock<bool>,
    /// A handle of the same stream that owns nothing (its drop does nothing), with the handle's
    /// id: what the closures see.
    twin: Stream,
    /// The handle's end.
    end: Arc<StreamEnd>,
}

/// A handle on a [`Stream`] that does not keep it: usable ([`with`](Self::with)) only while the
/// handle it came from ([`Stream::downgrade`]) lives, and holding that handle's destruction off
/// while in use. Once the handle is gone, [`end`](Self::end) says when the work queued through
/// it has finished, and lets another stream wait for that.
///
/// For a layer that keeps something made for a stream without owning the stream: a buffer
/// frees its memory on the stream it was allocated for, or orders another stream after it,
/// while that stream lives, and orders the free after the stream's end once it is gone.
///
/// Cheap to clone (an `Arc`); `Send + Sync`.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
///
/// # fn main() -> cuweave_driver::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let other = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let weak = stream.downgrade().expect("a created stream");
/// assert_eq!(weak.with(|s| other.wait_stream(s)).transpose()?, Some(()));
/// drop(stream);
/// assert!(weak.with(|_| ()).is_none());
/// assert!(weak.end().wait_on(&other)?, "other waits for the dropped stream's last work");
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct WeakStream {
    shared: Arc<Shared>,
}

impl WeakStream {
    /// The [`Stream::id`] of the handle it came from.
    #[inline]
    pub fn id(&self) -> u64 {
        self.shared.twin.id()
    }

    /// The context of the stream.
    pub fn context(&self) -> &Arc<crate::Context> {
        self.shared.twin.context()
    }

    /// Whether the handle it came from is still alive (it may be dropped right after).
    pub fn is_alive(&self) -> bool {
        *self.shared.alive.read_recursive()
    }

    /// Runs `f` on the stream while the handle it came from lives (`None` once that handle has
    /// been dropped, or while it is being dropped: `f` does not run). The handle's drop waits
    /// for `f` to return, so the stream is not destroyed under it, and the handle's end
    /// ([`end`](Self::end)) is recorded after every piece of work `f` queued.
    ///
    /// The `&Stream` that `f` gets owns nothing: it has the handle's context, raw `CUstream`
    /// and [`id`](Stream::id), and [`owns_its_stream`](Stream::owns_its_stream) is `false`.
    ///
    /// `f` must not drop the handle it came from (its drop would wait for `f` for ever), and
    /// should not block: the handle's drop waits for it.
    pub fn with<R>(&self, f: impl FnOnce(&Stream) -> R) -> Option<R> {
        // Recursive: a closure that reaches another weak handle of the same stream must not
        // queue behind a drop that waits for the closure.
        let alive = self.shared.alive.read_recursive();
        if !*alive {
            return None;
        }
        Some(f(&self.shared.twin))
    }

    /// As [`with`](Self::with), and no capture begins through cuweave while `f` runs: a check
    /// of [`active_captures`](crate::graph::active_captures) that `f` makes first stays true
    /// until it returns (a capture about to begin waits for `f`), so `f` can queue work that a
    /// capture must not see (a stream-ordered free that would become a graph node).
    ///
    /// `f` must not begin a capture (it would wait for `f` for ever: such a begin is refused
    /// with `GraphError::Capturing`), besides what [`with`](Self::with) asks.
    pub fn with_no_capture_beginning<R>(&self, f: impl FnOnce(&Stream) -> R) -> Option<R> {
        crate::graph::while_no_capture_begins(|| self.with(f))
    }

    /// The end of the handle it came from: whether it has been dropped, whether the work queued
    /// through it before has finished, and a wait for that ([`StreamEnd::wait_on`]).
    pub fn end(&self) -> &Arc<StreamEnd> {
        &self.shared.end
    }
}

impl Stream {
    /// A [`WeakStream`] of this handle: reaches the stream only while this handle lives (and
    /// holds its drop off while in use), then tells when the work queued through it has
    /// finished.
    ///
    /// `None` for a context-relative handle ([`is_special_handle`](Self::is_special_handle):
    /// the legacy and per-thread default streams, which live as long as their context and need
    /// none). A handle that owns its stream shares its [`StreamEnd`] with
    /// [`end_watch`](Self::end_watch); a borrowed handle ([`from_raw`](Self::from_raw) without
    /// `owned`) records one of its own at its drop, behind the work queued on its stream until
    /// then (the stream must still live then, as `from_raw` requires), which does not count in
    /// [`ended_watched_streams`](super::ended_watched_streams). Downgrading the
    /// [`with`](WeakStream::with) twin gives the handle's own weak handle.
    ///
    /// The first call makes the shared state (and, for a borrowed handle, means its drop
    /// records an event); later ones are one `Arc` clone.
    #[inline]
    pub fn downgrade(&self) -> Option<WeakStream> {
        match self.weak.get() {
            Some(Slot::Own(shared)) => Some(WeakStream {
                shared: Arc::clone(shared),
            }),
            Some(Slot::Twin { of, .. }) => of.upgrade().map(|shared| WeakStream { shared }),
            None if self.is_special_handle() => None,
            None => self.first_downgrade(),
        }
    }

    #[cold]
    fn first_downgrade(&self) -> Option<WeakStream> {
        let end = self
            .end_watch()
            .unwrap_or_else(|| Arc::new(StreamEnd::uncounted()));
        let slot = self.weak.get_or_init(|| {
            Slot::Own(Arc::new_cyclic(|of| Shared {
                alive: RwLock::new(true),
                twin: self.twin(of.clone()),
                end,
            }))
        });
        match slot {
            Slot::Own(shared) => Some(WeakStream {
                shared: Arc::clone(shared),
            }),
            Slot::Twin { .. } => None,
        }
    }

    /// The handle [`WeakStream::with`] lends out: this handle's stream and id, owning nothing.
    fn twin(&self, of: Weak<Shared>) -> Stream {
        let twin = Stream {
            context: Arc::clone(&self.context),
            raw: self.raw,
            owned: false,
            id: self.id,
            join_events: OnceLock::new(),
            end: OnceLock::new(),
            weak: OnceLock::new(),
        };
        let slot = Slot::Twin {
            of,
            borrowed: self.is_borrowed(),
        };
        if twin.weak.set(slot).is_err() {
            unreachable!("a new handle's slot is empty");
        }
        twin
    }

    /// Whether this handle wraps a stream it does not own ([`from_raw`](Self::from_raw) without
    /// `owned`) and is not a context-relative name: the stream lives on after the handle and
    /// other handles of it may queue work. The [`WeakStream::with`] twin of a handle answers as
    /// that handle does.
    #[inline]
    pub fn is_borrowed(&self) -> bool {
        if self.owned || self.is_special_handle() {
            return false;
        }
        match self.weak.get() {
            Some(Slot::Twin { borrowed, .. }) => *borrowed,
            _ => true,
        }
    }

    /// The first step of dropping a handle that was downgraded: waits for the weak handles'
    /// closures running and holds new ones off until the returned guard drops, which marks the
    /// handle gone. `None` for a handle never downgraded (and for a twin).
    pub(super) fn retire_weak(&self) -> Option<Retiring<'_>> {
        match self.weak.get() {
            Some(Slot::Own(shared)) => Some(Retiring {
                alive: shared.alive.write(),
                end: &shared.end,
            }),
            _ => None,
        }
    }
}

/// A downgraded handle being dropped: no weak handle's closure runs while it is held, and its
/// drop marks the handle gone for them.
pub(super) struct Retiring<'a> {
    alive: RwLockWriteGuard<'a, bool>,
    end: &'a StreamEnd,
}

impl Retiring<'_> {
    /// The handle's end, to record before the guard drops (a borrowed handle's is recorded
    /// here; an owning handle's is its [`Stream::end_watch`] one, recorded by the drop).
    pub(super) fn end(&self) -> &StreamEnd {
        self.end
    }
}

impl Drop for Retiring<'_> {
    fn drop(&mut self) {
        // Whoever finds the handle gone finds its end set: a drop that could not record one
        // (the driver failed) says so, rather than leaving the end unknown for ever.
        if !self.end.is_dropped() {
            self.end.set(None);
        }
        *self.alive = false;
    }
}

#[cfg(test)]
#[path = "weak_tests.rs"]
mod tests;
