//! Definitions named on a command line: a built-in's name or a file, read within the size a
//! definition may have.

use std::io::Read;

use rein_core::{Definition, Format, GuardRegistry, builtin};

/// Loads a definition from a built-in name or a file path.
pub fn load_definition(name_or_file: &str) -> Result<Definition, String> {
    if let Some(result) = builtin::load(name_or_file) {
        return result.map_err(|e| format!("built-in definition {name_or_file}: {e}"));
    }
    let text = read_file_limited(name_or_file, rein_core::limits::DEFINITION_BYTES_MAX)?;
    Definition::parse(
        &text,
        Format::from_path(name_or_file),
        &GuardRegistry::new(),
    )
    .map_err(|e| e.to_string())
}

pub fn read_file_limited(path: &str, limit: usize) -> Result<String, String> {
    let file = std::fs::File::open(path).map_err(|e| {
        format!(
            "cannot open `{path}`: {e} (built-in definitions: {})",
            builtin::ALL
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let mut text = String::new();
    file.take(limit as u64 + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read `{path}`: {e}"))?;
    if text.len() > limit {
        return Err(format!(
            "`{path}` is larger than the limit of {limit} bytes"
        ));
    }
    Ok(text)
}
