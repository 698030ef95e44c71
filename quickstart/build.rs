//! Marks the library compiled by this package (see `Cargo.toml`): its unit tests,
//! which need the root package's dev-dependencies, are left out here.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(proctor_quickstart)");
    println!("cargo::rustc-cfg=proctor_quickstart");
}
