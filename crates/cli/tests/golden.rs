//! Golden snapshots: one checked-in snapshot directory per state format
//! and CPU vendor (`tests/golden/<major.minor>-<amd|intel>/`:
//! manifest.json, state, memory.zst, of a micro-memtouch vm at 64 MiB). A
//! snapshot holds its guest's CPU, so it restores only on a host of its
//! vendor. Each build must restore every golden its read rule accepts
//! that was taken on this host's vendor, refuse the other vendor's by
//! naming the CPU (after reading its state), and refuse unreadable
//! formats with a message naming the format; and the state this build
//! writes must have the shape of the current format's golden, so a change
//! to a state struct without a version bump fails here.
//!
//! A new format's golden, or a vendor's first: bump
//! `snapshot::FORMAT_VERSION` (not for a vendor), then
//! `TINE_GOLDEN_WRITE=1 cargo test -p tine-cli --test golden` on a host of
//! each vendor writes `tests/golden/<version>-<vendor>/` (commit them).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{kvm_available, Home, TempDir};

fn golden_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// This host's CPU vendor as golden directories name it.
fn host_vendor() -> &'static str {
    let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
    if info.contains("AuthenticAMD") {
        "amd"
    } else if info.contains("GenuineIntel") {
        "intel"
    } else {
        panic!("a CPU vendor golden snapshots do not know")
    }
}

/// A golden directory's name: its format and the vendor it was taken on.
fn golden_name(dir: &Path) -> Option<(snapshot::Version, String)> {
    let (v, vendor) = dir.file_name()?.to_str()?.split_once('-')?;
    Some((v.parse().ok()?, vendor.to_string()))
}

fn console(h: &Home, vm: &str) -> String {
    std::fs::read_to_string(h.0.path().join("vms").join(vm).join("console.log")).unwrap_or_default()
}

fn wait_console(h: &Home, vm: &str, from: usize, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !console(h, vm).get(from..).unwrap_or("").contains(needle) {
        assert!(Instant::now() < deadline, "{vm} never printed {needle:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every JSON path of `v` with its value's kind; arrays are one element
/// (their items' union).
fn shape(v: &serde_json::Value, at: &str, out: &mut BTreeSet<String>) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            out.insert(format!("{at}: object"));
            for (k, v) in m {
                shape(v, &format!("{at}.{k}"), out);
            }
        }
        Value::Array(a) => {
            out.insert(format!("{at}: array"));
            for v in a {
                shape(v, &format!("{at}[]"), out);
            }
        }
        Value::Null => {
            out.insert(format!("{at}: null"));
        }
        Value::Bool(_) => {
            out.insert(format!("{at}: bool"));
        }
        Value::Number(_) => {
            out.insert(format!("{at}: number"));
        }
        Value::String(_) => {
            out.insert(format!("{at}: string"));
        }
    }
}

fn state_shape(dir: &Path) -> BTreeSet<String> {
    let text = std::fs::read(dir.join("manifest.json")).expect("manifest");
    let state = std::fs::read(dir.join("state")).expect("state");
    let v: serde_json::Value =
        snapshot::decode_sealed(&state, &snapshot::Seal::of_manifest(&text, None))
            .expect("the state decodes");
    let m: serde_json::Value = serde_json::from_slice(&text).expect("manifest json");
    let mut out = BTreeSet::new();
    shape(&v, "state", &mut out);
    shape(&m, "manifest", &mut out);
    // Values that differ between hosts or runs, not in kind.
    out.retain(|p| {
        !p.starts_with("manifest.compat.cpuid") && !p.starts_with("manifest.compat.msrs")
    });
    out
}

/// A snapshot of a fresh micro-memtouch vm, written by this build.
fn take(h: &Home, to: &Path) {
    h.ok(&[
        "run",
        "--name",
        "g",
        "--image",
        "micro-memtouch",
        "--mem",
        "64M",
    ]);
    wait_console(h, "g", 0, "READY");
    h.ok(&["snapshot", "g", "--to", to.to_str().expect("utf8")]);
    h.ok(&["rm", "--force", "g"]);
}

/// A golden unpacked into `to` (memory decompressed).
fn unpack(golden: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for f in ["manifest.json", "state"] {
        std::fs::copy(golden.join(f), to.join(f)).expect("copy");
    }
    let z = std::fs::read(golden.join("memory.zst")).expect("memory.zst");
    let mem = zstd::decode_all(&z[..]).expect("zstd");
    std::fs::write(to.join("memory"), mem).expect("memory");
}

#[test]
fn test_every_golden_snapshot_restores_or_is_refused_by_name() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("golden");
    let work = TempDir::new("goldenwork");
    let current = snapshot::FORMAT_VERSION.to_string();
    let written = work.path().join("now");
    take(&h, &written);
    let vendor = host_vendor();
    let mine = golden_root().join(format!("{current}-{vendor}"));
    if !mine.is_dir() {
        if std::env::var_os("TINE_GOLDEN_WRITE").is_some() {
            std::fs::create_dir_all(&mine).expect("mkdir");
            for f in ["manifest.json", "state"] {
                std::fs::copy(written.join(f), mine.join(f)).expect("copy");
            }
            let mem = std::fs::read(written.join("memory")).expect("memory");
            let z = zstd::encode_all(&mem[..], 19).expect("zstd");
            std::fs::write(mine.join("memory.zst"), z).expect("write");
        } else {
            panic!(
                "no golden snapshot for state format {current} in {}: write it with TINE_GOLDEN_WRITE=1 cargo test -p tine-cli --test golden, and commit it",
                golden_root().display()
            );
        }
    }
    // The state this build writes has the shape of its format's golden.
    let (now, gold) = (state_shape(&written), state_shape(&mine));
    let added: Vec<_> = now.difference(&gold).collect();
    let gone: Vec<_> = gold.difference(&now).collect();
    assert!(
        added.is_empty() && gone.is_empty(),
        "the snapshot state changed without a format version bump (still {current}): new {added:#?}, gone {gone:#?}. Bump snapshot::FORMAT_VERSION (minor for added fields with defaults, major otherwise) and write its golden"
    );

    let mut seen = 0;
    for entry in std::fs::read_dir(golden_root()).expect("golden dir") {
        let golden = entry.expect("entry").path();
        let Some((version, taken_on)) = golden_name(&golden) else {
            continue;
        };
        seen += 1;
        let dir = work.path().join(format!("v{version}-{taken_on}"));
        unpack(&golden, &dir);
        let name = format!("g{}x{}{taken_on}", version.major, version.minor);
        let args = [
            "run",
            "--name",
            &name,
            "--from",
            dir.to_str().expect("utf8"),
        ];
        if snapshot::FORMAT_VERSION.reads(version) && taken_on != vendor {
            // Read, then refused for its CPU, by name.
            let out = h.out(&args);
            let e = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{taken_on}'s {version} restored");
            assert!(
                e.contains("CPU vendor: the snapshot needs"),
                "{taken_on}'s {version}: {e}"
            );
        } else if snapshot::FORMAT_VERSION.reads(version) {
            h.ok(&args);
            // It continues: memtouch answers, with the memory it had.
            let from = console(&h, &name).len();
            h.ok(&["console", &name, "--send", "ping"]);
            wait_console(&h, &name, from, "PONG");
            h.ok(&["rm", "--force", &name]);
        } else {
            let out = h.out(&args);
            let e = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "format {version} restored");
            assert!(
                e.contains(&format!("format {version}")),
                "format {version}: {e}"
            );
        }
    }
    assert!(seen >= 1, "no golden snapshots");
}
