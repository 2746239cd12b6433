use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::DevDbError;

/// The programs a private server needs; a directory only counts when it has
/// all of them, because distro wrappers (Debian's `pg_wrapper`) put some of
/// them on PATH without the rest.
const REQUIRED: [&str; 3] = ["initdb", "pg_ctl", "postgres"];

/// Finds the PostgreSQL server binaries using the real `PATH` and the
/// Debian/Ubuntu layout under `/usr/lib/postgresql`.
pub fn find_pg_bin_dir() -> Result<PathBuf, DevDbError> {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    find_pg_bin_dir_in(&path_var, Path::new("/usr/lib/postgresql"))
}

/// Like [`find_pg_bin_dir`], with the search inputs injectable so the
/// "nothing installed" path can be tested on a machine that has PostgreSQL.
///
/// PATH wins so a developer can pick a version by putting it first; symlinks
/// are resolved because Debian installs only a few tools into `/usr/bin` and
/// the rest sit next to the real `initdb`. Under `lib_root` the highest
/// version wins, since newer servers read older tools' expectations fine.
pub fn find_pg_bin_dir_in(path_var: &OsStr, lib_root: &Path) -> Result<PathBuf, DevDbError> {
    for dir in std::env::split_paths(path_var) {
        let initdb = dir.join("initdb");
        if !is_executable(&initdb) {
            continue;
        }
        let Ok(resolved) = std::fs::canonicalize(&initdb) else {
            continue;
        };
        if let Some(real_dir) = resolved.parent()
            && has_all(real_dir)
        {
            return Ok(real_dir.to_path_buf());
        }
    }

    let mut versions: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(lib_root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = parse_version(&entry.file_name().to_string_lossy())?;
            let bin = entry.path().join("bin");
            has_all(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }

    Err(DevDbError::NoBinaries {
        searched: format!(
            "PATH ({}) and {}/*/bin",
            path_var.to_string_lossy(),
            lib_root.display()
        ),
    })
}

fn has_all(dir: &Path) -> bool {
    REQUIRED.iter().all(|name| is_executable(&dir.join(name)))
}

pub(crate) fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// "15" -> [15], "9.6" -> [9, 6]; anything else is not a version directory.
fn parse_version(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

/// Looks a program up on the real PATH, for the helper tools (`runuser`,
/// `chown`) whose location differs between distros.
pub(crate) fn which(name: &str) -> Option<PathBuf> {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path_var)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

#[cfg(test)]
mod tests {
    use super::parse_version;

    #[test]
    fn versions_compare_numerically() {
        assert!(parse_version("15") > parse_version("9.6"));
        assert_eq!(parse_version("common"), None);
    }
}
