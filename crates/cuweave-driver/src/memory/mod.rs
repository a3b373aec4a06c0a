//! Raw device, host and managed memory.
