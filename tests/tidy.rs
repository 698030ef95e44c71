//! Architecture checks that the compiler cannot make: the pure core in `src/` never
//! touches actix, tokio, threads or the file system, in the actor layer only the WAL
//! store (`actors/wal_store/`) touches files, and every source file opens with a `//!`
//! paragraph saying what it is (rust-analyzer's tidy test, in small).

use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    if !dir.exists() {
        return;
    }
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn files(dirs: &[&str]) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for dir in dirs {
        rust_files(&root.join(dir), &mut out);
    }
    assert!(!out.is_empty());
    out
}

#[test]
fn the_core_is_pure() {
    let forbidden = [
        "actix",
        "tokio",
        "std::fs",
        "std::thread",
        "std::net",
        "SystemTime::now",
        "Instant::now",
    ];
    let mut offences = Vec::new();
    for path in files(&["src"]) {
        let text = fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in forbidden {
                // lib.rs mounts the actor layer; that one line is the boundary.
                let mount = path.ends_with("lib.rs")
                    && (line.contains("actors") || line.contains("\"../actors/mod.rs\""));
                if code.contains(word) && !mount {
                    offences.push(format!("{}:{}: {word}", path.display(), n + 1));
                }
            }
        }
    }
    assert!(
        offences.is_empty(),
        "src/ must stay pure:\n{}",
        offences.join("\n")
    );
}

#[test]
fn only_the_wal_store_touches_files() {
    let store = Path::new(env!("CARGO_MANIFEST_DIR")).join("actors/wal_store");
    let mut offences = Vec::new();
    for path in files(&["actors"]) {
        if path.starts_with(&store) {
            continue;
        }
        let text = fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("std::fs") {
                offences.push(format!("{}:{}", path.display(), n + 1));
            }
        }
    }
    assert!(
        offences.is_empty(),
        "only actors/wal_store/ may use std::fs:\n{}",
        offences.join("\n")
    );
}

#[test]
fn every_file_says_what_it_is() {
    let missing: Vec<String> = files(&[
        "src",
        "actors",
        "tests",
        "examples",
        "benches",
        "bin",
        "admin",
        "quickstart",
    ])
    .into_iter()
    .filter(|p| !fs::read_to_string(p).unwrap().starts_with("//!"))
    .map(|p| p.display().to_string())
    .collect();
    assert!(
        missing.is_empty(),
        "files without a //! header:\n{}",
        missing.join("\n")
    );
}
