//! Compiles the VMM's seccomp filters (`seccomp/x86_64.json`, seccompiler's
//! JSON format) into BPF at build time, so a thread installs its filter
//! without parsing anything (docs/design/isolation.md, "seccomp").
//!
//! Two filters of the file are not threads:
//! - `common` is added to every other filter (what any Rust thread needs);
//! - `api` gets every other filter's rules on top of its own: the API
//!   thread fork(2)s the VMM, and a forked process runs everything (it
//!   restores a vm and starts its threads, whose filters stack on the one
//!   it inherited: the kernel takes the strictest answer of all).
//!
//! Each filter is emitted twice: killing the process on any other syscall
//! (the default), and logging it instead (`TINE_SECCOMP=log`, to find what
//! a list lacks).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Map, Value};

const SOURCE: &str = "seccomp/x86_64.json";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(SOURCE).unwrap_or_else(|e| panic!("{SOURCE}: {e}"));
    let file: Map<String, Value> =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{SOURCE}: {e}"));
    let rules_of = |name: &str| -> Vec<Value> {
        file.get(name)
            .and_then(|f| f.get("filter"))
            .and_then(Value::as_array)
            .unwrap_or_else(|| panic!("{SOURCE}: no filter `{name}` with a `filter` list"))
            .clone()
    };
    let common = rules_of("common");
    let threads: Vec<&String> = file.keys().filter(|k| *k != "common").collect();
    let mut out = String::from(
        "/// (thread category, program trapping a syscall not allowed (SIGSYS, \
         fatal unless vmm::seccomp::report_violations caught it: it reports \
         and ends the process), program logging it); each instruction is (code, jt, jf, k).\n\
         #[allow(clippy::type_complexity)]\n\
         pub const FILTERS: &[(&str, &[(u16, u8, u8, u32)], &[(u16, u8, u8, u32)])] = &[\n",
    );
    for name in &threads {
        let mut rules = rules_of(name);
        rules.extend(common.iter().cloned());
        if *name == "api" {
            for other in threads.iter().filter(|o| **o != "api") {
                rules.extend(rules_of(other));
            }
        }
        let rules = merge(name, rules);
        let kill = compile(name, &rules, "trap");
        let log = compile(name, &rules, "log");
        let _ = writeln!(out, "    ({name:?}, &{kill:?}, &{log:?}),");
    }
    out.push_str("];\n");
    let dest = std::path::Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("seccomp.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("{}: {e}", dest.display()));
}

/// One entry per syscall: unconditional if any rule for it is (seccompiler
/// would otherwise keep only the conditional ones, silently narrowing the
/// filter), else every distinct condition list. Within one filter of the
/// file, mixing both for a syscall is a mistake and fails the build.
fn merge(name: &str, rules: Vec<Value>) -> Vec<Value> {
    let mut by_syscall: BTreeMap<String, Option<Vec<Value>>> = BTreeMap::new();
    for r in rules {
        let syscall = r
            .get("syscall")
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("{SOURCE}: `{name}`: a rule without `syscall`"))
            .to_string();
        let args = r.get("args").cloned();
        let entry = by_syscall
            .entry(syscall)
            .or_insert_with(|| args.is_some().then(Vec::new));
        match (entry.as_mut(), args) {
            (Some(list), Some(a)) => {
                let a = strip_comments(a);
                if !list.contains(&a) {
                    list.push(a);
                }
            }
            _ => *entry = None,
        }
    }
    by_syscall
        .into_iter()
        .flat_map(|(syscall, args)| match args {
            None => vec![json!({ "syscall": syscall })],
            Some(list) => list
                .into_iter()
                .map(|a| json!({ "syscall": syscall, "args": a }))
                .collect(),
        })
        .collect()
}

fn strip_comments(args: Value) -> Value {
    match args {
        Value::Array(conds) => Value::Array(
            conds
                .into_iter()
                .map(|mut c| {
                    if let Some(o) = c.as_object_mut() {
                        o.remove("comment");
                    }
                    c
                })
                .collect(),
        ),
        other => other,
    }
}

fn compile(name: &str, rules: &[Value], mismatch: &str) -> Vec<(u16, u8, u8, u32)> {
    let doc = json!({ name: {
        "mismatch_action": mismatch,
        "match_action": "allow",
        "filter": rules,
    }});
    let map =
        seccompiler::compile_from_json(doc.to_string().as_bytes(), seccompiler::TargetArch::x86_64)
            .unwrap_or_else(|e| panic!("{SOURCE}: filter `{name}`: {e}"));
    map[name]
        .iter()
        .map(|i| (i.code, i.jt, i.jf, i.k))
        .collect()
}
