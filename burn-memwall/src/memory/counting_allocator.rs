//! A global allocator that counts live heap bytes and their peak.
//!
//! Flex (Burn's pure-Rust CPU backend) keeps every tensor in heap memory and reports no memory
//! pool, so the only honest way to measure its peak is to count allocations. Install it in the
//! measuring binary (a library cannot choose the global allocator):
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: burn_memwall::memory::CountingAllocator = burn_memwall::memory::CountingAllocator;
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Wraps the system allocator and keeps the number of live bytes and their peak.
pub struct CountingAllocator;

impl CountingAllocator {
    /// Whether this allocator is the process's global allocator (it has seen an allocation).
    pub fn is_installed() -> bool {
        INSTALLED.load(Ordering::Relaxed)
    }

    /// Heap bytes currently allocated.
    pub fn live_bytes() -> usize {
        LIVE.load(Ordering::Relaxed)
    }

    /// Highest value of [`live_bytes`](Self::live_bytes) since the last [`reset_peak`](Self::reset_peak).
    pub fn peak_bytes() -> usize {
        PEAK.load(Ordering::Relaxed)
    }

    /// Starts a new peak window at the current live size.
    pub fn reset_peak() {
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn grow(bytes: usize) {
        let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK.fetch_max(live, Ordering::Relaxed);
    }

    /// Counts a fresh allocation of `bytes` at `ptr` (null: it failed, nothing to count).
    fn counted(ptr: *mut u8, bytes: usize) -> *mut u8 {
        if !ptr.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            Self::grow(bytes);
        }
        ptr
    }

    fn shrink(bytes: usize) {
        LIVE.fetch_sub(bytes, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to `System`; the counters never affect the memory
// handed out.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::counted(unsafe { System.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::counted(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        Self::shrink(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            Self::shrink(layout.size());
            Self::grow(new_size);
        }
        new
    }
}
