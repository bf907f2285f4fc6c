//! Peak and live bytes of a device, and the split of a step's peak into pools.

use burn::prelude::*;
use serde::{Deserialize, Serialize};

use super::CountingAllocator;
use crate::host::same_memory;

/// Reads live and peak bytes of one device.
///
/// On Flex the numbers are heap bytes of the whole process (tensors dominate them during
/// training); they need [`CountingAllocator`] installed. On Cube devices they are bytes reserved
/// by the device's memory pools, which release free pages only at a cleanup (CubeCL's own, now
/// and then, or [`BlockCoordinate`](crate::optim::BlockCoordinate)'s at each switch): the peak
/// is the sum of each pool's own peak, what the pools held at once when none released pages in
/// between, and more than that when one did.
#[derive(Clone, Debug)]
pub struct MemoryMeter {
    device: Device,
}

impl MemoryMeter {
    /// A meter of `device`'s memory (the counting allocator on Flex, the pools on Cube).
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
        }
    }

    /// Whether this device can be measured in this process.
    pub fn is_available(&self) -> bool {
        self.device.memory_pool_usage().is_some() || CountingAllocator::is_installed()
    }

    /// Whether `tensor` is in the memory this meter reads: on its device, not waiting in host
    /// memory for it.
    pub fn holds<const D: usize>(&self, tensor: &Tensor<D>) -> bool {
        same_memory(&tensor.device(), &self.device)
    }

    /// What the readings count, for reports.
    pub fn source(&self) -> &'static str {
        if self.device.memory_pool_usage().is_some() {
            "device memory pools, reserved"
        } else {
            "process heap"
        }
    }

    /// Starts a new peak window (Flex). Pool peaks on Cube devices cannot be reset: measure one
    /// configuration per process there.
    pub fn reset_peak(&self) {
        self.sync();
        CountingAllocator::reset_peak();
    }

    /// Flex's matmul (gemm) keeps a scratch slab per thread, the size of the CPU's L2 cache,
    /// allocated at the thread's first product and kept for the thread's life. A thread-pool
    /// worker that has run no product yet would allocate it inside a measured window (2 MiB on
    /// the CI machines), so this runs one small product on every worker. Nothing to do on Cube
    /// devices, whose pools hold no such scratch.
    pub fn warm_matmul_threads(&self) {
        if self.device.memory_pool_usage().is_some() {
            return;
        }
        let device = self.device.clone();
        rayon::broadcast(|_| {
            let square = Tensor::<2>::ones([64, 64], &device);
            square.clone().matmul(square).into_data();
        });
    }

    /// Bytes held now.
    pub fn live_bytes(&self) -> u64 {
        self.sync();
        match self.device.memory_pool_usage() {
            Some(usage) => usage.bytes_in_use,
            None => CountingAllocator::live_bytes() as u64,
        }
    }

    /// Most bytes held since the last [`reset_peak`](Self::reset_peak) (Flex) or since the
    /// device started (Cube).
    pub fn peak_bytes(&self) -> u64 {
        self.sync();
        match (
            self.device.memory_pool_usage(),
            self.device.memory_pool_report(),
        ) {
            (Some(usage), Some(pools)) => {
                let paged_peak: u64 = pools.iter().map(|p| p.pages_peak * p.page_size).sum();
                usage.bytes_reserved.max(paged_peak)
            }
            _ => CountingAllocator::peak_bytes() as u64,
        }
    }

    fn sync(&self) {
        // A failed sync leaves the last completed reading, which is still a valid lower bound.
        let _ = self.device.sync();
    }
}

/// The peak of a training step split into the pools burn-memwall removes one by one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolBreakdown {
    /// Highest bytes held during the step.
    pub peak: u64,
    /// Model parameters.
    pub parameters: u64,
    /// Optimizer state (moments, …) kept between steps.
    pub optimizer_state: u64,
    /// Parameter gradients alive at once before the optimizer step.
    pub gradients: u64,
    /// Everything else at the peak: activations saved for backward and transient workspace.
    pub activations_and_workspace: u64,
}

impl PoolBreakdown {
    /// Splits `peak`; the last pool is what the named ones do not explain.
    pub fn new(peak: u64, parameters: u64, optimizer_state: u64, gradients: u64) -> Self {
        let explained = parameters + optimizer_state + gradients;
        Self {
            peak,
            parameters,
            optimizer_state,
            gradients,
            activations_and_workspace: peak.saturating_sub(explained),
        }
    }

    /// Bytes kept between steps.
    pub fn persistent(&self) -> u64 {
        self.parameters + self.optimizer_state
    }
}

/// `1536` → `"1.50 KiB"`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// A size [`parse_bytes`] could not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a size: expected a number and a unit, such as 6GiB, 512 MiB, 8GB or 1.5TiB \
     (KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB of 1024)"
)]
pub struct ParseBytesError(String);

/// `"6GiB"` → `6 · 2³⁰`, `"8 GB"` → `8 · 10⁹`: a memory size as people write it. The unit is
/// required (B, KB, MB, GB, TB, or KiB, MiB, GiB, TiB, in any case).
pub fn parse_bytes(text: &str) -> Result<u64, ParseBytesError> {
    let error = || ParseBytesError(text.to_owned());
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(error)?;
    let (number, unit) = trimmed.split_at(split);
    let number: f64 = number.parse().map_err(|_| error())?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(error()),
    };
    let bytes = number * scale;
    match bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64 {
        true => Ok(bytes.round() as u64),
        false => Err(error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_read_as_people_write_them() {
        assert_eq!(parse_bytes("6GiB"), Ok(6 << 30));
        assert_eq!(parse_bytes(" 8 GB "), Ok(8_000_000_000));
        assert_eq!(parse_bytes("1.5tib"), Ok(3 << 39));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("100 b"), Ok(100));
        for bad in ["6XB", "6", "GiB", "", "-1GiB", "1.2.3GB", "0GB"] {
            assert_eq!(
                parse_bytes(bad),
                Err(ParseBytesError(bad.to_owned())),
                "{bad}"
            );
        }
    }

    #[test]
    fn human_bytes_reads_back() {
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(parse_bytes(&human_bytes(3 << 30)), Ok(3 << 30));
    }
}
