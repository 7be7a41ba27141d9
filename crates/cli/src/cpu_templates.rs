//! `tine cpu-templates`: the built-in CPU templates and whether this
//! host satisfies each (docs/design/cpu-templates.md); `show` prints one
//! (or checks a custom template file) as JSON, the starting point of a
//! custom template. Read here, from this host's /dev/kvm: no tined needed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use vmm::cpu_template::{self, Template};

/// `tine cpu-templates [ls|show NAME|FILE] [--json]`.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct CpuTemplatesArgs {
    #[command(subcommand)]
    cmd: Option<CpuTemplatesCommand>,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Subcommand, Debug)]
enum CpuTemplatesCommand {
    /// The built-in templates, and which ones this host satisfies (the default).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// A template as JSON: a built-in one, or a custom template file,
    /// validated (a copy of `t2` is where a custom template starts).
    Show { template: String },
}

/// The KVM device whose offer is compared (tine-vmm's default).
fn kvm_device() -> PathBuf {
    std::env::var_os("TINE_KVM_DEVICE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/kvm"))
}

pub fn run(args: CpuTemplatesArgs) -> anyhow::Result<ExitCode> {
    match args.cmd {
        None => ls(args.json),
        Some(CpuTemplatesCommand::Ls { json }) => ls(json || args.json),
        Some(CpuTemplatesCommand::Show { template }) => {
            let t = resolve(&template)?;
            println!("{}", t.to_json());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn resolve(spec: &str) -> anyhow::Result<Template> {
    Ok(cpu_template::resolve(spec)?)
}

fn ls(json: bool) -> anyhow::Result<ExitCode> {
    let templates = cpu_template::builtins()?;
    let kvm = kvm_device();
    let host = vmm::compat::host_compat(&kvm);
    let rows: Vec<serde_json::Value> = templates
        .iter()
        .map(|t| {
            let (satisfied, missing) = match &host {
                Ok(h) => match h.satisfies(t) {
                    Ok(()) => (Some(true), Vec::new()),
                    Err(gaps) => (Some(false), gaps.iter().map(|g| g.to_string()).collect()),
                },
                Err(_) => (None, Vec::new()),
            };
            serde_json::json!({
                "name": t.name,
                "hash": t.hash(),
                "description": t.description,
                "satisfied": satisfied,
                "missing": missing,
            })
        })
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    if let Err(e) = &host {
        eprintln!(
            "tine: cannot read this host's CPU offer from {}: {e}",
            kvm.display()
        );
    }
    println!(
        "{:<6} {:<10} {:<13} DESCRIPTION",
        "NAME", "THIS HOST", "HASH"
    );
    for (t, row) in templates.iter().zip(&rows) {
        let here = match row["satisfied"].as_bool() {
            Some(true) => "satisfies",
            Some(false) => "lacks",
            None => "?",
        };
        // The description's first clause; `show` has all of it.
        let summary = t.description.split(": ").next().unwrap_or_default();
        println!(
            "{:<6} {:<10} {:<13} {summary}",
            t.name,
            here,
            &t.hash()[..12],
        );
        if let Some(missing) = row["missing"].as_array() {
            for m in missing.iter().filter_map(|m| m.as_str()) {
                println!("         - {m}");
            }
        }
    }
    println!("Use: tine run --cpu-template NAME|FILE (a custom template: tine cpu-templates show t2 > mine.json, then edit)");
    Ok(ExitCode::SUCCESS)
}

/// `tine run --cpu-template X` as tined gets it: a built-in name, or the
/// absolute path of a custom template file that was checked here first
/// (tined's working directory is not ours).
pub fn for_run(spec: &str) -> anyhow::Result<String> {
    if let Some(t) = cpu_template::builtin(spec) {
        return Ok(t?.name);
    }
    let path = crate::verbs::absolute(Path::new(spec))?;
    Template::from_file(&path).with_context(|| {
        format!(
            "--cpu-template {spec}: not a built-in template ({})",
            cpu_template::builtin_names().join(", ")
        )
    })?;
    Ok(path.display().to_string())
}
