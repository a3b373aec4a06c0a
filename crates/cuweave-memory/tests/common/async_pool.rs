//! The device's stream-ordered pool as a resource, or a skip with the reason when the device
//! has none. Included by the test binaries that use it
//! (`#[path = "common/async_pool.rs"] mod async_pool;`).

use std::sync::Arc;

use cuweave_driver::Context;
use cuweave_memory::AsyncPoolResource;

/// An `AsyncPoolResource` of `context`'s device, or `None` after reporting `test` skipped (a
/// device without memory pools).
pub fn async_pool_or_skip(test: &str, context: &Arc<Context>) -> Option<Arc<AsyncPoolResource>> {
    match AsyncPoolResource::new(context) {
        Ok(pool) => Some(Arc::new(pool)),
        Err(error) => {
            cuweave_test_support::skip(test, &format!("no stream-ordered pool: {error}"));
            None
        }
    }
}
