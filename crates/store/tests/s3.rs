//! The store over the S3 backend, against a real S3-compatible server
//! (moto's server mode, see tests/s3-server.sh) that each test starts on
//! a free loopback port: the same scenarios as tests/local.rs.
//!
//! Without the server installed the tests are skipped with a loud message,
//! except under CI (`CI` set), where that is a failure: scripts/setup
//! installs it.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use store::*;

const BUCKET: &str = "tine";
const KEY: &str = "tine-test";
const SECRET: &str = "tine-test-secret";

struct Server {
    child: Child,
    endpoint: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn server_binary() -> Option<PathBuf> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/s3-server.sh");
    let out = Command::new(script).arg("path").output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().into())
}

/// Starts a server with one bucket, or None (loudly) if none is installed.
fn start() -> Option<Server> {
    let Some(bin) = server_binary() else {
        let msg = "S3 TESTS SKIPPED: no S3 server installed; run `crates/store/tests/s3-server.sh install` (scripts/setup does)";
        if std::env::var_os("CI").is_some() {
            panic!("{msg} — and this is CI, where it must be installed");
        }
        eprintln!("\n!!!!!!!! {msg} !!!!!!!!\n");
        return None;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cmd = Command::new(&bin);
    cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and only
    // affects the child being started: it dies with this test's thread
    // even if the test aborts.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    let server = Server {
        child,
        endpoint: format!("http://127.0.0.1:{port}"),
    };
    let t0 = Instant::now();
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{} did not listen on port {port}",
            bin.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // CreateBucket (path style); the store itself never creates buckets.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "PUT /{BUCKET} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "CreateBucket: {resp}");
    println!("S3 server: {} at {}", bin.display(), server.endpoint);
    Some(server)
}

struct S3Opener {
    dir: PathBuf,
    cfg: S3Config,
}

impl S3Opener {
    fn new(server: &Server, dir: PathBuf, prefix: &str) -> S3Opener {
        S3Opener {
            dir,
            cfg: S3Config {
                bucket: BUCKET.into(),
                prefix: prefix.into(),
                endpoint: Some(server.endpoint.clone()),
                region: Some("us-east-1".into()),
                access_key_id: Some(KEY.into()),
                secret_access_key: Some(SECRET.into()),
                allow_http: true,
            },
        }
    }

    fn from_env() -> S3Opener {
        S3Opener {
            dir: std::env::var("TINE_STORE_TEST_DIR").unwrap().into(),
            cfg: S3Config::from_url(&std::env::var(BACKEND_ENV).unwrap()).unwrap(),
        }
    }
}

impl Opener for S3Opener {
    fn open(&self) -> Store {
        let mut c = StoreConfig::local(&self.dir);
        c.backend = BackendConfig::S3(self.cfg.clone());
        Store::open(c).unwrap()
    }
    fn child_env(&self) -> Vec<(String, String)> {
        let c = &self.cfg;
        vec![
            ("TINE_STORE_TEST_DIR".into(), self.dir.display().to_string()),
            (BACKEND_ENV.into(), c.url()),
            ("AWS_ENDPOINT_URL".into(), c.endpoint.clone().unwrap()),
            ("AWS_ACCESS_KEY_ID".into(), KEY.into()),
            ("AWS_SECRET_ACCESS_KEY".into(), SECRET.into()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
        ]
    }
    fn name(&self) -> &str {
        "s3"
    }
}

fn setup(tag: &str) -> Option<(Server, tempfile::TempDir, S3Opener)> {
    let server = start()?;
    let d = temp_dir(tag);
    let o = S3Opener::new(&server, d.path().join("store"), tag);
    Some((server, d, o))
}

#[test]
fn s3_layer_chain_round_trip() {
    let Some((_srv, _d, o)) = setup("chain") else {
        return;
    };
    common::layer_chain_round_trip(&o);
    // The chunks are in the bucket, and the cache holds copies; the
    // bucket also holds the working-set pack of the snapshot that has a
    // working set (packs are on by default for a remote store), which is
    // not cached.
    let s = o.open();
    let packs: Vec<ChunkId> = s
        .snapshots()
        .unwrap()
        .iter()
        .filter_map(|i| i.pack.map(|(id, _)| id))
        .collect();
    assert_eq!(packs.len(), 1);
    let objs: Vec<ChunkId> = s
        .chunks()
        .backend()
        .list()
        .unwrap()
        .into_iter()
        .filter(|o| !packs.contains(o) && *o != ::store::claim::CLAIM_ID)
        .collect();
    assert!(!objs.is_empty());
    assert!(s
        .chunks()
        .backend()
        .describe()
        .starts_with("s3://tine/chain"));
    assert_eq!(
        s.chunks().cache().unwrap().list().unwrap().len(),
        objs.len()
    );
}

#[test]
fn s3_ten_siblings_of_a_256mib_parent_share_it() {
    // The 1 GiB case runs on the local backend (tests/local.rs); sharing is
    // decided in the tree, the same for both backends, and moto (one Python
    // process) takes ~1 min per GiB put: a quarter keeps CI short.
    let Some((_srv, _d, o)) = setup("siblings") else {
        return;
    };
    let ratio = common::ten_siblings(&o, 256 << 20);
    println!("dedup ratio (stored / logical of parent + 10 x 8 MiB): {ratio:.3}");
}

#[test]
fn s3_working_set_pack() {
    let Some((_srv, _d, o)) = setup("pack") else {
        return;
    };
    common::pack_scenario(&o, &common::flip_pack_byte);
}

#[test]
fn s3_corrupt_chunk_is_detected_and_named() {
    let Some((_srv, d, o)) = setup("corrupt") else {
        return;
    };
    let cache_dir = d.path().join("store/cache");
    common::corrupt_chunk_detected(&o, &|s, id| {
        // Replace the object in the bucket, and drop the cached copy.
        s.chunks()
            .backend()
            .put(id, &chunk::encode(b"something else", 1).unwrap())
            .unwrap();
        LocalBackend::cache(&cache_dir).unwrap().delete(id).unwrap();
    });
}

#[test]
fn s3_gc_keeps_referenced_chunks_and_removes_the_rest() {
    let Some((_srv, _d, o)) = setup("gc") else {
        return;
    };
    common::gc_keeps_referenced(&o);
}

#[test]
fn s3_gc_racing_writers_never_breaks_a_snapshot() {
    let Some((_srv, _d, o)) = setup("gcrace") else {
        return;
    };
    common::gc_races_writers(&o);
}

#[test]
fn crash_child_s3() {
    // Runs only as the child of `s3_kill_9_and_faults_leave_a_consistent_store`.
    if is_child() {
        common::crash_child(&S3Opener::from_env());
    }
}

#[test]
fn s3_kill_9_and_faults_leave_a_consistent_store() {
    let Some((_srv, _d, o)) = setup("crash") else {
        return;
    };
    common::crash_at_every_point(&o, "crash_child_s3");
}

#[test]
fn s3_cold_cache_reads_from_the_bucket() {
    let Some((_srv, d, o)) = setup("cold") else {
        return;
    };
    let s = o.open();
    let img = synthetic_memory(16 << 20, 31);
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let snap = w.commit().unwrap();
    std::fs::remove_dir_all(d.path().join("store/cache")).unwrap();
    let s = o.open();
    let v = s.layer(snap, LayerKind::Memory).unwrap();
    assert_layer(&v, &img);
    let c = s.counters();
    assert_eq!(c.cache_hits, 0);
    assert_eq!(c.backend_reads as usize, v.chunk_ids().len(), "{c:?}");
    assert_layer(&v, &img);
    assert_eq!(s.counters().backend_reads, c.backend_reads);
}
