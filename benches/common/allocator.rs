//! The allocator of every benchmark binary (and of the workload and fairness examples):
//! mimalloc, told to keep the memory it frees for reuse instead of giving it back to
//! the system a second later (its `purge_delay`, -1: never). With thousands of trees in
//! flight the engine frees and allocates the same amounts over and over; given back,
//! each page is faulted in and cleared again (at 20 000 roots in flight that was some
//! 7 % of the time). A service that embeds proctor picks its own allocator; the same
//! setting is `MIMALLOC_PURGE_DELAY=-1` in the environment.
//!
//! Included by path (`#[path = ...] mod allocator;`), once per binary.

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc v3's `mi_option_purge_delay`, by its place in `mi_option_e` (the Rust
/// bindings name only the options of earlier versions).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc's default purge delay, in milliseconds: reading it back checks that
/// `PURGE_DELAY` names that option in the version linked.
const PURGE_DELAY_DEFAULT: std::os::raw::c_long = 1_000;

/// Keeps freed memory in the process, unless `MIMALLOC_PURGE_DELAY` says otherwise.
/// Returns whether it set the option.
pub fn keep_freed_memory() -> bool {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return false;
    }
    // SAFETY: mimalloc's options may be read and set at any time, from any thread.
    unsafe {
        if libmimalloc_sys::mi_option_get(PURGE_DELAY) != PURGE_DELAY_DEFAULT {
            return false;
        }
        libmimalloc_sys::mi_option_set(PURGE_DELAY, -1);
    }
    true
}
