//! Weights on disk: safetensors export/import, and writes that never leave half a file.

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::FloatDType;

use crate::Error;

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, so a
/// crash (of the program or of the machine) leaves either the old file or the new one, never a
/// truncated one.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = temporary_sibling(path);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
    replace_durably(&tmp, path)
}

/// Renames the finished file `tmp` to `path` once its bytes are on disk, then syncs the folder
/// so that the rename is too: without both, a power loss can leave the new name on an empty or
/// half-written file.
fn replace_durably(tmp: &Path, path: &Path) -> Result<(), Error> {
    let file = std::fs::File::open(tmp).map_err(|e| Error::io(tmp, e))?;
    file.sync_all().map_err(|e| Error::io(tmp, e))?;
    drop(file);
    std::fs::rename(tmp, path).map_err(|e| Error::io(path, e))?;
    let folder = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    // Folders cannot be opened for syncing on Windows; there the rename is what it is.
    #[cfg(unix)]
    std::fs::File::open(folder)
        .and_then(|folder| folder.sync_all())
        .map_err(|e| Error::io(folder, e))?;
    Ok(())
}

fn temporary_sibling(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    path.with_file_name(name)
}

/// Saves every parameter of `module` as a safetensors file (written atomically).
pub fn save_safetensors<M: Module>(module: &M, path: impl AsRef<Path>) -> Result<(), Error> {
    save_safetensors_with(module, path.as_ref(), |store| store)
}

/// [`save_safetensors`] through the store `configure` makes (names, adapters).
pub(crate) fn save_safetensors_with<M: Module>(
    module: &M,
    path: &Path,
    configure: impl FnOnce(SafetensorsStore) -> SafetensorsStore,
) -> Result<(), Error> {
    let tmp = temporary_sibling(path);
    let mut store = configure(SafetensorsStore::from_file(&tmp).overwrite(true));
    module
        .save_into(&mut store)
        .map_err(|e| Error::Checkpoint {
            path: path.into(),
            reason: e.to_string(),
        })?;
    // The store writes through a private temporary file (mode 0600); weights are for sharing.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
            .map_err(|e| Error::io(&tmp, e))?;
    }
    replace_durably(&tmp, path)
}

/// Loads a safetensors file into `module`; every tensor must be present with the module's shape
/// (a file from another config is rejected, naming the first mismatched tensors).
pub fn load_safetensors<M: Module>(module: M, path: impl AsRef<Path>) -> Result<M, Error> {
    read_safetensors(module, path.as_ref()).map(in_device_precision)
}

/// [`load_safetensors`] with each parameter in the type the file stored.
pub(crate) fn read_safetensors<M: Module>(module: M, path: &Path) -> Result<M, Error> {
    if !path.exists() {
        return Err(Error::io(path, std::io::ErrorKind::NotFound.into()));
    }
    let fail = |reason: String| Error::Checkpoint {
        path: path.into(),
        reason,
    };
    let mut module = module;
    let mut store = SafetensorsStore::from_file(path);
    let result = module
        .load_from(&mut store)
        .map_err(|e| fail(e.to_string()))?;
    if !result.errors.is_empty() || !result.missing.is_empty() || !result.unused.is_empty() {
        return Err(fail(format!(
            "does not match the model: errors {:?}, missing {:?}, unexpected {:?}",
            result.errors, result.missing, result.unused
        )));
    }
    Ok(module)
}

/// `module` with every float parameter in its device's default float type. A loaded parameter
/// keeps the type its file stored (a bf16 checkpoint gives bf16 tensors), and Burn's ops do not
/// mix float types: a model trained or served in another precision than its file's is cast
/// once, here.
pub(crate) fn in_device_precision<M: Module>(module: M) -> M {
    in_precision(module, None)
}

/// `module` with every float parameter in `float`, or where `None` in its device's default
/// float type ([`in_device_precision`]): `float` casts a model prepared on the host for a
/// device whose default differs.
pub(crate) fn in_precision<M: Module>(module: M, float: Option<FloatDType>) -> M {
    struct ToPrecision(Option<FloatDType>);
    impl ModuleMapper for ToPrecision {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let value = param.val();
            let dtype = self
                .0
                .unwrap_or_else(|| value.device().settings().float_dtype);
            if value.dtype() == dtype.into() {
                return param;
            }
            let trains = value.is_require_grad();
            // Cast outside autodiff: the cast weight is a new leaf, not a node of the old one.
            let cast = Tensor::from_inner(value.inner().cast(dtype));
            Param::initialized(param.id, cast.set_require_grad(trains))
        }
    }
    module.map(&mut ToPrecision(float))
}
