//! Every external command tine's code spawns is in scripts/setup's table (so
//! a fresh machine gets its package), and the table holds on this machine.
//!
//! The scan is textual, over every `.rs` file under crates/ and bench/ (new
//! crates are picked up by themselves): `Command::new` of a string literal, and `Command::new(var)`
//! where `var` is a `&str` parameter of the enclosing function (the literal
//! arguments of that function's calls anywhere in crates/ count) or a local
//! `let var = ...` / `let Some(var) = ...` whose statement holds command-like
//! literals (`which("setpriv")`, `["/usr/bin/gdb", ...]`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Essential (always installed) Debian tools the code may spawn without a
/// table row: dash's sh, bash, coreutils.
const ESSENTIAL: &[&str] = &["sh", "dash", "bash", "true", "false", "chmod", "cat"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The commands (and files) in scripts/setup's table.
fn table() -> BTreeMap<String, String> {
    let out = Command::new(root().join("scripts/setup"))
        .arg("--list")
        .output()
        .expect("run scripts/setup --list");
    assert!(out.status.success(), "scripts/setup --list: {out:?}");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let rows: BTreeMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(c, p)| (c.to_string(), p.to_string()))
        .collect();
    assert!(
        rows.len() > 20,
        "scripts/setup --list printed too little: {text}"
    );
    rows
}

/// A table row's command name as code spawns it (`/bin/busybox` -> busybox).
fn row_names(table: &BTreeMap<String, String>) -> BTreeSet<String> {
    table
        .keys()
        .map(|c| c.rsplit('/').next().unwrap_or(c).to_string())
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name();
        if p.is_dir() {
            if name != "target" && !name.to_string_lossy().starts_with('.') {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The text between the `(` at `open` and its matching `)`.
fn balanced(s: &str, open: usize) -> Option<&str> {
    let mut depth = 0usize;
    let mut in_str = false;
    let mut prev = '\0';
    for (i, c) in s[open..].char_indices() {
        match c {
            '"' if prev != '\\' => in_str = !in_str,
            '(' | '[' if !in_str => depth += 1,
            ')' | ']' if !in_str => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[open + 1..open + i]);
                }
            }
            _ => {}
        }
        prev = if prev == '\\' && c == '\\' { '\0' } else { c };
    }
    None
}

/// The string literals in `s`.
fn literals(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(a) = rest.find('"') {
        let after = &rest[a + 1..];
        let Some(b) = after.find('"') else { break };
        out.push(&after[..b]);
        rest = &after[b + 1..];
    }
    out
}

/// The command a literal names, if it looks like one: a bare program name,
/// or an absolute path in a bin directory (its file name).
fn command_name(lit: &str) -> Option<String> {
    let ok = |n: &str| {
        !n.is_empty()
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._+-".contains(c))
    };
    if let Some((dir, name)) = lit.rsplit_once('/') {
        let bin_dir = [
            "/bin",
            "/sbin",
            "/usr/bin",
            "/usr/sbin",
            "/usr/local/bin",
            "/usr/local/sbin",
        ];
        return (bin_dir.contains(&dir) && ok(name)).then(|| name.to_string());
    }
    ok(lit).then(|| lit.to_string())
}

/// `s` without its `env!("VAR")`s: they name variables, not commands.
fn without_env(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("env!(") {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        let Some(arg) = balanced(rest, "env!".len()) else {
            break;
        };
        rest = &rest["env!".len() + arg.len() + 2..];
    }
    out.push_str(rest);
    out
}

fn is_ident(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Where a spawned command was found: "file:line".
type Found = BTreeMap<String, BTreeSet<String>>;

/// Scans `files` (path, text); returns each command and where it is spawned.
fn scan(files: &[(String, String)]) -> Found {
    let mut found = Found::new();
    // (function name, where) whose &str parameter is spawned.
    let mut spawners: Vec<(String, String)> = Vec::new();
    for (path, text) in files {
        let mut at = 0;
        while let Some(i) = text[at..].find("Command::new(") {
            let pos = at + i;
            at = pos + 1;
            let line_start = text[..pos].rfind('\n').map_or(0, |n| n + 1);
            if text[line_start..pos].trim_start().starts_with("//") {
                continue; // a comment about spawning
            }
            let open = pos + "Command::new".len();
            let Some(arg) = balanced(text, open) else {
                continue;
            };
            let line = text[..pos].lines().count().max(1);
            let here = format!("{path}:{line}");
            let arg = arg.trim();
            if arg.starts_with('"') {
                if let Some(name) = literals(arg).first().and_then(|l| command_name(l)) {
                    found.entry(name).or_default().insert(here);
                }
                continue;
            }
            let var = arg.trim_start_matches('&');
            if !is_ident(var) {
                continue; // env!(..), x.join(..), agent_bin(): tine's own programs
            }
            // The enclosing function: the last `fn ` before the spawn.
            let fn_start = text[..pos].rfind("fn ").unwrap_or(0);
            let body = &text[fn_start..pos];
            let sig_end = body.find('{').unwrap_or(body.len());
            let sig = &body[..sig_end];
            if sig.contains(&format!("{var}: &str")) {
                let name: String = sig[3..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                spawners.push((name, here));
                continue;
            }
            for pat in [
                format!("let {var} ="),
                format!("let mut {var} ="),
                format!("let Some({var}) ="),
            ] {
                let Some(l) = body.rfind(&pat) else { continue };
                let stmt = &body[l..];
                let end = [stmt.find(';'), stmt.find(" else")]
                    .into_iter()
                    .flatten()
                    .min()
                    .unwrap_or(stmt.len());
                for lit in literals(&without_env(&stmt[..end])) {
                    if let Some(name) = command_name(lit) {
                        found.entry(name).or_default().insert(here.clone());
                    }
                }
            }
        }
    }
    // Calls of the spawning functions with a literal first argument.
    for (func, def) in spawners {
        let call = format!("{func}(");
        for (path, text) in files {
            let mut at = 0;
            while let Some(i) = text[at..].find(&call) {
                let pos = at + i;
                at = pos + call.len();
                let before = text[..pos].chars().last().unwrap_or(' ');
                if before.is_ascii_alphanumeric() || before == '_' || text[..pos].ends_with("fn ") {
                    continue;
                }
                let rest = text[at..].trim_start();
                if rest.starts_with('"') {
                    if let Some(name) = literals(rest).first().and_then(|l| command_name(l)) {
                        let line = text[..pos].lines().count().max(1);
                        found
                            .entry(name)
                            .or_default()
                            .insert(format!("{path}:{line} (via {def})"));
                    }
                }
            }
        }
    }
    found
}

fn tree() -> Vec<(String, String)> {
    let mut paths = Vec::new();
    // bench/ has Rust too (bench/pagein); guests/ is built by the toolchain.
    rust_files(&root().join("crates"), &mut paths);
    rust_files(&root().join("bench"), &mut paths);
    paths.sort();
    paths
        .into_iter()
        // This file's own fixture spawns nothing.
        .filter(|p| !p.ends_with("image/tests/setup.rs"))
        .filter_map(|p| {
            let text = std::fs::read_to_string(&p).ok()?;
            let rel = p.strip_prefix(root()).unwrap_or(&p).display().to_string();
            Some((rel, text))
        })
        .collect()
}

#[test]
fn test_scanner_finds_literals_parameters_and_bindings() {
    let src = r#"
fn a() { Command::new("iasl").arg("-d"); }
fn run_script(prog: &str, script: &str) { let c = Command::new(prog); }
fn b() { run_script(
    "nft", "x"); other_run_script("nope"); }
fn c() {
    let Some(setpriv) = which("setpriv") else { return };
    Command::new(setpriv);
    let Some(gdb) = ["/usr/bin/gdb", "/usr/local/bin/gdb"].into_iter().find(|p| true) else { return };
    Command::new(gdb);
    let script = concat!(env!("X"), "/../tests/s3-server.sh");
    Command::new(script);
    Command::new(env!("CARGO_BIN_EXE_tine"));
    Command::new(root.join("scripts/build-agent"));
}
"#;
    let found = scan(&[("x.rs".into(), src.into())]);
    let names: Vec<&str> = found.keys().map(String::as_str).collect();
    assert_eq!(names, ["gdb", "iasl", "nft", "setpriv"], "{found:#?}");
}

#[test]
fn test_every_spawned_command_is_in_scripts_setup() {
    let table = table();
    let names = row_names(&table);
    let found = scan(&tree());
    // The scan reaches the code: these are spawned by literal, through a
    // function parameter (cli's run_script, a test helper in another file),
    // and through a binding (which("setpriv")).
    for known in [
        "debootstrap",
        "mkfs.ext4",
        "nft",
        "ip",
        "setpriv",
        "qemu-img",
    ] {
        assert!(
            found.contains_key(known),
            "the scan did not find {known}: {found:#?}"
        );
    }
    let missing: Vec<String> = found
        .iter()
        // tine's own programs, and names tests make up to be absent.
        .filter(|(name, _)| !name.starts_with("tine"))
        .filter(|(name, _)| !names.contains(*name) && !ESSENTIAL.contains(&name.as_str()))
        .map(|(name, at)| {
            format!(
                "{name} (spawned at {})",
                at.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    assert!(
        missing.is_empty(),
        "commands the code spawns that scripts/setup's table lacks (add a row: command, Debian package, who uses it):\n  {}",
        missing.join("\n  ")
    );
}

/// testhost/setup's own list is part of scripts/setup's table.
#[test]
fn test_testhost_setup_packages_are_in_the_table() {
    let table = table();
    let text = std::fs::read_to_string(root().join("testhost/setup")).expect("read testhost/setup");
    let mut seen = 0;
    for line in text.lines() {
        let line = line.trim();
        let Some((cmd, pkg)) = line.strip_prefix('[').and_then(|l| l.split_once("]=")) else {
            continue;
        };
        let pkg = pkg.split_whitespace().next().unwrap_or_default();
        seen += 1;
        assert_eq!(
            table.get(cmd).map(String::as_str),
            Some(pkg),
            "testhost/setup needs {cmd} from {pkg}; scripts/setup's table must say so"
        );
    }
    assert!(
        seen > 5,
        "found no [command]=package lines in testhost/setup"
    );
}

/// The table holds here: each command present, from its package (CI runs
/// the same check as its own step).
#[test]
fn test_scripts_setup_check_passes() {
    let out = Command::new(root().join("scripts/setup"))
        .arg("--check")
        .output()
        .expect("run scripts/setup --check");
    assert!(
        out.status.success(),
        "scripts/setup --check failed (run scripts/setup as root):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
