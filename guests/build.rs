//! Builds the micro guests (`micro/*.rs`) into freestanding static ELF
//! executables in OUT_DIR by invoking `$RUSTC` directly: `#![no_std]`,
//! `#![no_main]`, linked at 1 MiB with `micro/link.ld`.

use std::path::{Path, PathBuf};
use std::process::Command;

const GUESTS: &[&str] = &["counter", "memtouch", "blkio", "cpuid"];

fn main() {
    let manifest = PathBuf::from(env("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env("OUT_DIR"));
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let micro = manifest.join("micro");
    let script = micro.join("link.ld");

    println!("cargo:rerun-if-changed={}", script.display());
    println!("cargo:rerun-if-changed={}", micro.join("rt.rs").display());
    for guest in GUESTS {
        let src = micro.join(format!("{guest}.rs"));
        println!("cargo:rerun-if-changed={}", src.display());
        build(&rustc, &src, &script, &out.join(guest), &out);
    }
}

fn build(rustc: &str, src: &Path, script: &Path, dst: &Path, out: &Path) {
    let mut cmd = Command::new(rustc);
    // The guests are built for the host triple's x86_64 target regardless of
    // what the crate is built for; they only run inside a VM.
    cmd.args(["--edition", "2021", "--crate-type", "bin"])
        .args(["--target", "x86_64-unknown-linux-gnu"])
        .args(["-C", "panic=abort", "-C", "relocation-model=static"])
        .args(["-C", "opt-level=2", "-C", "codegen-units=1"])
        .args(["-C", "debuginfo=0", "-C", "strip=debuginfo"])
        .args(["-C", "target-feature=+crt-static"])
        .args(["-C", "link-arg=-nostdlib", "-C", "link-arg=-static"])
        .arg("-C")
        .arg(format!("link-arg=-Wl,-T,{}", script.display()))
        .args(["-C", "link-arg=-Wl,--build-id=none"])
        .arg("--out-dir")
        .arg(out)
        .arg("-o")
        .arg(dst)
        .arg(src)
        // Cargo's flags for this crate (e.g. coverage) must not leak in.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTC_WRAPPER");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {rustc} to build {}: {e}", src.display()));
    assert!(
        status.success(),
        "building micro guest {} failed",
        src.display()
    );
}

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key} not set by cargo"))
}
