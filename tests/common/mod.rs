//! What every integration test needs: the devices to run on and the shared test data.
#![allow(dead_code)] // each test binary uses a different part of this module

pub mod packed_weight;

use burn::prelude::*;
use burn_memwall::DeviceChoice;

/// Flex always; wgpu too when compiled in. A compiled-in wgpu without an adapter fails the
/// test in CI (`CI=true`) and is skipped with a printed reason elsewhere.
pub fn devices() -> Vec<Device> {
    let mut devices = vec![Device::flex()];
    if cfg!(feature = "wgpu") {
        match DeviceChoice::Wgpu.device() {
            Ok(device) => devices.push(device),
            Err(error) if std::env::var("CI").is_ok_and(|v| v == "true") => {
                panic!("CI must run the wgpu tests, but: {error}")
            }
            Err(error) => eprintln!("skipping wgpu: {error}"),
        }
    }
    devices
}

/// `../shared/data/tinyshakespeare.txt` when this checkout sits beside the shared folder.
pub fn tinyshakespeare() -> Option<String> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/tinyshakespeare.txt");
    std::fs::read_to_string(path).ok()
}

/// Serialises the tests of one binary that must not overlap: those reading process-wide peaks,
/// and those drawing weights from a backend's global RNG. A panicking holder does not block the
/// rest.
pub fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs this binary's ignored test `name` in a child process of its own and fails with its
/// output if it fails. For heap readings on Flex in a binary whose other tests run on wgpu:
/// the wgpu runtime's threads allocate and free on their own schedule, which moves the
/// process-wide counts inside a measured window (CI read a 2 MiB state 2 MiB short).
pub fn run_alone(name: &str) {
    let output = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("the test binary runs again");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    assert!(
        output.status.success() && text(&output.stdout).contains("test result: ok. 1 passed"),
        "`{name}` alone:\n{}\n{}",
        text(&output.stdout),
        text(&output.stderr)
    );
}

/// Runs the `#[ignore]`d test `name` of this binary in a child process with `variable` set to
/// `value`, and returns what follows `prefix` on the line it printed its report on; fails with
/// the child's output when it failed or printed none. For measurements that need a process of
/// their own (a Cube pool's peak cannot be reset).
pub fn child_report(name: &str, (variable, value): (&str, &str), prefix: &str) -> String {
    let output = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--ignored", "--nocapture"])
        .env(variable, value)
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report = stdout.lines().find_map(|line| line.strip_prefix(prefix));
    match report.filter(|_| output.status.success()) {
        Some(report) => report.to_owned(),
        None => panic!(
            "`{name}` with {variable}={value} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// A folder that is removed when dropped.
pub fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary folder")
}

/// `|got − want| ≤ tol · |want| + tol / 10 · max(max |want|, 1)` elementwise: relative, with an
/// absolute floor for entries that are near zero only through cancellation (test inputs have
/// scale 1). `context` names the case in the failure message.
pub fn assert_close(
    what: &str,
    context: &dyn std::fmt::Debug,
    tol: f64,
    got: TensorData,
    want: TensorData,
) {
    let got = got.try_into_vec_as::<f64>().unwrap();
    let want = want.try_into_vec_as::<f64>().unwrap();
    assert_eq!(got.len(), want.len(), "{what} for {context:?}");
    let largest = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    for (index, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g.is_finite(), "{what}[{index}] = {g} for {context:?}");
        let bound = tol * w.abs() + tol / 10.0 * largest.max(1.0);
        assert!(
            (g - w).abs() <= bound,
            "{what}[{index}]: {g} vs reference {w} (bound {bound:e}) for {context:?}"
        );
    }
}

/// Seeds `device` from the clock and prints the seed, so that a failure can be replayed.
pub fn seed_from_clock(device: &Device) {
    let seed = std::env::var("TEST_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("seed {seed} (replay with TEST_SEED={seed})");
    device.seed(seed);
}

/// Bytes held at the peak of `work` on `device`, above what was live before it (so tensors
/// made before `work` count in neither).
pub fn peak_of(device: &Device, work: impl FnOnce()) -> u64 {
    let meter = burn_memwall::memory::MemoryMeter::new(device);
    let before = meter.live_bytes();
    meter.reset_peak();
    work();
    meter.peak_bytes() - before
}

/// Bytes by which `work` raised `device`'s peak. On Flex, whose peak resets, that is what
/// `work` held at its peak above what was live before, as [`peak_of`]. A Cube device's pools
/// only grow and count since the device started, so there it is how far `work` grew them: an
/// allocation that fits a page the pools already reserved counts nothing.
pub fn peak_growth_of(device: &Device, work: impl FnOnce()) -> u64 {
    let meter = burn_memwall::memory::MemoryMeter::new(device);
    meter.reset_peak();
    let before = meter.peak_bytes();
    work();
    meter.peak_bytes() - before
}

/// `dims` filled with `sin((i·0.37 + salt)·1.3)`: inputs made on the host, so that Flex and
/// wgpu get the same ones and no test draws from a backend's shared RNG.
pub fn host_tensor<const D: usize>(dims: [usize; D], salt: f32, device: &Device) -> Tensor<D> {
    let n = dims.iter().product::<usize>();
    let values: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.37 + salt) * 1.3).sin())
        .collect();
    Tensor::<1>::from_floats(values.as_slice(), device).reshape(dims)
}

/// The rows of a matrix, in f64, for host references.
pub fn rows_of(t: Tensor<2>) -> Vec<Vec<f64>> {
    let [_, n] = t.dims();
    let values = t.into_data().try_into_vec_as::<f64>().unwrap();
    values.chunks(n).map(<[f64]>::to_vec).collect()
}

/// Rows back into a `[rows, columns]` matrix of data.
pub fn flat(rows: &[Vec<f64>]) -> TensorData {
    TensorData::new(rows.concat(), [rows.len(), rows[0].len()])
}

/// Every parameter's values, in the module's visiting order.
pub fn parameters<M: burn::module::Module>(model: &M) -> Vec<TensorData> {
    use burn::module::{ModuleVisitor, Param};
    struct Collect(Vec<TensorData>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().into_data());
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// `steps` training steps of `config` measured as memgate measures them (learning rate 1e-3,
/// seed 7, f32), `batch` windows per step.
pub fn measure_steps(
    config: &burn_memwall_models::lm::LmConfig,
    optimizer: burn_memwall_models::training::StepOptimizer,
    windows: &[Vec<u32>],
    batch: usize,
    steps: usize,
    device: &Device,
) -> burn_memwall_models::training::StepMeasurement {
    measure_run(
        config,
        step_training(optimizer, batch),
        windows,
        steps,
        device,
    )
}

/// How [`measure_steps`] trains: `batch` windows per step, learning rate 1e-3, seed 7.
pub fn step_training(
    optimizer: burn_memwall_models::training::StepOptimizer,
    batch: usize,
) -> burn_memwall_models::training::TrainingConfig {
    burn_memwall_models::training::TrainingConfig::new()
        .with_batch_size(batch)
        .with_learning_rate(1e-3)
        .with_optimizer(optimizer)
        .with_seed(7)
}

/// `steps` training steps of `config` trained as `training` says, measured as memgate
/// measures them.
pub fn measure_run(
    config: &burn_memwall_models::lm::LmConfig,
    training: burn_memwall_models::training::TrainingConfig,
    windows: &[Vec<u32>],
    steps: usize,
    device: &Device,
) -> burn_memwall_models::training::StepMeasurement {
    use burn_memwall_models::training::{RunConfig, measure_training_steps};
    measure_training_steps(
        &RunConfig::new(config.clone(), training),
        windows,
        steps,
        device,
    )
    .unwrap()
}
