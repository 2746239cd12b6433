//! The house rules of the workspace, checked from the code itself: which crate may depend on
//! which (read from `cargo metadata`), and no circle of imports between the files of one
//! crate (read from the `crate::…` and `super::…` paths in its sources). ARCHITECTURE.md's
//! table "crates and what each may depend on" says the same; this test keeps both true.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Each crate's floor: a crate may depend only on crates on lower floors.
const FLOORS: [(&str, u32); 13] = [
    ("rein-core", 0),
    ("rein-devdb", 0),
    ("rein-protocol-model", 0),
    ("rein-store", 1),
    ("rein-accel", 1),
    ("rein-egress", 1),
    ("rein-worker", 2),
    ("rein-scheduler", 2),
    ("rein-ops", 3),
    ("rein-process", 3),
    ("rein-api", 4),
    ("rein-lab", 5),
    ("rein", 6),
];

fn floor(name: &str) -> Option<u32> {
    FLOORS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the workspace root above crates/cli")
        .to_path_buf()
}

/// (crate, dependency, kind) for every dependency of a workspace crate on another one.
fn crate_edges() -> Vec<(String, String, String)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(workspace_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata is JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let names: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut edges = Vec::new();
    for p in packages {
        let name = p["name"].as_str().unwrap_or_default();
        for d in p["dependencies"].as_array().into_iter().flatten() {
            let dep = d["name"].as_str().unwrap_or_default();
            if names.contains(dep) {
                let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
                edges.push((name.to_owned(), dep.to_owned(), kind));
            }
        }
    }
    edges
}

/// The edges that break the floors: a crate depending on one on its own floor or above. A
/// crate's tests (dev-dependencies) are not part of it: they may drive higher floors, as the
/// store's tests drive a scheduler.
fn floor_violations(edges: &[(String, String, String)]) -> Vec<String> {
    let mut bad = Vec::new();
    for (from, to, kind) in edges {
        let (Some(f), Some(t)) = (floor(from), floor(to)) else {
            bad.push(format!("{from} -> {to}: a crate without a floor in FLOORS"));
            continue;
        };
        let allowed = t < f || kind == "dev";
        if !allowed {
            bad.push(format!("{from} (floor {f}) -> {to} (floor {t}) [{kind}]"));
        }
    }
    bad
}

#[test]
fn every_crate_depends_only_on_crates_below_it() {
    let edges = crate_edges();
    let crates: BTreeSet<&str> = edges.iter().map(|e| e.0.as_str()).collect();
    for expected in ["rein-ops", "rein-api", "rein-lab", "rein-process", "rein"] {
        assert!(crates.contains(expected), "{expected} is a workspace crate");
    }
    let bad = floor_violations(&edges);
    assert!(
        bad.is_empty(),
        "dependencies that run upward:\n{}",
        bad.join("\n")
    );
    // The two the layering is for: the API and the operations never reach the CLI or the lab.
    for (from, to, _) in &edges {
        if from == "rein-api" || from == "rein-ops" {
            assert!(to != "rein" && to != "rein-lab", "{from} -> {to}");
        }
    }
}

#[test]
fn the_floor_check_catches_an_upward_dependency() {
    let planted = vec![
        (
            "rein-ops".to_owned(),
            "rein-api".to_owned(),
            "normal".to_owned(),
        ),
        (
            "rein-core".to_owned(),
            "rein-store".to_owned(),
            "normal".to_owned(),
        ),
        (
            "rein-api".to_owned(),
            "rein-ops".to_owned(),
            "normal".to_owned(),
        ),
        (
            "rein-store".to_owned(),
            "rein-devdb".to_owned(),
            "dev".to_owned(),
        ),
    ];
    let bad = floor_violations(&planted);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(
        bad[0].starts_with("rein-ops (floor 3) -> rein-api"),
        "{bad:?}"
    );
    assert!(
        bad[1].starts_with("rein-core (floor 0) -> rein-store"),
        "{bad:?}"
    );
}

/// A crate's source files as modules: `a`, `a::b` (the crate root itself is left out: it is
/// the crate's face, which names its modules).
fn modules_of(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut modules = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source folder").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let file = parts.pop().expect("a file name");
            let stem = file.trim_end_matches(".rs").to_owned();
            if stem != "mod" {
                parts.push(stem);
            }
            if parts.is_empty() || (parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main")) {
                continue;
            }
            modules.insert(parts.join("::"), path);
        }
    }
    modules
}

/// The longest module of `modules` that `path` (`a::b::Item`) starts with.
fn module_named<'m>(modules: &'m BTreeMap<String, PathBuf>, path: &[&str]) -> Option<&'m str> {
    (1..=path.len()).rev().find_map(|n| {
        let name = path[..n].join("::");
        modules.get_key_value(&name).map(|(k, _)| k.as_str())
    })
}

/// The paths a file names from its own crate: `crate::a::b` and `super::…` resolved against
/// `module`, including every name in a `crate::{a, b::c}` group.
fn crate_paths(text: &str, module: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let code: String = text
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !t.starts_with("//")
        })
        .collect::<Vec<_>>()
        .join("\n");
    let bytes: Vec<char> = code.chars().collect();
    let parent: Vec<String> = {
        let mut p: Vec<String> = module.split("::").map(str::to_owned).collect();
        p.pop();
        p
    };
    let mut i = 0;
    while i < bytes.len() {
        let rest: String = bytes[i..bytes.len().min(i + 7)].iter().collect();
        let (prefix, skip) = if rest.starts_with("crate::") {
            (Vec::new(), 7)
        } else if rest.starts_with("super::") {
            (parent.clone(), 7)
        } else {
            i += 1;
            continue;
        };
        let before = if i == 0 { ' ' } else { bytes[i - 1] };
        if before.is_alphanumeric() || before == '_' {
            i += 1;
            continue;
        }
        i += skip;
        let mut prefix = prefix;
        while bytes[i..].starts_with(&['s', 'u', 'p', 'e', 'r', ':', ':']) {
            prefix.pop();
            i += 7;
        }
        if bytes.get(i) == Some(&'{') {
            // A group: each top-level entry is a path.
            let mut depth = 0;
            let mut entry = String::new();
            while i < bytes.len() {
                let c = bytes[i];
                match c {
                    '{' => {
                        depth += 1;
                        if depth > 1 {
                            entry.push(c);
                        }
                    }
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            push_entry(&mut paths, &prefix, &entry);
                            break;
                        }
                        entry.push(c);
                    }
                    ',' if depth == 1 => {
                        push_entry(&mut paths, &prefix, &entry);
                        entry.clear();
                    }
                    _ => entry.push(c),
                }
                i += 1;
            }
        } else {
            let mut segment = String::new();
            let mut path = prefix.clone();
            while i < bytes.len() {
                let c = bytes[i];
                if c.is_alphanumeric() || c == '_' {
                    segment.push(c);
                } else if c == ':' && bytes.get(i + 1) == Some(&':') {
                    path.push(std::mem::take(&mut segment));
                    i += 1;
                    if bytes.get(i + 1) == Some(&'{') {
                        break;
                    }
                } else {
                    break;
                }
                i += 1;
            }
            if !segment.is_empty() {
                path.push(segment);
            }
            paths.push(path);
        }
        i += 1;
    }
    paths
}

fn push_entry(paths: &mut Vec<Vec<String>>, prefix: &[String], entry: &str) {
    let head: String = entry
        .trim()
        .split(['{', ' ', '\n'])
        .next()
        .unwrap_or_default()
        .to_owned();
    let mut path = prefix.to_vec();
    path.extend(
        head.split("::")
            .filter(|s| !s.is_empty() && *s != "self")
            .map(str::to_owned),
    );
    paths.push(path);
}

/// Import edges between the files of one crate.
fn file_edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules_of(src);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, path) in &modules {
        let text = std::fs::read_to_string(path).expect("a readable source file");
        // A file's own tests may reach anywhere.
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        for p in crate_paths(text, module) {
            let segments: Vec<&str> = p.iter().map(String::as_str).collect();
            if let Some(target) = module_named(&modules, &segments)
                && target != module
            {
                edges
                    .entry(module.clone())
                    .or_default()
                    .insert(target.to_owned());
            }
        }
    }
    edges
}

/// One circle of `edges`, if there is one.
fn a_circle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node.to_owned());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, edges, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|n| visit(n, edges, &mut done, &mut Vec::new()))
}

#[test]
fn no_crate_has_a_circle_of_imports_between_its_files() {
    let crates = workspace_root().join("crates");
    let mut circles = Vec::new();
    let mut seen = 0;
    for entry in std::fs::read_dir(&crates).expect("crates/").flatten() {
        let src = entry.path().join("src");
        if !src.is_dir() {
            continue;
        }
        seen += 1;
        let edges = file_edges(&src);
        if let Some(circle) = a_circle(&edges) {
            circles.push(format!(
                "{}: {}",
                entry.path().display(),
                circle.join(" -> ")
            ));
        }
    }
    assert!(seen >= 11, "read {seen} crates");
    assert!(
        circles.is_empty(),
        "circles of imports:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_circle_check_catches_files_that_import_each_other() {
    let dir = std::env::temp_dir().join(format!("rein-layering-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("api")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod api;\nmod c;\n").unwrap();
    std::fs::write(src.join("a.rs"), "use crate::api::routes::X;\n").unwrap();
    std::fs::write(src.join("api/mod.rs"), "mod routes;\n").unwrap();
    std::fs::write(
        src.join("api/routes.rs"),
        "use super::super::c::{self, Y};\n// crate::a::ignored in a comment\n",
    )
    .unwrap();
    std::fs::write(
        src.join("c.rs"),
        "use crate::{a::Z, api};\n#[cfg(test)]\nmod tests { use crate::api::routes; }\n",
    )
    .unwrap();
    let edges = file_edges(&src);
    let circle = a_circle(&edges).expect("a -> api::routes -> c -> a is a circle");
    assert_eq!(circle.first(), circle.last(), "{circle:?}");
    assert!(circle.contains(&"api::routes".to_owned()), "{circle:?}");
    // Without the back edge there is none.
    std::fs::write(src.join("c.rs"), "use crate::api;\n").unwrap();
    assert_eq!(a_circle(&file_edges(&src)), None);
    std::fs::remove_dir_all(&dir).unwrap();
}
