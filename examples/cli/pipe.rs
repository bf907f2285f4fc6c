//! A reader that leaves early (`budget ... | head`) ends the process quietly, as it ends other
//! command-line tools, instead of Rust's panic at the next print to the closed pipe.

/// Restores the default action of `SIGPIPE` (end the process), which Rust's runtime sets to
/// "ignore" so that a write to a closed pipe fails, and `println!` panics on the failure.
pub fn end_quietly_when_the_reader_leaves() {
    // SAFETY: `signal` with `SIG_DFL` installs no handler, so nothing of ours runs in signal
    // context; it is called first in `main`, before any thread starts.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
