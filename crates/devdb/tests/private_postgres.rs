use std::ffi::OsStr;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use rein_devdb::{
    DevDbError, PrivatePostgres, PrivatePostgresOptions, find_pg_bin_dir, find_pg_bin_dir_in,
};

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("devdb-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn psql_select_1(port: u16) -> bool {
    Command::new("psql")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
        .args(["-X", "-At", "-c", "select 1"])
        .env("PGCONNECT_TIMEOUT", "5")
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "1")
}

fn pg_isready(port: u16) -> bool {
    let bin = find_pg_bin_dir().unwrap().join("pg_isready");
    Command::new(bin)
        .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string(), "-t", "2"])
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn private_server_lifecycle() {
    let pg = PrivatePostgres::start(PrivatePostgresOptions {
        base_dir: Path::new(env!("CARGO_TARGET_TMPDIR")).join("rein-pg"),
        name: "lifecycle".to_owned(),
        fast: true,
        ..Default::default()
    });
    let mut pg = match pg {
        Ok(pg) => pg,
        Err(e) => panic!("start failed:\n{e}"),
    };
    let port = pg.port();
    assert_eq!(
        pg.url(),
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    );
    assert_eq!(
        pg.url_for_db("t1"),
        format!("postgres://postgres@127.0.0.1:{port}/t1")
    );
    assert!(pg.data_dir().join("PG_VERSION").exists());
    assert!(psql_select_1(port), "fresh server does not answer");

    if let Err(e) = pg.restart_immediate() {
        panic!("restart_immediate failed:\n{e}");
    }
    assert_eq!(pg.port(), port, "restart must keep the port");
    assert!(
        psql_select_1(port),
        "server does not answer after crash restart"
    );
    let log = std::fs::read_to_string(pg.log_file()).unwrap();
    assert!(
        log.contains("not properly shut down") || log.contains("automatic recovery"),
        "immediate stop should force crash recovery; log:\n{log}"
    );

    // Drop stops the server and leaves its files for a look; a run as root from a checkout
    // the `postgres` user cannot reach puts them in the temp dir under a name of their own,
    // which no later start wipes, so the test removes them itself.
    let dir = pg.instance_dir().to_path_buf();
    drop(pg);
    assert!(!pg_isready(port), "server still up after drop");
    assert!(dir.join("data/PG_VERSION").exists(), "{}", dir.display());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fixed_port_that_is_taken_fails_with_log_tail() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let err = PrivatePostgres::start(PrivatePostgresOptions {
        base_dir: Path::new(env!("CARGO_TARGET_TMPDIR")).join("rein-pg"),
        name: "taken".to_owned(),
        port: Some(port),
        fast: true,
        ..Default::default()
    })
    .expect_err("port is held by this test");
    let text = err.to_string();
    assert!(text.contains("could not bind"), "{text}");
    assert!(text.contains(&format!("port {port} is taken")), "{text}");
    // Nothing to inspect in a cluster that never ran: remove it wherever it was made (in
    // the temp dir when the `postgres` user could not reach target/).
    let DevDbError::StartFailed { log_file, .. } = &err else {
        panic!("not a failed start: {text}");
    };
    let dir = log_file.parent().unwrap();
    assert!(dir.join("data/PG_VERSION").exists(), "{}", dir.display());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn missing_binaries_explain_what_to_install() {
    let empty = scratch("empty");
    let err = find_pg_bin_dir_in(empty.as_os_str(), &empty.join("no-such-lib")).unwrap_err();
    assert!(matches!(err, DevDbError::NoBinaries { .. }));
    let text = err.to_string();
    for advice in [
        "apt-get install postgresql",
        "brew install postgresql",
        "DATABASE_URL",
    ] {
        assert!(text.contains(advice), "missing {advice:?} in: {text}");
    }
}

fn fake_bin(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for name in ["initdb", "pg_ctl", "postgres"] {
        let p = dir.join(name);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

#[test]
fn path_symlinks_resolve_to_the_real_bin_dir() {
    let root = scratch("symlink");
    let real = root.join("lib/postgresql/15/bin");
    fake_bin(&real);
    let path_dir = root.join("usr-local-bin");
    std::fs::create_dir_all(&path_dir).unwrap();
    symlink(real.join("initdb"), path_dir.join("initdb")).unwrap();

    let path_var = std::env::join_paths([root.join("nothing-here"), path_dir]).unwrap();
    let found = find_pg_bin_dir_in(&path_var, Path::new("/nonexistent")).unwrap();
    assert_eq!(found, real.canonicalize().unwrap());
}

#[test]
fn highest_installed_version_wins_without_path() {
    let root = scratch("versions");
    let lib = root.join("lib/postgresql");
    for v in ["9.6", "13", "15"] {
        fake_bin(&lib.join(v).join("bin"));
    }
    // A version dir without a complete bin dir must be ignored.
    std::fs::create_dir_all(lib.join("16/bin")).unwrap();
    let found = find_pg_bin_dir_in(OsStr::new(""), &lib).unwrap();
    assert_eq!(found, lib.join("15/bin"));
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Owner uid and mode of `path`.
fn owner_and_mode(path: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap();
    (m.uid(), m.mode() & 0o7777)
}

fn uid_of(user: &str) -> u32 {
    let out = Command::new("id").args(["-u", user]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn a_base_dir_the_postgres_user_cannot_reach_moves_the_server_to_a_private_dir_it_can() {
    let locked = scratch("locked");
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o700)).unwrap();
    let pg = PrivatePostgres::start(PrivatePostgresOptions {
        base_dir: locked.join("checkout/target/rein-pg"),
        name: "unreachable".to_owned(),
        fast: true,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("start failed:\n{e}"));
    if !is_root() {
        // Without root the server runs as this user, who can reach its own directories.
        assert!(pg.relocated().is_none());
        assert!(pg.data_dir().starts_with(&locked));
        return;
    }
    // Root hands the server to `postgres`, which may not enter the 0700 directory, or an
    // ancestor of it already (a checkout under /root).
    let relocated = pg.relocated().expect("the server was moved").clone();
    assert!(
        locked.starts_with(&relocated.blocked_at),
        "{relocated:?} is not blocked at {} or above it",
        locked.display()
    );
    assert_eq!(relocated.mode, owner_and_mode(&relocated.blocked_at).1);
    assert_eq!(relocated.mode, 0o700);
    assert_eq!(
        relocated.wanted,
        locked.join("checkout/target/rein-pg/unreachable")
    );
    assert_eq!(relocated.dir, pg.instance_dir());
    assert!(
        relocated.dir.starts_with(std::env::temp_dir()),
        "{relocated:?}"
    );
    assert!(!pg.data_dir().starts_with(&locked));
    assert!(pg.data_dir().starts_with(&relocated.dir));
    assert!(pg.log_file().starts_with(&relocated.dir));
    // Private: the postgres user's alone.
    assert_eq!(owner_and_mode(&relocated.dir), (uid_of("postgres"), 0o700));
    // Reported, naming both places and why.
    let said = relocated.to_string();
    for part in [
        relocated.blocked_at.display().to_string(),
        "mode 700".to_owned(),
        relocated.dir.display().to_string(),
    ] {
        assert!(said.contains(&part), "{part:?} missing in: {said}");
    }
    // Nothing was left where the server could not live.
    assert!(!relocated.wanted.exists());
    let port = pg.port();
    assert!(psql_select_1(port), "the relocated server does not answer");
    pg.discard().unwrap();
    assert!(!pg_isready(port));
    assert!(
        !relocated.dir.exists(),
        "the private directory is left behind"
    );
}

#[test]
fn discard_stops_the_server_and_removes_its_files() {
    let base = scratch("discard");
    let pg = PrivatePostgres::start(PrivatePostgresOptions {
        base_dir: base.clone(),
        name: "gone".to_owned(),
        fast: true,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("start failed:\n{e}"));
    let port = pg.port();
    assert!(psql_select_1(port), "fresh server does not answer");
    pg.discard().unwrap();
    assert!(!pg_isready(port), "server still answers after discard");
    assert!(
        !base.join("gone").exists(),
        "instance directory left behind"
    );
}
