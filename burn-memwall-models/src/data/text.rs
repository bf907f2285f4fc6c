//! Where training text comes from: the embedded default corpus or a UTF-8 file.

use std::path::Path;

use crate::Error;

/// Fables retold by the project (15 KB, in the repository): trains with no download and no file.
pub const DEFAULT_CORPUS: &str = include_str!("../../corpus/fables.txt");

/// The text of `path`, or the embedded corpus when `path` is `None`.
pub fn load_text(path: Option<&Path>) -> Result<String, Error> {
    let Some(path) = path else {
        return Ok(DEFAULT_CORPUS.to_owned());
    };
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::Data(format!(
            "{} is not UTF-8 text (byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    if text.trim().is_empty() {
        return Err(Error::Data(format!("{} is empty", path.display())));
    }
    Ok(text)
}
